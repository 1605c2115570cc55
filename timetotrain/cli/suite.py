"""`ttt suite`: the whole suite at one tier, scored into one results folder. This module parses the flags;
the driver is cli/suite_driver.py, imported when the command runs (it loads torch and the MLPerf logging
package, which no other command should wait for at start-up)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from timetotrain import fileio, strictjson
from timetotrain.errors import UserError
from timetotrain.spec import registry


def _data_flags(values: list[str]) -> tuple[Path | None, dict[str, Path]]:
    source, prepared = None, {}
    for v in values:
        name, eq, folder = v.partition("=")
        if eq and registry.known(name):
            if not Path(folder).is_dir():
                raise UserError(
                    f"--data {v}: {folder} is not a folder: pass a folder `ttt data prepare` wrote"
                )
            prepared[name] = Path(folder)
            continue
        if source is not None:
            raise UserError(f"--data {v}: one source folder only (and BENCH=DIR for prepared ones)")
        if not Path(v).is_dir():
            raise UserError(f"--data {v} is not a folder: pass the folder of raw sources, or BENCH=DIR")
        source = Path(v)
    return source, prepared


def _cmd_suite(args) -> int:
    from timetotrain.cli.suite_driver import Suite, SuiteOptions, format_rows

    if args.runs is not None and args.runs < 1:
        raise UserError(f"--runs {args.runs} must be at least 1")
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    source, prepared = _data_flags(args.data or [])
    extra = ["--precision", args.precision] if args.precision else []
    opts = SuiteOptions(
        tier=args.tier, out=Path(args.out), only=only, runs=args.runs, source=source, prepared=prepared,
        seed=args.seed, device=args.device, cache=Path(args.cache) if args.cache else None, run_args=extra,
    )  # fmt: skip
    rows = Suite(opts).run()
    table = format_rows(rows)
    print(table)
    doc = {"tier": args.tier, "benchmarks": [dataclasses.asdict(r) for r in rows]}
    fileio.write_text(Path(args.out) / "scorecard.json", strictjson.dumps(doc, indent=2) + "\n")
    print(f"results: {args.out} (scorecard.json; `ttt report {args.out} --html` draws them)", file=sys.stderr)
    ok = all(r.runs and r.converged == r.runs and r.compliant == r.runs for r in rows)
    return 0 if ok else 1


def add_commands(sub) -> None:
    s = sub.add_parser(
        "suite",
        help="every benchmark of a tier, N runs each, scored into one results folder",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run every benchmark that has --tier (or those of --only), --runs each with distinct seeds,\n"
            "into OUT/<benchmark>/<tier>/result_<k>.txt. Data is prepared from --data SRC (raw sources laid\n"
            "out as `ttt data download fixtures` writes them: c4/en, govreport/, tokenizers/, ...) into a\n"
            "cache, or taken from the cache, or from --data BENCH=DIR; a tier that starts from a base of\n"
            "ours runs from the copy the package ships (else from one `ttt base` makes, cached). Prints\n"
            "each benchmark's ETA (from this suite's runs, else this user's earlier runs of the same code,\n"
            "tier and flags on this host, kept in ~/.cache/timetotrain/run_seconds.json), then one table:\n"
            "runs converged, `ttt check` verdicts, score and RCP verdict (also OUT/scorecard.json).\n\n"
            "Resumable: the seeds are kept in OUT/suite.json and a run whose result file exists is not run\n"
            "again, so a suite stopped with Ctrl-C and started again finishes what is left. A run a signal\n"
            "stopped is no result: its log is kept as result_<k>.txt.signalled (never scored) and its seed\n"
            "runs again. One suite per OUT (OUT/suite.lock); its runs die with it, kill -9 included (Linux)."
        ),
        epilog=(
            "examples:\n"
            "  ttt data download fixtures --out sources\n"
            "  ttt suite --tier tiny --runs 1 --data sources --out suite-tiny\n"
            "  ttt suite --tier tiny --only llama31_8b,gpt_oss_20b --runs 3 --out suite-tiny"
        ),
    )
    s.add_argument("--tier", required=True, help="the tier to run (tiny on 2 cores; reference on a cluster)")
    s.add_argument("--only", metavar="A,B", help="only these benchmarks (comma-separated)")
    s.add_argument(
        "--runs", type=int, default=None, help="runs per benchmark (default: the tier's own count)"
    )
    s.add_argument(
        "--out", required=True, metavar="DIR", help="the results folder (created; reused to resume)"
    )
    s.add_argument(
        "--data",
        action="append",
        metavar="SRC|BENCH=DIR",
        help="a folder of raw sources to prepare from, and/or BENCH=DIR prepared folders (repeatable)",
    )
    s.add_argument("--seed", type=int, default=None, help="first seed of each benchmark (default: random)")
    s.add_argument("--device", default=None, help="torch device for every run (default: cuda if available)")
    s.add_argument(
        "--precision", choices=["fp32", "bf16", "fp8"], default=None, help="passed to every `ttt run`"
    )
    s.add_argument(
        "--cache",
        default=None,
        help="where prepared data is kept (default: $TTT_CACHE/data or ~/.cache/timetotrain/data)",
    )
    s.set_defaults(func=_cmd_suite)
