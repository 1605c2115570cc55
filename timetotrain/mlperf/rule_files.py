"""The rule files of our tiers, assembled from layers the way mlcommons/logging layers its own.

The official checker starts at `training_<R>/common.yaml` (run structure, submission keys), whose division
key enqueues `<division>_common.yaml`, whose benchmark key enqueues `<division>_<benchmark>.yaml` (the
benchmark's own checks). A tier of ours is judged by one self-contained file instead, because the engine's
`enqueue_config` resolves paths inside its own package: a file of ours cannot chain to another of ours.
So `ttt rules build` inlines the layers, in order:

1. `training_<R>/common.yaml` and `training_<R>/<division>_common.yaml` of the installed mlperf_logging;
2. `src/common_<tier>.yaml` here: what every tier of that name checks beyond the official rules;
3. `<rules_dir>/src/<benchmark>_<tier>.yaml`: the tier's own checks (values, target), like `closed_<bench>.yaml`.

The official `<division>_<benchmark>.yaml` is left out: it states the reference tier's values (sequence
length, eval size, target), which a scaled-down tier does not have. Where layers state the same key, the
assembled record keeps all their checks and the strictest REQ, so a log passes the file only if it passes
every layer: `ttt check` cannot pass a log that the official common rules fail. The output depends only on
the layers' text, so the shipped files are reproducible byte for byte.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

import mlperf_logging.compliance_checker as official_checker
import yaml

from timetotrain import fileio
from timetotrain.errors import UserError
from timetotrain.spec import benchmark as suite_base
from timetotrain.spec.benchmark import Benchmark
from timetotrain.spec.official import official_benchmark

# Our layers live beside the shipped rule files, in the suite package (the common ones; each benchmark's
# own sit in its `rules_dir`/src).
SRC = suite_base.SUITE_DIR / "rules" / "src"
# Occurrence requirements from the weakest to the strictest (the engine's REQ values that we use).
_REQ_ORDER = ("OPTIONAL", "AT_LEAST_ONE_OR", "AT_LEAST_ONE", "EXACTLY_ONE")
_CODE_FIELDS = ("PRE", "POST")
_EXPR_FIELDS = ("FIRST_CHECK", "ATLEAST_ONE_CHECK")
_FIELDS = ("NAME", "REQ", "PRE", "CHECK", "POST", *_EXPR_FIELDS)


def official_dir() -> Path:
    return Path(official_checker.__file__).parent


@dataclass
class Record:
    """One item of a rule file: a BEGIN block (`name` None) or a KEY record, with the comment lines above it
    and the layers it came from."""

    name: str | None
    fields: dict[str, object]
    comments: list[str] = field(default_factory=list)
    origin: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Layer:
    label: str  # how the assembled file names it (stable across machines: no absolute path)
    path: Path
    official: bool = False  # a file of the installed mlperf_logging


def layers(bench: Benchmark, tier: str, ruleset: str | None = None) -> list[Layer]:
    """The layers of `bench`'s `tier`, in order. `<division>_common.yaml` lists the round's benchmarks (and
    enqueues their files): a benchmark the round does not list (a test-only or in-development one) is judged
    without it, as no official file names it."""
    ruleset = ruleset or bench.ruleset
    division = bench.tier(tier).division
    official = official_dir() / f"training_{ruleset}"
    out = [Layer(f"training_{ruleset}/common.yaml", official / "common.yaml", True)]
    if official_benchmark(bench.name, ruleset):
        name = f"{division}_common.yaml"
        out.append(Layer(f"training_{ruleset}/{name}", official / name, True))
    out += [
        Layer(f"timetotrain/suite/rules/src/common_{tier}.yaml", SRC / f"common_{tier}.yaml"),
        Layer(f"src/{bench.name}_{tier}.yaml", source_path(bench, tier)),
    ]
    for layer in out:
        if not layer.path.is_file():
            raise UserError(
                f"no rule layer {layer.path} for {bench.name} {tier} (ruleset {ruleset}): write it "
                "(docs/adding-a-benchmark.md) or install an mlperf-logging that has the ruleset"
            )
    return out


def source_path(bench: Benchmark, tier: str) -> Path:
    return bench.rules_dir / "src" / f"{bench.name}_{tier}.yaml"


def shipped_path(bench: Benchmark, tier: str) -> Path:
    return bench.rules_dir / f"{bench.name}_{tier}.yaml"


def _items(text: str, label: str) -> tuple[list[str], list[tuple[list[str], str]]]:
    """The file's leading comment block (up to its first blank line), and each top-level list item with
    the column-0 comment lines above it. PyYAML drops comments, so items are cut from the text and each is
    parsed on its own; comments indented inside an item stay in its text."""
    lead: list[str] = []
    items: list[tuple[list[str], str]] = []
    pending: list[str] = []
    above: list[str] = []
    body: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("- "):
            if body is not None:
                items.append((above, "\n".join(body)))
            above, pending, body = pending, [], [line]
        elif line.startswith("#"):
            pending.append(line)
        elif not line.strip():
            if body is None and not items and not lead:
                lead, pending = pending, []
        elif body is not None:
            body.append(line)
        else:
            raise UserError(f"{label}: line {line!r} is outside any rule item")
    if body is not None:
        items.append((above, "\n".join(body)))
    return lead, items


def parse_layer(layer: Layer) -> tuple[list[str], list[Record]]:
    text = layer.path.read_text()
    lead, items = _items(text, layer.label)
    if layer.official:  # the official files' notes stay there; ours explain our checks
        items = [([], body) for _, body in items]
    records: list[Record] = []
    seen: set[str] = set()
    for comments, body in items:
        try:
            records.append(_record(yaml.load(body, Loader=yaml.BaseLoader), comments, layer, seen))
        except (yaml.YAMLError, SyntaxError) as e:
            first = body.splitlines()[0] if body else ""
            why = " ".join(f"{type(e).__name__}: {e}".split())
            raise UserError(f"{layer.label}: the item at {first!r} is not valid ({why}): fix it") from e
    return lead, records


def _record(parsed, comments: list[str], layer: Layer, seen: set[str]) -> Record:
    """One parsed item as a Record; `seen` holds the key names the layer stated before."""
    if not (isinstance(parsed, list) and len(parsed) == 1 and isinstance(parsed[0], dict)):
        raise UserError(f"{layer.label}: an item is not one BEGIN or KEY record: {parsed!r}")
    ((kind, content),) = parsed[0].items()
    if kind == "BEGIN":
        return Record(None, {"CODE": _code(content["CODE"])}, comments, [layer.label])
    if kind != "KEY" or "NAME" not in content:
        raise UserError(f"{layer.label}: {kind!r} is not a BEGIN or KEY record with a NAME")
    unknown = set(content) - set(_FIELDS)
    if unknown:
        raise UserError(f"{layer.label}: KEY {content['NAME']} has unknown fields {sorted(unknown)}")
    name = content["NAME"]
    if name in seen:
        # The engine keeps the last record of a name: an earlier one would be dead text.
        raise UserError(f"{layer.label}: KEY {name} is stated twice; state each key once")
    seen.add(name)
    fields: dict[str, object] = {}
    if "REQ" in content:
        fields["REQ"] = content["REQ"]
    for f in _CODE_FIELDS:
        if f in content and _code(content[f]):
            fields[f] = _code(content[f])
    if "CHECK" in content:
        checks = content["CHECK"]
        fields["CHECK"] = [c.strip() for c in (checks if isinstance(checks, list) else [checks])]
    for f in _EXPR_FIELDS:
        if f in content:
            fields[f] = content[f].strip()
    for expr in [*fields.get("CHECK", []), *(fields[f] for f in _EXPR_FIELDS if f in fields)]:
        compile(expr, layer.label, "eval")  # the engine evaluates them: a typo is found here, not in a run
    return Record(name, fields, comments, [layer.label])


def _code(code: str) -> str:
    """`code` without its `enqueue_config(...)` statements: the layers they would load are inlined (or,
    for the division's benchmark file, do not apply). Each kept statement keeps its own text."""
    code = code.strip()
    tree = ast.parse(code)
    kept = [ast.get_source_segment(code, node) for node in tree.body if not _is_enqueue(node)]
    return "\n".join(kept)


def _is_enqueue(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "enqueue_config"
    )


def _req_rank(req: str, where: str) -> int:
    base = req.split("(", 1)[0]
    if base not in _REQ_ORDER:
        raise UserError(f"{where}: REQ {req!r} is not one of {', '.join(_REQ_ORDER)}")
    return _REQ_ORDER.index(base)


def merge(parsed: list[list[Record]]) -> list[Record]:
    """One record per key, in the order keys first appear; a key several layers state gets every layer's
    checks and code (in layer order) and the strictest REQ."""
    out: dict[str | None, Record] = {}
    for records in parsed:
        for rec in records:
            have = out.get(rec.name)
            if have is None:
                out[rec.name] = Record(rec.name, dict(rec.fields), list(rec.comments), list(rec.origin))
                continue
            have.origin += rec.origin
            have.comments += [c for c in rec.comments if c not in have.comments]
            f = have.fields
            for key, value in rec.fields.items():
                if key not in f:
                    f[key] = value
                elif key == "REQ":
                    where = f"KEY {rec.name} ({', '.join(have.origin)})"
                    if _req_rank(value, where) > _req_rank(f[key], where):
                        f[key] = value
                elif key == "CHECK":
                    f[key] = f[key] + [c for c in value if c not in f[key]]
                elif key in (*_CODE_FIELDS, "CODE"):
                    f[key] = f"{f[key]}\n{value}" if value and value != f[key] else f[key]
                else:  # a single expression: both must hold
                    f[key] = f"({f[key]}) and ({value})" if value != f[key] else f[key]
    return [r for r in out.values() if r.fields.get("CODE", True)]


def _scalar(text: str, indent: int) -> str:
    """A YAML scalar the official loader reads back as `text`: one double-quoted line (JSON escapes are
    YAML's), or a literal block for code of several lines."""
    if "\n" not in text:
        return json.dumps(text)
    pad = " " * indent
    return "|-\n" + "\n".join(pad + ln if ln else "" for ln in text.split("\n"))


def render(records: list[Record], header: list[str]) -> str:
    out = [*header, ""]
    for rec in records:
        out += rec.comments
        out.append(f"# layers: {', '.join(rec.origin)}")
        if rec.name is None:
            out += ["- BEGIN:", f"    CODE: {_scalar(rec.fields['CODE'], 8)}", ""]
            continue
        out += ["- KEY:", f"    NAME:  {rec.name}"]
        for key in _FIELDS[1:]:
            if key not in rec.fields:
                continue
            value = rec.fields[key]
            if key == "CHECK":
                out.append("    CHECK:")
                out += [f"        - {_scalar(c, 10)}" for c in value]
            elif key == "REQ":
                out.append(f"    REQ:   {value}")
            else:
                out.append(f"    {key + ':':<6} {_scalar(value, 8)}")
        out.append("")
    return "\n".join(out)


def assemble(bench: Benchmark, tier: str, ruleset: str | None = None) -> str:
    """The text of the self-contained rule file of `bench`'s `tier` under `ruleset` (default: the
    benchmark's own)."""
    ruleset = ruleset or bench.ruleset
    stack = layers(bench, tier, ruleset)
    parsed = [parse_layer(layer) for layer in stack]
    records = merge([recs for _, recs in parsed])
    own_lead = parsed[-1][0]
    header = [
        f"# The rule file of timetotrain's {bench.name} `{tier}` tier, for the official MLPerf compliance engine:",
        f"#   python -m mlperf_logging.compliance_checker --usage training --ruleset {ruleset} --config <this file> LOG",
        "#",
        "# Assembled by `ttt rules build` (timetotrain/mlperf/rule_files.py): do not edit it, edit its layers and",
        "# build again. Its layers, in order (a key several of them state holds all their checks and the",
        "# strictest REQ; enqueue_config calls are dropped: the common files they load are inlined here, and",
        "# <division>_<benchmark>.yaml, which states the reference tier's values, does not apply to this tier):",
        *(f"#   {layer.label}" for layer in stack),
        "#",
        *own_lead,
    ]
    text = render(records, header)
    _round_trip(text, records, bench, tier)
    return text


def _round_trip(text: str, records: list[Record], bench: Benchmark, tier: str) -> None:
    """The engine must read the assembled text back as exactly the merged records."""
    loaded = yaml.load(text, Loader=yaml.BaseLoader)
    want = [
        {"BEGIN": dict(r.fields)} if r.name is None else {"KEY": {"NAME": r.name, **r.fields}}
        for r in records
    ]
    got = [
        {kind: {k: v.strip() if isinstance(v, str) else v for k, v in body.items()}}
        for item in loaded
        for kind, body in item.items()
    ]
    if got != want:
        raise AssertionError(
            f"the assembled rule file of {bench.name} {tier} does not read back as assembled"
        )


def tiers_with_rules(bench: Benchmark) -> list[str]:
    """The tiers judged by a rule file of ours: every tier but the reference (the official rules)."""
    return [t for t in bench.tiers if t != "reference"]


@dataclass(frozen=True)
class Built:
    path: Path
    changed: bool


def build(benches: list[Benchmark], check_only: bool = False) -> list[Built]:
    """Assemble every rule file of `benches`; write those that differ unless `check_only`. Nothing is
    written before every file has been assembled, and never into an installed (non-editable) package."""
    out = []
    for bench in benches:
        for tier in tiers_with_rules(bench):
            text = assemble(bench, tier)
            path = shipped_path(bench, tier)
            out.append((Built(path, not path.is_file() or path.read_text() != text), text))
    for built, text in out:
        if built.changed and not check_only:
            _check_source_tree(built.path)
            fileio.write_text(built.path, text)
    return [b for b, _ in out]


def _check_source_tree(path: Path) -> None:
    """The shipped files belong to a source checkout: rewriting an installed copy would change what one
    environment checks against, silently, until the next install replaces it."""
    if {"site-packages", "dist-packages"} & set(path.parts):
        raise UserError(
            f"{path} is inside an installed package: run `ttt rules build` in a source checkout (pip install "
            "-e .), or pass --check to compare without writing"
        )
