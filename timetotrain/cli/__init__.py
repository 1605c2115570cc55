"""`ttt`: the command line. Each subcommand parses its flags and calls one function.

The subcommands live in one module per group: `run` (list, run, synth, plan, rcp build), `data`
(data prepare), `results` (score, package, report, check), `rules` (rules build), `suite` and `doctor`.
Each registers its parsers on the subparsers built here; all of them import their heavy dependencies
inside the commands.
"""

from __future__ import annotations

import argparse
import errno
import sys
import warnings

from timetotrain import fileio
from timetotrain.cli import completion, config, data, doctor, results, rules, run, suite
from timetotrain.errors import Interrupted, UserError

EXIT_USAGE = 2

EPILOG = """\
examples:
  ttt list
  ttt data download fixtures --out sources   # the tiny tiers' raw data (9 MB; --mirror URL|DIR offline)
  ttt data prepare c4 --src sources/c4/en --split train --out data/c4
  ttt data prepare c4 --src sources/c4/en --split validation --out data/c4
  ttt data prepare --for llama2_70b_lora --tier tiny --src sources --out data/govreport-tiny
  ttt run llama31_8b --tier tiny --data data/c4 --logdir logs
  ttt check logs/llama31_8b/tiny/result_0.txt
  ttt suite --tier tiny --runs 1 --data sources --out suite-tiny   # every benchmark, one scorecard
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ttt",
        description="timetotrain: MLPerf Training benchmarks as one PyTorch package.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"ttt {doctor.version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Registration order is the order `ttt --help` lists the commands in.
    run.add_list(sub)
    data.add_commands(sub)
    run.add_commands(sub)
    results.add_commands(sub)
    suite.add_commands(sub)
    rules.add_commands(sub)
    doctor.add_commands(sub)
    completion.add_commands(sub, p)
    return p


def _apply_config(parser: argparse.ArgumentParser, argv: list[str]) -> dict | None:
    """`--config FILE` on a command that takes it (cli/config.py): the file's values become that
    subcommand's defaults before the parse. Returns what `ttt_config` logs, or None."""
    path = config.given_path(argv)
    sub = _subparser(parser, argv)
    if path is None or sub is None or config.FLAG not in sub._option_string_actions:
        return None  # argparse itself refuses --config where a command has none
    return config.describe(path, config.apply(sub, path, argv))


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    command = next((a for a in argv if not a.startswith("-")), None)
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subs.choices.get(command)


def _one_line_warning(message, category, filename, lineno, line=None):
    return f"ttt: warning: {message}\n"


_STORAGE_FULL = {errno.ENOSPC, errno.EDQUOT}


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    sub = _subparser(parser, argv)
    if sub is not None and {"--dry-run", "--print-config"} & set(argv):
        # A dry run reads no data and writes no log: it needs neither folder.
        for a in sub._actions:
            if a.dest in ("data", "logdir"):
                a.required = False
    try:
        conf = _apply_config(parser, argv)
    except UserError as e:  # a bad --config file: one line, before the parse that may need its values
        print(f"ttt: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    args.config_doc = conf
    if sub is not None:  # where each option's value came from, for --dry-run
        args.sources = config.sources(sub, argv, conf["values"] if conf else None)
    fileio.COMPLETED.clear()  # what this command completes (main may run many times in one process)
    fileio.DISCARDED.clear()
    try:
        return args.func(args)
    except UserError as e:
        print(f"ttt: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as e:
        # 128 + signum, as a shell reports a process the signal ended; the command has cleaned up.
        print(f"ttt: interrupted by {e}: {_outcome(e)}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("ttt: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in _STORAGE_FULL:
            raise  # anything else is a bug to see whole
        # The backstop for a writer that does not name its flag itself (errors.writing): every output goes
        # through fileio's staged writes, so what is final is whole and the rest was removed.
        where = f"{e.filename}: " if e.filename else ""
        print(
            f"ttt: error: {where}{e.strerror or e}: free space (or pass a folder with room) and run again; "
            "files completed before it are whole, the unfinished one was removed",
            file=sys.stderr,
        )
        return EXIT_USAGE


def _outcome(e: Interrupted) -> str:
    """What the signal left. "stopped" only where the previous output is intact: a signal that took effect
    after a staged set was renamed into place (fileio.Staged defers it past the last rename) left the new
    output complete, and the line says so."""
    if e.outcome:
        return e.outcome
    if not fileio.COMPLETED:
        return "stopped, temporary files removed"
    first, n = fileio.COMPLETED[0], len(fileio.COMPLETED)
    done = f"{first}" + (f" and {n - 1} more file(s)" if n > 1 else "")
    if fileio.DISCARDED:  # a set went in place, a later one was dropped: neither old nor new as a whole
        return f"the output is partly new: {done} were complete and replaced the old; the unfinished rest was removed"
    return f"the new output is complete ({done} written in full before the signal took effect)"


if __name__ == "__main__":
    raise SystemExit(main())
