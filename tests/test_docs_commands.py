"""The docs' commands work as written: every `ttt` command in README.md and docs/**/*.md names a subcommand
and flags that exist, the cheap ones (help, `--version`, `ttt list`, `ttt plan` without `--simulate`) run
and exit 0, and every relative link leads to a file, and every `#anchor` to a heading, that exists.

Commands come from fenced code blocks and from inline code spans that start with `ttt `; `ttt ...`,
`python -m timetotrain ...` and `torchrun ... -m timetotrain ...` are all read as `ttt ...`. A command is run
only if it matches CHEAP (a `data download --for ... --dry-run` too: it makes no request) and holds no placeholder (`DIR`, `<name>`, `...`); a line in a code block can opt
out of running with a trailing `# docs: no-run` comment.
"""

import argparse
import re
import shlex

import pytest
from conftest import REPO

from timetotrain.cli import build_parser, main

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
CHEAP = re.compile(
    r"^(--help|--version|\S+ --help|list( --json)?|plan (?!.*--simulate).*"
    r"|data download --for \S+ --tier reference --dry-run)$"  # offline: lists the sources, fetches nothing
)
PLACEHOLDER = re.compile(
    r"<|>|\.\.\.|\bDIR\b|\bBENCH\b|\bNAME\b|\bSPEC\b|\bFILE\b|\bLOG\b|\bOUT\b|\[|\]|\$|\bN\b|\bT\b"
)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def commands(text: str) -> list[tuple[str, bool]]:
    """(the `ttt` arguments, from a code block?) of every command in markdown `text`."""
    found = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            if "docs: no-run" in line:
                continue
            line = re.sub(r"(^|\s)#.*$", "", line)  # a comment
            for part in re.split(r"&&|;|\|\|?", line):
                found += [(c, True) for c in _ttt_args(part)]
    prose = FENCE.sub("", text)
    for span in re.findall(r"`(ttt [^`]+)`", prose):
        found += [(c, False) for c in _ttt_args(span)]
    return found


def _ttt_args(part: str) -> list[str]:
    m = re.search(r"(?:^|\s)(?:ttt|-m timetotrain)(\s.*)?$", part.strip())
    return [(m.group(1) or "").strip()] if m else []


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a.choices
    return {}


def problems(text: str, parser: argparse.ArgumentParser) -> list[str]:
    """What is wrong with the commands of `text`: an unknown subcommand or a flag the command lacks."""
    out = []
    for args, _ in commands(text):
        try:
            words = shlex.split(args)
        except ValueError:
            words = args.split()
        p, path = parser, ["ttt"]
        while words and _subparsers(p) and not words[0].startswith("-"):
            subs = _subparsers(p)
            if words[0] not in subs:
                if not PLACEHOLDER.search(words[0]) and words[0] not in ("...", "COMMAND"):
                    out.append(f"`ttt {args}`: {' '.join(path)} has no subcommand {words[0]!r}")
                break
            name = words.pop(0)
            p, path = subs[name], [*path, name]
        flags = p._option_string_actions
        for w in words:
            flag = w.strip("[]()").split("=", 1)[0]
            if re.fullmatch(r"--[a-z][\w-]*", flag) and flag not in flags:
                out.append(f"`ttt {args}`: no flag {flag}")
    return out


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def test_every_command_names_a_subcommand_and_flags_that_exist(parser):
    found = {str(d.relative_to(REPO)): problems(d.read_text(), parser) for d in DOCS}
    assert {k: v for k, v in found.items() if v} == {}
    assert sum(len(commands(d.read_text())) for d in DOCS) > 100  # the extraction found the docs' commands


def test_a_planted_flag_or_subcommand_is_caught(parser):
    doc = "```bash\nttt run llama31_8b --tier tiny --no-such-flag 3   # a comment --not-read\n```\n"
    doc += "Prose: `ttt plan llama31_8b --gpu-memory 80` and `ttt frobnicate`.\n"
    assert problems(doc, parser) == [
        "`ttt run llama31_8b --tier tiny --no-such-flag 3`: no flag --no-such-flag",
        "`ttt plan llama31_8b --gpu-memory 80`: no flag --gpu-memory",
        "`ttt frobnicate`: ttt has no subcommand 'frobnicate'",
    ]


def cheap() -> list[str]:
    found = {a for d in DOCS for a, in_block in commands(d.read_text()) if in_block}
    return sorted(a for a in found if CHEAP.match(a) and not PLACEHOLDER.search(a))


@pytest.mark.slow
def test_the_cheap_commands_run_as_written(capsys):
    ran = cheap()
    assert any(a.startswith("plan ") for a in ran) and "list" in ran
    for args in ran:
        try:
            code = main(shlex.split(args))
        except SystemExit as e:  # --help and --version exit through argparse
            code = e.code
        out = capsys.readouterr()
        assert code == 0, f"ttt {args}: exit {code}\n{out.err[-2000:]}"


def anchors(path) -> set[str]:
    """GitHub's anchors of the headings of markdown file `path`."""
    heads = re.findall(r"^#+ (.*)$", FENCE.sub("", path.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_and_anchor_exists():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []
