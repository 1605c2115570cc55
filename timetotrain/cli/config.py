"""`--config FILE`: a TOML file whose keys are a command's long options (`ttt run`, `ttt synth`).

    benchmark = "llama31_8b"        # optional; must equal the one on the command line
    tier = "tiny"
    data = "data/c4"
    logdir = "logs"
    max-steps = 200                 # or max_steps
    parallel = "fsdp=2"
    [set]                           # the --set values
    global_batch_size = 32

The file's values become the subcommand's defaults, so anything on the command line wins: a flag given there
replaces the file's value, and `--set` values given there are applied after the file's (the last value of a
key wins, as with repeated --set). Bad input is one line naming the file and the key, before anything runs.
The values the file gave are kept on the namespace (`config_doc`), so the run can log them (`ttt_config`).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import tomllib
from pathlib import Path

from timetotrain import fileio
from timetotrain.errors import UserError

FLAG = "--config"
# Keys a file may not set: the file itself, and what only makes sense typed at a terminal.
_NOT_IN_FILE = {"config", "help", "dry_run", "print_config"}


def add_flag(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        FLAG,
        metavar="FILE",
        default=None,
        help='a TOML file of this command\'s long options (tier = "tiny", data = "data/c4", '
        "max-steps = 100, a [set] table for --set values); flags on the command line win",
    )


def given_path(argv: list[str]) -> str | None:
    """The value of --config in `argv` (the last one, as argparse would keep), without parsing the rest:
    the file must be read before the parse that needs its values (a required --data the file supplies)."""
    found = None
    for i, a in enumerate(argv):
        if a == FLAG:
            if i + 1 >= len(argv):
                raise UserError(f"{FLAG} needs a FILE (a TOML file of this command's long options)")
            found = argv[i + 1]
        elif a.startswith(FLAG + "="):
            found = a.partition("=")[2]
    return found


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> action for the parser's long options."""
    return {
        a.dest: a
        for a in parser._actions
        if any(o.startswith("--") for o in a.option_strings) and a.dest not in _NOT_IN_FILE
    }


def _positional(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if not a.option_strings}


def load(path: str) -> dict:
    p = Path(path)
    try:
        raw = fileio.read_bounded(p, fileio.SMALL_FILE, FLAG)
    except FileNotFoundError:
        raise UserError(f"{FLAG} {path}: no such file") from None
    except OSError as e:
        raise UserError(f"{FLAG} {path}: cannot read it ({e.strerror or e})") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{FLAG} {path}: not UTF-8 text (byte {e.start}); write the file as TOML") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{FLAG} {path}: not valid TOML: {e}") from None
    return doc


def _value(path: str, key: str, value, action: argparse.Action):
    """The file's value for one option, checked as the command line would check it."""
    where = f"{FLAG} {path}: {key}"
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise UserError(f"{where} = {value!r}: expected true or false")
        return value
    if isinstance(value, bool | dict | list) or isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where} = {value!r}: expected {_kind(action)}")
    kind = action.type
    if kind is int:
        if not isinstance(value, int):
            raise UserError(f"{where} = {value!r}: expected an integer")
    elif kind is float:
        if not isinstance(value, int | float):
            raise UserError(f"{where} = {value!r}: expected a number")
        value = float(value)
    elif not isinstance(value, str):
        raise UserError(f"{where} = {value!r}: expected a string (in quotes)")
    if action.choices is not None and value not in action.choices:
        raise UserError(f"{where} = {value!r}: choose one of {', '.join(map(str, action.choices))}")
    return value


def _kind(action: argparse.Action) -> str:
    return {int: "an integer", float: "a number"}.get(action.type, "a string (in quotes)")


def _sets(path: str, table) -> list[str]:
    """The [set] table (or a list of "key=value" strings) as --set arguments."""
    if isinstance(table, list) and all(isinstance(x, str) for x in table):
        return list(table)
    if not isinstance(table, dict):
        raise UserError(f'{FLAG} {path}: set must be a table ([set] with key = value lines) or ["key=value"]')
    out = []
    for k, v in table.items():
        if isinstance(v, dict | list) or isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{FLAG} {path}: set.{k} = {v!r}: expected a number or a string")
        out.append(f"{k}={str(v).lower() if isinstance(v, bool) else v}")
    return out


def apply(parser: argparse.ArgumentParser, path: str, argv: list[str]) -> dict:
    """Make the file's values `parser`'s defaults (and its required options optional where the file gives
    them). Returns what the file set, by dest, for the log."""
    doc = load(path)
    options, positional = _options(parser), _positional(parser)
    defaults: dict = {}
    for key, value in doc.items():
        dest = key.replace("-", "_")
        if dest in positional:
            # A positional (the benchmark) stays on the command line; the file may only repeat it.
            if value not in argv:
                raise UserError(
                    f"{FLAG} {path}: {key} = {value!r}, but the command line names another; "
                    f"remove {key} from the file or name {value} on the command line"
                )
            continue
        if dest not in options:
            known = ", ".join(sorted(o.replace("_", "-") for o in options))
            raise UserError(
                f"{FLAG} {path}: unknown key {key!r}: the keys are this command's long options ({known})"
            )
        action = options[dest]
        if dest == "set":
            defaults[dest] = _sets(path, value)
        else:
            defaults[dest] = _value(path, key, value, action)
        action.required = False
    parser.set_defaults(**defaults)
    return defaults


def describe(path: str, values: dict) -> dict:
    """What `ttt_config` logs: the file, its sha256 and the values it set (the run's other ttt_* keys carry
    the resolved ones, so a package's script repeats the run without the file)."""
    p = Path(path)
    return {
        "file": str(p.resolve()),
        "sha256": hashlib.sha256(fileio.read_bounded(p, fileio.SMALL_FILE, FLAG)).hexdigest(),
        "values": {k: v for k, v in values.items()},
    }


def sources(parser: argparse.ArgumentParser, argv: list[str], file_values: dict | None) -> dict[str, str]:
    """dest -> where its value came from: "command line", "--config" or "default" (for --dry-run)."""
    given = set()
    for a in parser._actions:
        for o in a.option_strings:
            if any(x == o or x.startswith(o + "=") for x in argv):
                given.add(a.dest)
    file_values = file_values or {}
    return {
        dest: "command line" if dest in given else "--config" if dest in file_values else "default"
        for dest in _options(parser)
    }
