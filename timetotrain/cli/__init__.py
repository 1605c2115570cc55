"""`ttt`: the command line. Each subcommand parses its flags and calls one function.

The subcommands live in one module per group: `run` (list, run, synth, plan, rcp build), `data`
(data prepare), `results` (score, package, report, check) and `rules` (rules build). Each registers its
parsers on the subparsers built here; all of them import their heavy dependencies inside the commands.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from timetotrain.cli import data, results, rules, run, suite
from timetotrain.errors import Interrupted, UserError

EXIT_USAGE = 2

EPILOG = """\
examples:
  ttt list
  ttt data prepare c4 --src ../shared/data/c4/en --split train --out data/c4
  ttt data prepare c4 --src ../shared/data/c4/en --split validation --out data/c4
  ttt data prepare govreport --src ../shared/data/govreport/gov_report.validation.scrolls_format.jsonl --select tiny --split train --tokenizer-model ../shared/data/tokenizers/llama2/tokenizer.model --out data/govreport
  ttt run llama31_8b --tier tiny --data data/c4 --logdir logs
  ttt base llama2_70b_lora --tier tiny --data data/c4-llama2   # a fine-tuning tier's base, cached
  ttt check logs/llama31_8b/tiny/result_0.txt
  ttt suite --tier tiny --runs 1 --data ../shared/data --out suite-tiny   # every benchmark, one scorecard
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ttt",
        description="timetotrain: MLPerf Training benchmarks as one PyTorch package.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Registration order is the order `ttt --help` lists the commands in.
    run.add_list(sub)
    data.add_commands(sub)
    run.add_commands(sub)
    results.add_commands(sub)
    suite.add_commands(sub)
    rules.add_commands(sub)
    return p


def _one_line_warning(message, category, filename, lineno, line=None):
    return f"ttt: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"ttt: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as e:
        # 128 + signum, as a shell reports a process the signal ended; the command has cleaned up.
        print(f"ttt: interrupted by {e}: stopped, temporary files removed", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("ttt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
