"""The reference tiers on 8 to 8,192 GPUs: `ttt plan`'s suggestion for each GPU count and device size (the
formula), and the layouts that matter simulated (`ttt plan --simulate`): per-rank peak beside the formula,
whether it fits 80/141/192 GiB devices, and what each simulation cost (wall time and peak RSS of its own
processes). One process per plan or simulation, one after another (the machine may be shared: the wall
times it prints are then inflated). Prints the two markdown tables of docs/scale.md.

    python bench/simulate_scale.py [--only NAME ...] [--gpus N ...] [--no-grid] [--no-simulate] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from scale_grid import BENCHES, GPUS, MEMS, cell, last_line

# Simulated: (benchmark, gpus, --gpu-mem whose suggestion (AC, micro-batch) is simulated, --parallel,
# --layers, extra --set). Where nothing fits the simulation runs AC as `--ac` says (here: off) at the tier's
# micro-batch.
LAYOUTS = [
    ("llama31_8b", 8, 80, "fsdp=8", 3, []),
    ("gpt_oss_20b", 8, 80, "ep=8,fsdp=8", 3, []),
    # The suggestion on 141 and 192 GiB: no AC, micro-batch 2 (one micro-batch per step).
    ("gpt_oss_20b", 8, 141, "fsdp=8", 3, []),
    ("llama2_70b_lora", 8, 80, "fsdp=8", 3, []),
    ("flux1", 8, 80, "fsdp=8", 9, []),
    ("flux1", 64, 80, "fsdp=64", 9, []),
    ("llama31_405b", 256, 80, "tp=8,fsdp=32", 3, []),
    ("llama31_405b", 1024, 80, "tp=8,fsdp=128", 3, []),
    # 8,192 GPUs = 1,024 TP groups: the global batch must split over them (a multiple of 1,152 and 1,024).
    ("llama31_405b", 8192, 80, "tp=8,fsdp=1024", 3, ["global_batch_size=9216"]),
    ("deepseekv3_671b", 256, 141, "ep=256,fsdp=256", 6, []),
    ("deepseekv3_671b", 256, 80, "ep=64,fsdp=256", 6, []),
    ("deepseekv3_671b", 1024, 80, "ep=256,fsdp=1024", 6, []),
    ("deepseekv3_671b", 1024, 80, "ep=64,fsdp=1024", 6, []),
    # The reference evaluates 1,024 sequences: under EP every rank must take part, so they must split over
    # the 8,192 ranks (ttt has no empty-batch eval rank); the training step does not depend on it.
    ("deepseekv3_671b", 8192, 80, "ep=256,fsdp=8192", 6, ["eval_samples=8192"]),
]

G = 2**30


def _run(cmd: list[str]) -> tuple[int, str, str, float, float]:
    """(exit code, stdout, stderr, wall seconds, peak RSS of the process in GiB). Output goes to files, so
    that waiting with `os.wait4` (which gives the child's own resource usage) cannot block on a full pipe."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read(), err.read(), wall, usage.ru_maxrss * 1024 / G


def _plan(bench: str, gpus: int, mem: int, extra: list[str]) -> tuple[int, str, str, float, float]:
    cmd = [sys.executable, "-m", "timetotrain", "plan", bench, "--gpus", str(gpus), "--gpu-mem", str(mem),
           "--json", *extra]  # fmt: skip
    return _run(cmd)


def grid_cell(bench: str, gpus: int, mem: int) -> str:
    """`ttt plan`'s suggestion (formula only) in a few words (bench/scale_grid.py's cell)."""
    rc, out, err, _, _ = _plan(bench, gpus, mem, [])
    return cell(rc, out, err)


def simulate(bench: str, gpus: int, mem: int, spec: str, layers: int, sets: list[str], flags=()) -> dict:
    extra = ["--parallel", spec, "--simulate", "--layers", str(layers), *flags]
    for s in sets:
        extra += ["--set", s]
    rc, out, err, wall, rss = _plan(bench, gpus, mem, extra)
    row = {"bench": bench, "gpus": gpus, "mem": mem, "parallel": spec, "layers": layers, "wall_s": wall,
           "rss_gib": rss, "sets": sets}  # fmt: skip
    if rc not in (0, 1) or not out.strip():
        row["error"] = last_line(err)
        return row
    doc = json.loads(out)
    sim = doc["simulation"]
    ranks = sim["ranks"]
    top = ranks.get(str(sim["most_loaded_rank"])) or ranks[sim["most_loaded_rank"]]
    row["peak_gib"] = sim["peak_bytes"] / G
    row["phase"] = sim["peak_phase"]
    row["ac"] = sim["ac"]
    row["micro"] = sim["micro_batch"]
    row["states_gib"] = (top["parameters"] + top["gradients"] + top["optimizer"]) / G
    est = next((r for r in doc["rows"] if r.get("simulated_gib") is not None), None)
    if est is not None:
        row["formula_gib"] = est["total_gib"] - est["margin_gib"]
        row["formula_states_gib"] = est["states_gib"]
    row["sim_s"] = sim["seconds"]
    row["depths"] = sim["layers"]  # the two simulated depths (their difference: the repeat unit)
    # The simulation's forked children hold the model: their peak, as the command measured it.
    row["rss_gib"] = max(row["rss_gib"], sim["rss"] / G)
    return row


def fits(peak_gib: float) -> str:
    return "/".join("yes" if peak_gib + 0.05 * g + 1 <= 0.9 * g else "no" for g in MEMS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--no-grid", action="store_true", help="skip the formula grid")
    ap.add_argument("--no-simulate", action="store_true", help="skip the simulations")
    ap.add_argument("--json", default=None, help="also write the simulated rows here")
    ap.add_argument(
        "--gpus", type=int, nargs="*", default=None, help="simulate only the rows of these GPU counts"
    )
    args = ap.parse_args()
    chosen = [b for b in BENCHES if not args.only or b in args.only]
    if not args.no_grid:
        print("| benchmark | GPUs | " + " | ".join(f"{m} GiB" for m in MEMS) + " |")
        print("|---|---|" + "---|" * len(MEMS))
        for bench in chosen:
            for gpus in GPUS:
                cells = [grid_cell(bench, gpus, m) for m in MEMS]
                print(f"| {bench} | {gpus:,} | " + " | ".join(cells) + " |", flush=True)
        print()
    if args.no_simulate:
        return
    rows = []
    print(
        "| benchmark | GPUs | layout | AC, micro-batch | layers simulated | per-rank peak | phase | formula | ratio "
        "| fits 80/141/192 | RSS | wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for bench, gpus, mem, spec, layers, sets in LAYOUTS:
        if bench not in chosen or (args.gpus and gpus not in args.gpus):
            continue
        r = simulate(bench, gpus, mem, spec, layers, sets)
        rows.append(r)
        label = spec + (" (" + ", ".join(sets) + ")" if sets else "")
        if "error" in r:
            print(f"| {bench} | {gpus:,} | {label} | | - | does not build: {r['error']} | | | | | "
                  f"{r['rss_gib']:.2f} GiB | {r['wall_s']:.0f} s |", flush=True)  # fmt: skip
            continue
        d = r["depths"]
        lay = f"{d[0]}+{d[1] - d[0]}" if d else "all"
        f = r.get("formula_gib")
        ratio = f"{r['peak_gib'] / f:.2f}" if f else "-"
        formula = f"{f:.1f} GiB" if f else "-"
        print(f"| {bench} | {gpus:,} | {label} | {'on' if r['ac'] else 'off'}, {r['micro']} | {lay} | "
              f"{r['peak_gib']:.1f} GiB | {r['phase']} | {formula} | {ratio} | {fits(r['peak_gib'])} | "
              f"{r['rss_gib']:.2f} GiB | {r['wall_s']:.0f} s |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
