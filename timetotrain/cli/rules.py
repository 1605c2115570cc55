"""`ttt rules build`: assemble the rule files of our tiers from their layers (timetotrain/mlperf/rule_files.py).

The assembler is imported when the command runs: it imports torch (through spec.benchmark, 1.5 s), which
`ttt --help` should not wait for."""

from __future__ import annotations

import argparse

from timetotrain.spec import registry


def _cmd_build(args) -> int:
    from timetotrain.mlperf.rule_files import build

    benches = [registry.get(n) for n in (args.benchmark or registry.names(listed_only=False))]
    built = build(benches, check_only=args.check)
    for b in built:
        state = ("differs from its layers" if args.check else "written") if b.changed else "up to date"
        print(f"{b.path}: {state}")
    return 1 if args.check and any(b.changed for b in built) else 0


def add_commands(sub) -> None:
    p = sub.add_parser(
        "rules",
        help="the rule files of our tiers: assemble them from their layers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Each tier of ours but the reference is judged by one self-contained rule file for the official\n"
            "compliance engine, <rules_dir>/<bench>_<tier>.yaml. `build` assembles it from its layers: the\n"
            "ruleset's official common.yaml and <division>_common.yaml, timetotrain's src/common_<tier>.yaml and\n"
            "the tier's own src/<bench>_<tier>.yaml; a key several layers state keeps all their checks."
        ),
    )
    rules = p.add_subparsers(dest="rules_command", required=True, metavar="COMMAND")
    b = rules.add_parser(
        "build",
        help="write every assembled rule file (or --check that they are up to date)",
        description=(
            "Assemble each tier rule file from its layers and write it where `ttt check` reads it (into a\n"
            "source checkout, never an installed package). After editing rules/src/, run it and commit the\n"
            "result; --check writes nothing and exits 1 if a shipped file differs from its layers."
        ),
        epilog="examples:\n  ttt rules build\n  ttt rules build --check llama31_8b",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("benchmark", nargs="*", help="only these benchmarks (default: every one the suite knows)")
    b.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    b.set_defaults(func=_cmd_build)
