"""Every import in `timetotrain/` runs downhill and no modules import each other in a circle.

The check reads the source (AST), so imports inside functions count as much as those at the top of a file:
a lazy import still ties the two modules together, it only hides the tie from a grep for `^from`.

Layers, from the top down: a module may import its own folder and any folder of a lower layer, never a
folder of its own layer or a higher one. Top-level modules (`errors.py`, `fileio.py`, ...) are the ground.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "timetotrain"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Where each module stands, by the longest matching name (higher imports lower): one rank per folder. What a
# benchmark is (`spec/`: Benchmark, Tier, the Task interface, the official facts, the registry) stands low, so
# the harness, the logs and the tasks read it without reaching up into `suite/`. The registry loads a
# declaration of `suite/` by its name (importlib), the one sanctioned upward path, which an import statement
# never is. A module that no entry matches fails the test, so a new folder has to be placed.
LAYERS = {
    "timetotrain.__main__": 100,  # `python -m timetotrain`: the entry point, above everything
    "timetotrain.cli": 90,  # the `ttt` commands
    "timetotrain.suite": 70,  # one declaration per benchmark
    "timetotrain.tasks": 60,  # kinds of training (and GRPO's rollouts, policy gradient and reward sandbox)
    "timetotrain.train": 50,  # the harness: the timed loop, the step, parallel plans, checkpoints
    "timetotrain.report": 50,  # `ttt report`'s plots and pages
    "timetotrain.mlperf": 40,  # the MLPerf log, compliance, scoring, packaging
    "timetotrain.spec": 30,  # what a benchmark declares, the Task interface, official facts, the registry
    "timetotrain.models": 20,
    "timetotrain.data": 20,
    "timetotrain": 10,  # the ground: errors, fileio, progress, interrupt, lifeline, markup, shell, trees
}


def layer(module: str, is_package: bool = False) -> tuple[str, int]:
    """(the LAYERS entry, its rank) that places `module`; a package's own `__init__` is `pkg.__init__`."""
    name = module + ".__init__" if is_package else module
    while name not in LAYERS:
        if "." not in name:
            raise KeyError(f"{module} is in no layer: add it to LAYERS")
        name = name.rpartition(".")[0]
    return name, LAYERS[name]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(source: str, module: str, is_package: bool) -> set[tuple[str, str | None]]:
    """What `source` (module `module`) imports from `timetotrain`, anywhere in the file, as pairs
    (the module the statement names, the submodule it may name): `import A` is (A, None), and
    `from A import b` is (A, A.b), for b may be a submodule of A or a name defined in A."""
    found: set[tuple[str, str | None]] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.update((target, f"{target}.{a.name}") for a in node.names)
    return {(m, sub) for m, sub in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def graph(sources: dict[str, tuple[str, bool]]) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the modules of the tree it imports, the imports of modules the tree does not hold: a
    module that moved while an importer kept its old name)."""
    known = set(sources)
    edges: dict[str, set[str]] = {}
    missing = []
    for module, (source, is_package) in sorted(sources.items()):
        targets = set()
        for named, sub in imported(source, module, is_package):
            target = sub if sub in known else named
            if target not in known:
                missing.append(f"{module} imports {named}, which is no module of the tree")
            elif target != module:
                targets.add(target)
        edges[module] = targets
    return edges, sorted(set(missing))


def upward(edges: dict[str, set[str]], packages: set[str]) -> list[str]:
    """Each import of a module of another layer entry at the same or a higher rank, as 'A -> B (a n -> b m)'."""
    found = []
    for a, targets in sorted(edges.items()):
        where_a, rank_a = layer(a, a in packages)
        for b in sorted(targets):
            where_b, rank_b = layer(b, b in packages)
            if where_b != where_a and rank_b >= rank_a:
                found.append(f"{a} -> {b} ({where_a} {rank_a} -> {where_b} {rank_b})")
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def tree_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """module -> (its source, whether it is a package's `__init__`), for every module under `root`."""
    return {
        module_name(p, root): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
        for p in sorted(root.rglob("*.py"))
    }


def check(sources: dict[str, tuple[str, bool]]) -> tuple[list[str], list[list[str]], list[str]]:
    """(the upward imports, the circles, the imports of missing modules) of a tree of sources."""
    edges, missing = graph(sources)
    packages = {m for m, (_, is_package) in sources.items() if is_package}
    return upward(edges, packages), circles(edges), missing


def test_every_folder_has_a_layer():
    # Without this a new folder would fall through to the ground entry and be allowed nothing.
    tops = {m.split(".")[1] for m in tree_sources() if "." in m}
    folders = {f"{PACKAGE}.{top}" for top in tops if (ROOT / top).is_dir()}
    assert folders <= set(LAYERS), f"place these folders in LAYERS: {sorted(folders - set(LAYERS))}"


def test_every_import_runs_downhill_and_none_in_a_circle():
    up, rings, missing = check(tree_sources())
    assert up == []
    assert rings == []
    assert missing == []


def folder_edges(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """The imports between folders (LAYERS entries): folder -> the other folders its modules import."""
    edges, _ = graph(sources)
    packages = {m for m, (_, is_package) in sources.items() if is_package}
    out: dict[str, set[str]] = {}
    for a, targets in edges.items():
        where_a = layer(a, a in packages)[0]
        out.setdefault(where_a, set()).update(layer(b, b in packages)[0] for b in targets)
        out[where_a].discard(where_a)
    for targets in list(out.values()):
        for t in targets:
            out.setdefault(t, set())
    return out


def test_one_rank_per_folder_and_no_circle_between_folders():
    # Each entry is a folder (or the entry point, or the ground), never a module carved out of a folder:
    # what a reader sees in the tree is the layering the test enforces.
    tops = {f"{PACKAGE}.{p.name}" for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(LAYERS) == tops | {PACKAGE, f"{PACKAGE}.__main__"}
    assert circles(folder_edges(tree_sources())) == []


def test_the_checker_sees_a_lazy_upward_import_a_circle_and_a_missing_module():
    # Planted sources through the same check: a train module importing cli inside a function (what a grep
    # for `^from` misses), a relative import up into tasks, two model modules importing each other, and an
    # import of a module by the name it had before it moved.
    planted = {
        "timetotrain.train.loop": ("def run():\n    from timetotrain.cli.run import run_set\n", False),
        "timetotrain.train.step": ("from ..tasks import causal_lm\n", False),
        "timetotrain.tasks.causal_lm": ("from timetotrain.models.llama_hf import hf_mapping\n", False),
        "timetotrain.cli.run": ("from timetotrain.train import loop\n", False),
        "timetotrain.models.a": ("from timetotrain.models.b import B\n", False),
        "timetotrain.models.b": ("import timetotrain.models.a\n", False),
        "timetotrain.models": ("", True),
    }
    up, rings, missing = check(planted)
    assert up == [
        "timetotrain.train.loop -> timetotrain.cli.run (timetotrain.train 50 -> timetotrain.cli 90)",
        "timetotrain.train.step -> timetotrain.tasks.causal_lm (timetotrain.train 50 -> timetotrain.tasks 60)",
    ]
    assert rings == [
        ["timetotrain.cli.run", "timetotrain.train.loop"],
        ["timetotrain.models.a", "timetotrain.models.b"],
    ]
    assert missing == [
        "timetotrain.tasks.causal_lm imports timetotrain.models.llama_hf, which is no module of the tree"
    ]
    # The same tree without the plants passes: the check does not fail on everything.
    planted_in = {"timetotrain.train.loop", "timetotrain.train.step", "timetotrain.tasks.causal_lm"}
    clean = {
        m: ("" if m in planted_in or m == "timetotrain.models.b" else s, p) for m, (s, p) in planted.items()
    }
    assert check(clean) == ([], [], [])


if __name__ == "__main__":
    # `python tests/test_imports.py`: the folders, the imports between them, and what runs against the layers.
    sources = tree_sources()
    up, rings, missing = check(sources)
    between = folder_edges(sources)
    for folder in sorted(between, key=lambda f: -LAYERS[f]):
        print(f"{LAYERS[folder]:>4} {folder}: imports {', '.join(sorted(between[folder])) or '-'}")
    print(
        f"folders {len(between)}, upward imports {len(up)}, circles of modules {len(rings)}, "
        f"circles between folders {len(circles(between))}, missing modules {len(missing)}"
    )
