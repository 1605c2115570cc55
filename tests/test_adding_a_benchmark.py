"""docs/adding-a-benchmark.md stays true: every path it names exists (a `<name>` placeholder matches at least
one file), and every hook it writes as `name(params)` exists, on the classes (or the module) its section is
about, with exactly those parameters (a dataclass or named tuple: exactly its fields, in order)."""

import dataclasses
import inspect
import re
from pathlib import Path

from timetotrain.mlperf import rule_files
from timetotrain.models import family
from timetotrain.spec import benchmark as spec_benchmark
from timetotrain.spec import task as spec_task

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding-a-benchmark.md"

# Section heading (its start) -> the objects whose hooks and fields the section may name.
SECTIONS = {
    "### The declaration": [spec_benchmark.Benchmark, spec_benchmark.Tier, spec_benchmark.BaseRecipe, spec_benchmark.Optimizer,
                            spec_benchmark.RcpHparams, spec_benchmark.EndLRRule, spec_benchmark],
    "### The rule files": [rule_files],
    "### The RCPs": [],
    "### The task": [spec_task.Task, spec_task.RunData, spec_task.Metric, spec_task],
    "### The data recipe": [spec_task.Task, spec_task.DataRecipe],
    "### The model family": [family.ModelFamily],
}  # fmt: skip
PATH = re.compile(r"\b((?:timetotrain|tests|docs|bench)/[\w./<>*-]*[\w>]/?)")
HOOK = re.compile(r"`(\w+)\(([^`()]*)\)`")


def sections(text: str) -> dict[str, str]:
    """Heading -> its prose, code fences left out (their calls are examples, not hooks)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out, head = {}, None
    for line in prose.splitlines():
        if line.startswith("#"):
            head = next((h for h in SECTIONS if line.startswith(h)), None)
            out.setdefault(head, "")
        elif head is not None:
            out[head] += line + "\n"
    return out


def named_paths(text: str) -> set[str]:
    return set(PATH.findall(text))


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    return sorted(p for p in named_paths(text) if not any(root.glob(re.sub(r"<[^>]*>", "*", p).rstrip("/"))))


def parameters(obj) -> list[str] | None:
    """The names a hook takes: a dataclass's or named tuple's fields, a function's parameters (less self),
    None for an attribute that is no function (a ModelFamily field: the callable is the family's)."""
    if dataclasses.is_dataclass(obj) and isinstance(obj, type):
        return [f.name for f in dataclasses.fields(obj)]
    if isinstance(obj, type) and hasattr(obj, "_fields"):
        return list(obj._fields)
    if callable(obj):
        return [n for n in inspect.signature(obj).parameters if n != "self"]
    return None


def lookup(name: str, owners: list) -> object:
    for owner in owners:
        if getattr(owner, "__name__", None) == name:
            return owner
        if hasattr(owner, name):
            return getattr(owner, name)
        if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
            return dataclasses.MISSING  # a field: it exists; what it holds has no signature here
    raise LookupError(name)


def wrong_hooks(text: str) -> list[str]:
    problems = []
    for head, prose in sections(text).items():
        if head is None:
            continue
        for name, params in HOOK.findall(prose):
            written = [p.split("=")[0].strip() for p in " ".join(params.split()).split(",") if p.strip()]
            try:
                obj = lookup(name, SECTIONS[head])
            except LookupError:
                problems.append(f"{head}: `{name}` is on none of {[o.__name__ for o in SECTIONS[head]]}")
                continue
            real = None if obj is dataclasses.MISSING else parameters(obj)
            if real is not None and written != real:
                problems.append(f"{head}: `{name}({', '.join(written)})` takes ({', '.join(real)})")
    return problems


def test_every_path_the_doc_names_exists():
    text = DOC.read_text()
    assert len(named_paths(text)) > 20  # the pattern finds the doc's paths at all
    assert missing_paths(text) == []


def test_every_hook_the_doc_names_exists_with_its_parameters():
    text = DOC.read_text()
    assert set(sections(text)) - {None} == set(SECTIONS), "a section of SECTIONS is gone from the doc"
    assert sum(len(HOOK.findall(p)) for p in sections(text).values()) > 20
    assert wrong_hooks(text) == []


def test_the_checks_fail_on_a_stale_doc():
    # A renamed hook, a dropped parameter, a field the record lacks, and a path that moved.
    stale = (
        "### The task (x)\n`prepare_data(tier, source, out)` and `resolve(tier, data_dir)`.\n"
        "### The data recipe (x)\n`DataRecipe(name, steps)`.\n"
        "### The model family (x)\n`ModelFamily(name, build)` and `parallelize(model)`.\n"
        "See `timetotrain/runner/data.py` and timetotrain/suite/rcps/<name>_<tier>.json.\n"
    )
    assert wrong_hooks(stale) == [
        "### The task: `prepare_data` is on none of ['Task', 'RunData', 'Metric', 'timetotrain.spec.task']",
        "### The task: `resolve(tier, data_dir)` takes (tier, data_dir, verify, init_checkpoint)",
        "### The data recipe: `DataRecipe(name, steps)` takes (name, describe, steps, sources, call)",
        "### The model family: `ModelFamily(name, build)` takes (" + ", ".join(
            f.name for f in dataclasses.fields(family.ModelFamily)) + ")",
        "### The model family: `parallelize` is on none of ['ModelFamily']",
    ]  # fmt: skip
    assert missing_paths(stale) == ["timetotrain/runner/data.py"]
