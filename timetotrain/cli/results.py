"""`ttt score`, `ttt package`, `ttt report`, `ttt check`: reading, judging and packaging result logs.

The mlperf and report modules are imported inside the commands (numpy, scipy, torch, matplotlib, the
official checkers: up to 1.7 s), so `ttt --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from timetotrain import strictjson
from timetotrain.errors import UserError, writing
from timetotrain.interrupt import raise_on_signals
from timetotrain.mlperf.compliance import RULESET, check_log, check_ruleset
from timetotrain.mlperf.structure import explain_stop

_RULESET_HELP = (
    f"MLPerf ruleset of the logs (default {RULESET}); use 5.1.0 for MLPerf Training v5.1 results. "
    "It picks the compliance rules and the official RCP files of reference-tier logs."
)


def _add_ruleset(s: argparse.ArgumentParser, help: str) -> None:
    """--ruleset of score, package, report and check: one default, the ruleset this package writes logs for."""
    s.add_argument("--ruleset", default=RULESET, help=help)


def _existing_dir(path: str, flag: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{flag} {p} is not a directory: pass the folder holding the result logs")
    return p


def _note_skipped(root: Path) -> None:
    """The result files every reader of a tree skips (unfinished runs, `ttt synth` logs), one line each
    kind, on stderr, so `ttt score --json` stays valid JSON on stdout."""
    from timetotrain.mlperf.results import synthetic_note, unfinished_note

    for note in (unfinished_note(root), synthetic_note(root)):
        if note:
            print(note, file=sys.stderr)


def _warn_problems(root: Path) -> None:
    """One `ttt: warning:` line per result file that cannot count as a result, naming it, before the
    official tools judge the tree (their verdict names a rule, not the file's real trouble)."""
    from timetotrain.mlperf.results import find_groups, log_problems

    for problem in log_problems(find_groups(root, with_foreign=True)):
        print(f"ttt: warning: {problem}", file=sys.stderr)


def _cmd_score(args) -> int:
    from timetotrain.mlperf.score import format_text, score_tree, to_json

    check_ruleset(args.ruleset)
    _note_skipped(_existing_dir(args.dir, "DIR"))
    _warn_problems(Path(args.dir))
    scores = score_tree(_existing_dir(args.dir, "DIR"), args.ruleset)
    print(to_json(scores) if args.json else format_text(scores), end="" if not args.json else "\n")
    return 0 if all(s.score_minutes is not None for s in scores) else 1


def _cmd_package(args) -> int:
    from timetotrain.mlperf.package import Noncompliant, build_package, check_package

    check_ruleset(args.ruleset)
    _note_skipped(_existing_dir(args.results, "--results"))
    system_json = Path(args.system_json) if args.system_json else None
    if system_json is not None and not system_json.is_file():
        raise UserError(f"--system-json {system_json} is not a file: pass an MLPerf systems/<name>.json")
    # A full disk: the package is built aside and renamed, so none appears; SIGTERM/SIGINT raise, so the
    # staging folder (a copy of every log, beside --out) is removed on the way out.
    try:
        with raise_on_signals(), writing("--out", args.out):
            res = build_package(
                args.org,
                args.system,
                _existing_dir(args.results, "--results"),
                Path(args.out),
                system_json,
                args.tier,
                args.ruleset,
                args.allow_noncompliant,
            )
    except Noncompliant as e:
        for line in e.failing:
            print(f"ttt: {line}", file=sys.stderr)
        raise
    for w in res.warnings:
        print(f"ttt: warning: {w}", file=sys.stderr)
    print(f"package written to {res.out}")
    for bench, n in res.benchmarks.items():
        print(f"  results/{args.system}/{bench}: {n} result file{'' if n == 1 else 's'}")
    print(
        f"  systems/{args.system}.json"
        + (" (from --system-json)" if system_json else " (filled from this host)")
    )
    if res.todo:
        print(f"fields to fill in {res.system_json}:")
        for k in res.todo:
            print(f"  {k}")
    for n in res.notes:
        print(f"note: {n}")
    if args.check:
        ok, output = check_package(res.out, args.ruleset)
        print("\n".join(output.splitlines()[-15:]))
        print(f"official package checker ({args.ruleset}): {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    return 0


def _cmd_report(args) -> int:
    from timetotrain.report import make_report

    check_ruleset(args.ruleset)
    _note_skipped(_existing_dir(args.dir, "DIR"))
    if args.html is not None:
        return _report_html(args)
    if args.out is None:
        raise UserError("--out is required (a folder for the PNGs and summary.md), or pass --html")
    _warn_problems(Path(args.dir))
    with writing("--out", args.out):
        rep = make_report(_existing_dir(args.dir, "DIR"), Path(args.out), args.ruleset)
    for p in rep.plots + [t for t in rep.training_plots if t is not None]:
        print(f"plot: {p}")
    print(f"summary: {rep.summary}")
    print(f"scores: {rep.scores_json}")
    return 0


def _report_html(args) -> int:
    from timetotrain.report.html import write_html

    if args.html:
        path = Path(args.html)
    else:
        path = (Path(args.out) if args.out else Path(args.dir)) / "report.html"
    if path.is_dir():
        raise UserError(f"--html {path} is a folder: pass a file name such as {path / 'report.html'}")
    with writing("--html", path):
        out = write_html(Path(args.dir), path, args.ruleset)
    print(f"html: {out} ({out.stat().st_size / 1e6:.2f} MB, self-contained)")
    return 0


def _cmd_check(args) -> int:
    from timetotrain.mlperf.results import ruleset_note

    path = Path(args.log)
    if not path.is_file():
        raise UserError(f"{path} is not a file: pass a result_<k>.txt written by `ttt run`")
    verdict = check_log(path, args.ruleset)
    stopped = explain_stop(path)  # how the run ended, in the user's words: the engine names only a rule
    note = ruleset_note(path, args.ruleset)
    if note:
        print(f"note: {note}", file=sys.stderr)  # stderr: --json keeps stdout for the document
    verdict_word = "PASS" if verdict.ok else "FAIL"
    official = "PASS" if verdict.official else "FAIL"
    ours = "PASS" if not verdict.findings else "FAIL"
    if args.json:
        doc = {
            "log": str(path),
            "verdict": verdict_word,
            "ok": verdict.ok,
            "ruleset": args.ruleset,
            "rules": verdict.config,
            "engine": "mlperf_logging compliance_checker",
            "official_verdict": official,
            "output": verdict.output,
            "ttt_verdict": ours,
            "ttt_findings": [{"line": f.line, "what": f.what} for f in verdict.findings],
            "ruleset_note": note,
            "run_ended": stopped,
        }
        print(strictjson.dumps(doc, indent=2))
        return 0 if verdict.ok else 1
    if stopped:
        print(f"{path}: {stopped}")
    if args.verbose or not verdict.official:
        print(verdict.output)
    for finding in verdict.findings:
        print(finding)
    n = len(verdict.findings)
    why = f", {n} finding{'' if n == 1 else 's'}" if n else ""
    print(
        f"{verdict_word}: {path} (official mlperf_logging engine: {official}, rules: {verdict.config}; "
        f"ttt's own checks: {ours}{why})"
    )
    return 0 if verdict.ok else 1


def add_commands(sub) -> None:
    """Register score, package, report and check on an argparse subparsers object."""
    _add_score(sub)
    _add_package(sub)
    _add_report(sub)
    _add_check(sub)


def _add_score(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser(
        "score",
        help="MLPerf score of result logs: olympic mean, CVs, RCP verdict",
        formatter_class=fmt,
        description=(
            "Score every system x benchmark found under DIR, as the official result_summarizer does.\n"
            "DIR may be a submission tree (ORG/results/SYSTEM/BENCH/result_*.txt with ORG/systems/SYSTEM.json),\n"
            "a folder of several such trees, or any folder of result files such as the --logdir of `ttt run`.\n\n"
            "Per run: minutes run_start->run_stop, status, samples to converge, official compliance.\n"
            "Per benchmark: olympic mean of compliant runs (one non-compliant run counts as the slowest;\n"
            "the median for 3-run benchmarks) x scaling.json, CV of times and of samples to converge, and\n"
            "the RCP verdict (Pass / Fail / Interp. Fail / Missing / No RCP, or 'not enough runs (N of >= 3)'\n"
            "where fewer than 3 runs have no olympic mean to compare) with the RCP mean and minimum.\n"
            "`ttt synth` logs and unfinished result_<k>.txt.partial under DIR are skipped, with a note.\n"
            "Nothing under DIR is modified. Exit 1 when a benchmark has no valid score."
        ),
        epilog="examples:\n  ttt score logs\n  ttt score training_results_v5.1/AMD --ruleset 5.1.0 --json",
    )
    s.add_argument("dir", metavar="DIR", help="folder with result_<k>.txt files (searched recursively)")
    s.add_argument("--json", action="store_true", help='print {"results": [...]} as JSON')
    _add_ruleset(s, _RULESET_HELP)
    s.set_defaults(func=_cmd_score)


def _add_package(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser(
        "package",
        help="build the submission tree the official package checker expects",
        formatter_class=fmt,
        description=(
            "Copy result logs into OUT/results/SYSTEM/BENCH/result_<i>.txt (ordered by run_start,\n"
            "renumbered from 0), write OUT/systems/SYSTEM.json (filled from this host; unknown fields are\n"
            "'TODO: fill in' and listed) and OUT/benchmarks/BENCH/implementations/timetotrain/ with a\n"
            "README.md and a run_and_time.sh that repeats the runs with their logged seeds.\n"
            "OUT must not exist. One folder of results per benchmark (use --tier to choose); `ttt synth`\n"
            "logs under --results are skipped, with a note.\n\n"
            "Every log the official compliance checker will fail (with the rules `ttt check` uses) is listed\n"
            "first, one line each: file and the first reason. The package checker accepts one such log per\n"
            "benchmark (olympic scoring; unet3d 4); with more, nothing is written and the exit is 2, unless\n"
            "--allow-noncompliant."
        ),
        epilog=(
            "examples:\n"
            "  ttt package --org MyOrg --system my_box --results logs --out submission/MyOrg --tier tiny\n"
            "  ttt package --org AMD --system MI355X_EPYC_9575F_pytorch --results AMD/results \\\n"
            "      --system-json AMD/systems/MI355X_EPYC_9575F_pytorch.json --out /tmp/AMD --check --ruleset 5.1.0"
        ),
    )
    s.add_argument("--org", required=True, help="submitting organization (`submitter` of systems/NAME.json)")
    s.add_argument("--system", required=True, metavar="NAME", help="system description id: systems/NAME.json")
    s.add_argument(
        "--results", required=True, metavar="DIR", help="folder with result logs (searched recursively)"
    )
    s.add_argument("--out", required=True, metavar="DIR", help="new folder for the package (must not exist)")
    s.add_argument(
        "--system-json", metavar="FILE", help="start systems/NAME.json from this file, not from the host"
    )
    s.add_argument("--tier", help="only logs of this tier (when --results holds several)")
    s.add_argument("--check", action="store_true", help="then run the official package checker on OUT")
    s.add_argument(
        "--allow-noncompliant",
        action="store_true",
        help="package even where more logs of a benchmark fail the official compliance checker than its "
        "olympic scoring accepts (1; unet3d 4): the package checker will then reject that folder",
    )
    _add_ruleset(s, f"ruleset of the logs' compliance check and of --check (default {RULESET})")
    s.set_defaults(func=_cmd_package)


def _add_report(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser(
        "report",
        help="plots (eval metric vs samples) and a markdown score summary",
        formatter_class=fmt,
        description=(
            "For every system x benchmark under DIR: OUT/<benchmark>-<tier>.png with the eval metric of\n"
            "each run against training samples, the target (horizontal) and the RCP mean and minimum\n"
            "(vertical) when known; OUT/summary.md with the `ttt score` table; OUT/scores.json.\n"
            "When several systems have results of one benchmark x tier, each of their plots is\n"
            "OUT/<benchmark>-<tier>-<submitter>-<system>.png.\n\n"
            "--html writes one self-contained page instead (plotly.js inlined: no network, no server):\n"
            "the score table, interactive eval curves with target and RCP lines, each log's official\n"
            "compliance verdict, and throughput/MFU of `ttt synth` summaries under DIR."
        ),
        epilog="examples:\n  ttt report logs --out report\n  ttt report logs --html report.html",
    )
    s.add_argument("dir", metavar="DIR", help="folder with result_<k>.txt files (searched recursively)")
    s.add_argument("--out", metavar="DIR", help="folder for the PNGs and summary.md (created)")
    s.add_argument(
        "--html",
        nargs="?",
        const="",
        metavar="FILE",
        help="write one self-contained HTML page (default OUT/report.html, or DIR/report.html)",
    )
    _add_ruleset(s, _RULESET_HELP)
    s.set_defaults(func=_cmd_report)


def _add_check(sub) -> None:
    s = sub.add_parser(
        "check",
        help="judge a result log: the official MLPerf compliance checker, then ttt's own checks",
        description="Run the official mlperf_logging compliance checker on one result_<k>.txt with the rule "
        "file of the tier the log claims (ttt_tier): a tier of ours is checked against its own rules under "
        "timetotrain/suite/rules/, a reference (official) log against the ruleset's closed rules. Then ttt's "
        "own checks of what the engine lets through (docs/submission.md): one run_start, one run_stop, one "
        "init_stop; one value per configuration key (seed, submission_*, hyperparameters); a known run_stop "
        "status, success iff the last eval is the first to meet the target. A run that did not reach its "
        "target is said first in plain words (cut before run_stop, stopped before its first eval, stopped "
        "short of the target). Prints each of ttt's findings as FILE:LINE: what, then PASS or FAIL with both verdicts and the rule file used (and the checker's "
        "report when it fails, or with -v); exit 0 when both pass, 1 otherwise. A log that says it was "
        "written for another ruleset, or lies under a folder naming another MLPerf round (e.g. "
        "mlperf_results_v5.1), gets a note.",
    )
    s.add_argument("log", help="a result_<k>.txt")
    _add_ruleset(s, f"MLPerf logging ruleset (default {RULESET})")
    s.add_argument("-v", "--verbose", action="store_true", help="show the checker's full output")
    s.add_argument(
        "--json",
        action="store_true",
        help='print {"log", "verdict", "ok", "ruleset", "rules", "engine", "official_verdict", "output", '
        '"ttt_verdict", "ttt_findings": [{"line", "what"}], "ruleset_note", "run_ended"} as JSON',
    )
    s.set_defaults(func=_cmd_check)
