"""Every suggestion of docs/scale.md's grid, simulated: for each benchmark's reference tier on 8, 64, 256 and
1,024 GPUs of 80 and 141 GiB, `ttt plan`'s suggestion (the formula) is built for one rank under the fake
process group (`ttt plan ... --parallel SUGGESTION --simulate --layers L`, at the suggestion's GBS, AC and
micro-batch), and its simulated peak plus the plan's margin is set against the plan's own line (90% of the
device). One simulation per distinct (layout, GBS, AC, micro-batch): cells of two device sizes with the same
suggestion share one. Each finished simulation is appended to a JSON-lines file at once, so a run cut short
keeps what it measured and the next run skips it (the simulations take 1-6 minutes each on 2 cores).

    python bench/simulate_grid.py [--only NAME ...] [--gpus N ...] [--mem G ...] [--out FILE] [--table]

`--table` prints the markdown table from the file without simulating anything.
"""

from __future__ import annotations

import argparse
import json
import os

from scale_grid import BENCHES, plan_json
from simulate_scale import simulate

# Layers simulated per benchmark (`--layers`): the least each family's extrapolation accepts, as
# bench/simulate_scale.py uses them.
LAYERS = {"llama31_8b": 3, "gpt_oss_20b": 3, "llama2_70b_lora": 3, "flux1": 9, "llama31_405b": 3,
          "deepseekv3_671b": 6, "qwen35_397b_grpo": 4}  # fmt: skip
HEADROOM = 0.9  # the plan's line (train/memory.HEADROOM)


def suggestion(bench: str, gpus: int, mem: int) -> dict | None:
    """The plan's suggestion for one cell: layout, AC, micro-batch, GBS and the formula's total and margin
    (GiB), or None where nothing fits or the batch splits over no layout."""
    rc, out, _ = plan_json(bench, gpus, mem)
    if rc != 0 or not out.strip():
        return None
    doc = json.loads(out)
    s = doc.get("suggestion")
    if s is None:
        return None
    row = next(
        r
        for r in doc["rows"]
        if (r["parallel"], r["ac"], r["micro_batch"]) == (s["parallel"], s["ac"], s["micro_batch"])
    )
    return {"parallel": s["parallel"], "ac": s["ac"], "micro": s["micro_batch"], "gbs": doc["global_batch_size"],
            "total_gib": s["total_gib"], "margin_gib": row["margin_gib"]}  # fmt: skip


def key(bench: str, gpus: int, s: dict) -> str:
    return f"{bench}|{gpus}|{s['parallel']}|{s['gbs']}|{s['ac']}|{s['micro']}"


def run_one(bench: str, gpus: int, mem: int, s: dict, layers: int) -> dict:
    sets = [f"global_batch_size={s['gbs']}", f"micro_batch_size={s['micro']}"]
    extra_ac = ["--ac"] if s["ac"] else []
    r = simulate(bench, gpus, mem, s["parallel"], layers, sets, extra_ac)
    return {**r, "key": key(bench, gpus, s)}


def retry_layers(r: dict | None, bench: str) -> int | None:
    """The depth to simulate next: the benchmark's least where not yet simulated; two layers more where the
    simulator refused to extrapolate from the last depth tried (its peak sits in a block whose place differs
    between the two depths, or a count shrinks with depth), a repeat unit more, up to twice; None when done."""
    if r is None:
        return LAYERS[bench]
    step = 3 if bench == "flux1" else 2  # flux: --layers N builds N and N+3 blocks
    refused = ("does not extrapolate", "does not grow linearly")
    if any(w in r.get("error", "") for w in refused) and r["layers"] < LAYERS[bench] + 2 * step:
        return r["layers"] + step
    return None


def load(path: str) -> dict:
    done = {}
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    done[r["key"]] = r
    return done


def table(cells: list[tuple], done: dict) -> None:
    print("| benchmark | GPUs | GiB | suggestion | formula | simulated + margin | line | within |")
    print("|---|---|---|---|---|---|---|---|")
    for bench, gpus, mem, s in cells:
        label = f"{s['parallel']}{', AC' if s['ac'] else ''}, mb {s['micro']}, GBS {s['gbs']:,}"
        r = done.get(key(bench, gpus, s))
        line = HEADROOM * mem
        if r is None:
            sim, within = "not simulated", "-"
        elif "error" in r:
            sim, within = f"refused at --layers {r['layers']}: {r['error']}", "no"
        else:
            total = r["peak_gib"] + s["margin_gib"]
            sim, within = (
                f"{total:.1f} GiB ({r['peak_gib'] / (s['total_gib'] - s['margin_gib']):.2f}x)",
                ("yes" if total <= line else "**no**"),
            )
        print(
            f"| {bench} | {gpus:,} | {mem} | {label} | {s['total_gib']:.1f} GiB | {sim} | {line:.1f} | {within} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--gpus", type=int, nargs="*", default=[8, 64, 256, 1024])
    ap.add_argument("--mem", type=int, nargs="*", default=[80, 141])
    ap.add_argument("--out", default="simulate_grid.jsonl", help="JSON lines, appended as each finishes")
    ap.add_argument("--table", action="store_true", help="print the table from --out; simulate nothing")
    args = ap.parse_args()
    cells = []
    for bench in BENCHES:
        if bench not in LAYERS or (args.only and bench not in args.only):
            continue  # dlrm_dcnv2: its plan counts tables, not a built rank
        for gpus in args.gpus:
            for mem in args.mem:
                s = suggestion(bench, gpus, mem)
                if s is not None:
                    cells.append((bench, gpus, mem, s))
    done = load(args.out)
    if not args.table:
        for bench, gpus, mem, s in cells:
            while (layers := retry_layers(done.get(key(bench, gpus, s)), bench)) is not None:
                r = run_one(bench, gpus, mem, s, layers)
                done[r["key"]] = r  # the later line of a key wins on reload, as here
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(r) + "\n")
                print(f"{r['key']} (--layers {layers}): "
                      + (r.get("error") or f"{r['peak_gib']:.1f} GiB in {r['wall_s']:.0f} s"), flush=True)  # fmt: skip
    table(cells, done)


if __name__ == "__main__":
    main()
