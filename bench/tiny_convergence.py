"""Time-to-target statistics of a tier over several seeds, measured from the result logs.

    python bench/tiny_convergence.py --data data/c4 --seeds 1 2 3 4 5 [--benchmark llama31_8b --tier tiny]

Prints per run: seconds run_start->run_stop, samples to converge, tokens/s; then the median time and the
coefficient of variation (population std / mean) of samples-to-converge and of time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def parse(log: Path) -> dict:
    recs = [
        json.loads(ln.split(":::MLLOG ", 1)[1]) for ln in log.read_text().splitlines() if ":::MLLOG " in ln
    ]
    by = {}
    for r in recs:
        by.setdefault(r["key"], []).append(r)
    start, stop = by["run_start"][0], by["run_stop"][0]
    evals = by.get("eval_accuracy", [])
    seq = by["max_sequence_length"][0]["value"]
    samples = stop["metadata"].get("samples_count", evals[-1]["metadata"]["samples_count"] if evals else 0)
    secs = (stop["time_ms"] - start["time_ms"]) / 1000
    return {
        "status": stop["metadata"]["status"],
        "seconds": secs,
        "samples": evals[-1]["metadata"]["samples_count"] if evals else 0,
        "tokens_per_s": samples * seq / secs if secs else 0.0,
        "last_eval": evals[-1]["value"] if evals else None,
    }


def cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.mean(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--benchmark", default="llama31_8b")
    ap.add_argument("--tier", default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--logdir", default=None, help="keep the logs here (default: a temporary folder)")
    ap.add_argument("--set", action="append", default=[], help="passed to ttt run")
    args = ap.parse_args()
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="ttt-conv-"))
    rows = []
    for seed in args.seeds:
        cmd = [sys.executable, "-m", "timetotrain", "run", args.benchmark, "--tier", args.tier]
        cmd += ["--data", args.data, "--logdir", str(logdir), "--seed", str(seed), "--quiet"]
        for s in args.set:
            cmd += ["--set", s]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        logs = sorted(
            (logdir / args.benchmark / args.tier).glob("result_*.txt"), key=lambda p: p.stat().st_mtime
        )
        row = {"seed": seed, **parse(logs[-1])}
        rows.append(row)
        print(
            f"seed {seed:>6}: {row['status']:<8} {row['seconds']:7.1f} s  {row['samples']:>7,} samples  "
            f"{row['tokens_per_s']:>9,.0f} tok/s  eval {row['last_eval']:.4f}  (exit {proc.returncode})",
            flush=True,
        )
    ok = [r for r in rows if r["status"] == "success"]
    if ok:
        t = [r["seconds"] for r in ok]
        s = [r["samples"] for r in ok]
        print(
            f"\n{len(ok)}/{len(rows)} converged; median time-to-target {statistics.median(t):.1f} s; "
            f"CV samples-to-converge {cv(s):.1%}; CV time {cv(t):.1%}; "
            f"median tokens/s {statistics.median(r['tokens_per_s'] for r in ok):,.0f}"
        )
    print(f"logs: {logdir}")
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
