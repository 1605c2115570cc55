"""The reference tiers at their recommended layouts, simulated (`ttt plan --simulate`): per-rank peak beside
`ttt plan`'s formula, whether it fits 80/141/192 GiB devices, and what each simulation cost (wall time and
peak RSS of its own process). One process per layout, one after another (the machine may be shared: the
wall times it prints are then inflated). Prints the markdown table of docs/scale.md.

    python bench/simulate_scale.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (benchmark, gpus, --parallel, --layers, extra --set)
LAYOUTS = [
    ("llama31_8b", 8, "fsdp=8", 3, []),
    ("gpt_oss_20b", 8, "ep=8,fsdp=8", 3, []),
    ("llama2_70b_lora", 8, "fsdp=8", 3, []),
    ("flux1", 8, "fsdp=8", 9, []),
    ("llama31_405b", 256, "tp=8,fsdp=32", 3, []),
    ("llama31_405b", 1024, "tp=8,fsdp=128", 3, []),
    # 8,192 GPUs = 1,024 TP groups: the global batch must split over them (a multiple of 1,152 and 1,024).
    ("llama31_405b", 8192, "tp=8,fsdp=1024", 3, ["global_batch_size=9216"]),
    ("deepseekv3_671b", 64, "ep=64,fsdp=64", 6, []),
    ("deepseekv3_671b", 256, "ep=256,fsdp=256", 6, []),
    ("deepseekv3_671b", 1024, "ep=1024,fsdp=1024", 6, []),
    ("deepseekv3_671b", 8192, "ep=8192,fsdp=8192", 6, []),
]

G = 2**30


def run(bench: str, gpus: int, spec: str, layers: int, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "timetotrain", "plan", bench, "--gpus", str(gpus), "--gpu-mem", "80",
           "--parallel", spec, "--simulate", "--layers", str(layers), "--json"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    row = {"bench": bench, "gpus": gpus, "parallel": spec, "layers": layers, "wall_s": wall,
           "rss_gib": usage.ru_maxrss * 1024 / G, "sets": sets}  # fmt: skip
    if os.waitstatus_to_exitcode(status) not in (0, 1) or not out.strip():
        row["error"] = (err.strip().splitlines() or ["?"])[-1]
        return row
    doc = json.loads(out)
    sim = doc["simulation"]
    ranks = sim["ranks"]
    top = (
        ranks[str(sim["most_loaded_rank"])]
        if str(sim["most_loaded_rank"]) in ranks
        else ranks[sim["most_loaded_rank"]]
    )
    row["peak_gib"] = sim["peak_bytes"] / G
    row["phase"] = sim["peak_phase"]
    row["states_gib"] = (top["parameters"] + top["gradients"] + top["optimizer"]) / G
    est = next((r for r in doc["rows"] if r.get("simulated_gib") is not None), None)
    if est is not None:
        row["formula_gib"] = est["total_gib"] - est["margin_gib"]
        row["formula_states_gib"] = est["states_gib"]
    row["sim_s"] = sim["seconds"]
    # The simulation's forked children hold the model: their peak, as the command measured it.
    row["rss_gib"] = max(row["rss_gib"], sim["rss"] / G)
    return row


def fits(peak_gib: float) -> str:
    return "/".join("yes" if peak_gib + 0.05 * g + 1 <= 0.9 * g else "no" for g in (80, 141, 192))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    rows = []
    print(
        "| benchmark | GPUs | layout | layers simulated | per-rank peak | phase | formula | ratio | fits 80/141/192 | RSS | wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for bench, gpus, spec, layers, sets in LAYOUTS:
        if args.only and bench not in args.only:
            continue
        r = run(bench, gpus, spec, layers, sets)
        rows.append(r)
        lay = f"{layers}+{3 if bench == 'flux1' else 1}"
        if "error" in r:
            print(
                f"| {bench} | {gpus:,} | {spec} | - | does not build: {r['error']} | | | | | {r['rss_gib']:.2f} GiB | {r['wall_s']:.0f} s |",
                flush=True,
            )
            continue
        f = r.get("formula_gib")
        ratio = f"{r['peak_gib'] / f:.2f}" if f else "-"
        print(f"| {bench} | {gpus:,} | {spec}{' (' + ', '.join(sets) + ')' if sets else ''} | {lay} | {r['peak_gib']:.1f} GiB | {r['phase']} | "
              f"{f:.1f} GiB | {ratio} | {fits(r['peak_gib'])} | {r['rss_gib']:.2f} GiB | {r['wall_s']:.0f} s |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
