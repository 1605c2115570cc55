"""The grid of docs/scale.md "Layouts for 8, 64, 256 and 1,024 GPUs": `ttt plan`'s suggestion (the formula,
no simulation) for every benchmark's reference tier on each GPU count and device size, as one markdown
table. Each cell is the suggested layout with its checkpointing, micro-batch and total per GPU, the GBS
where the plan moved to another legal GBS of the RCP table, or "nothing fits" (with the smallest larger
GPU count that fits, if any), or why the batch splits over no layout. All plans run in this one process
(`ttt plan ... --json` through the CLI's own entry point): a few seconds in all.

    python bench/scale_grid.py [--only NAME ...] [--gpus N ...] [--mem G ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re

from timetotrain.cli import main as ttt

BENCHES = ["llama31_8b", "gpt_oss_20b", "llama2_70b_lora", "flux1", "llama31_405b", "deepseekv3_671b",
           "dlrm_dcnv2", "qwen35_397b_grpo"]  # fmt: skip
GPUS = (8, 64, 256, 1024)
MEMS = (80, 141, 192)
G = 2**30


def plan_json(bench: str, gpus: int, mem: int, extra: list[str] = ()) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `ttt plan BENCH --gpus N --gpu-mem G --json`, in this process."""
    out, err = io.StringIO(), io.StringIO()
    argv = [
        "plan",
        bench,
        "--tier",
        "reference",
        "--gpus",
        str(gpus),
        "--gpu-mem",
        str(mem),
        "--json",
        *extra,
    ]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = ttt(argv)
    return rc, out.getvalue(), err.getvalue()


def last_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if "warning" not in ln.lower()]
    return (lines or ["?"])[-1].removeprefix("ttt: error: ")


def cell(rc: int, out: str, err: str) -> str:
    """A plan's suggestion in a few words (the grid's cell)."""
    if rc not in (0, 1) or not out.strip():  # (1: nothing fits, the plan printed)
        line = last_line(err)
        split = re.search(r"global_batch_size (\d+) (is not divisible by|does not split over)", line)
        return f"GBS {int(split.group(1)):,} does not split" if split else "- (" + line + ")"
    doc = json.loads(out)
    if "worst_rank" in doc:  # DLRM: the embedding plan (train/embedding_memory.py), one layout
        worst = next(r for r in doc["ranks"] if r["rank"] == doc["worst_rank"])
        return f"{doc['parallel']}: {worst['total'] / G:.0f} GiB" + ("" if doc["fits"] else " (does not fit)")
    s = doc.get("suggestion")
    if s is None:
        ff = doc.get("fits_from")
        return "nothing fits" + (f" (from {ff['gpus']:,} GPUs)" if ff else "")
    gbs = f" (GBS {doc['global_batch_size']:,})" if "global_batch_size_chosen" in doc else ""
    return f"{s['parallel']}{', AC' if s['ac'] else ''}, mb {s['micro_batch']}: {s['total_gib']:.0f} GiB{gbs}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None, help="these benchmarks only")
    ap.add_argument("--gpus", type=int, nargs="*", default=list(GPUS))
    ap.add_argument("--mem", type=int, nargs="*", default=list(MEMS), help="device sizes in GiB")
    args = ap.parse_args()
    print("| benchmark | GPUs | " + " | ".join(f"{m} GiB" for m in args.mem) + " |")
    print("|---|---|" + "---|" * len(args.mem))
    for bench in BENCHES:
        if args.only and bench not in args.only:
            continue
        for gpus in args.gpus:
            cells = [cell(*plan_json(bench, gpus, m)) for m in args.mem]
            print(f"| {bench} | {gpus:,} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
