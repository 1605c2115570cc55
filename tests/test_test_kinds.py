"""Every test file says what kind of test it is, by markers registered in pyproject.toml: `parity`,
`distributed`, `e2e`, `bad_input` (a file's `pytestmark` or one test's decorator; several may apply), or
none for a unit test. Read from the source (AST), so it costs no collection:

- each marker a test file names is registered (a misspelt kind would silently select nothing);
- a file that starts other processes (`subprocess`, `ttt_command`, `ttt_run`, `run_ranks`: tests/forked.py)
  has a kind: a unit test runs in one process;
- a file that asks for a reference implementation (`require("transformers")`, ...) is a parity test, unless
  NOT_PARITY says what else it uses the library for.
"""

import ast
import re
import tomllib
from pathlib import Path

HERE = Path(__file__).parent
KINDS = {"parity", "distributed", "e2e", "bad_input"}
BUILTIN = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
REFERENCES = ("transformers", "peft", "diffusers", "torch_geometric", "megatron")
# Files that load a reference library for something other than comparing with it.
NOT_PARITY = {"test_untrusted.py": "writes hostile checkpoints with the HF libraries, to load them safely"}


def registered(pyproject: Path = HERE.parent / "pyproject.toml") -> set[str]:
    markers = tomllib.loads(pyproject.read_text())["tool"]["pytest"]["ini_options"]["markers"]
    return {m.split(":")[0].strip() for m in markers}


def marks(source: str) -> set[str]:
    """Every `pytest.mark.NAME` the file names, anywhere (module `pytestmark`, decorators)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if node.value.attr == "mark" and getattr(node.value.value, "id", None) == "pytest":
                found.add(node.attr)
    return found


def spawns(source: str) -> bool:
    return bool(re.search(r"\bsubprocess\.|\b(ttt_command|ttt_run|run_ranks)\(", source))


def references(source: str) -> bool:
    names = "|".join(REFERENCES)
    return bool(re.search(rf"require\([\"']({names})|^\s*(from|import) ({names})\b", source, re.M))


def problems(files: dict[str, str], known: set[str]) -> list[str]:
    out = []
    for name, source in sorted(files.items()):
        named = marks(source)
        for m in sorted(named - known - BUILTIN):
            out.append(f"{name}: pytest.mark.{m} is not registered in pyproject.toml")
        if spawns(source) and not named & KINDS:
            out.append(f"{name}: starts processes but has no kind ({', '.join(sorted(KINDS))})")
        if references(source) and "parity" not in named and name not in NOT_PARITY:
            out.append(f"{name}: loads a reference implementation but is not marked parity")
    return out


def test_the_kinds_are_registered():
    assert KINDS | {"slow"} <= registered()


def test_every_test_file_has_its_kind():
    # This file is left out: its planted sources below name what the rules look for.
    files = {
        p.name: p.read_text(encoding="utf-8") for p in sorted(HERE.glob("test_*.py")) if p != Path(__file__)
    }
    assert len(files) > 50
    assert problems(files, registered()) == []
    # The kinds are in use: a run of `-m e2e` (or of any kind) selects something.
    assert all(any(k in marks(s) for s in files.values()) for k in KINDS)


def test_the_check_fails_on_a_file_without_its_kind():
    files = {
        "test_a.py": "import subprocess\ndef test_x():\n    subprocess.run(['ttt'])\n",
        "test_b.py": "def test_y():\n    require('peft')\n",
        "test_c.py": "import pytest\npytestmark = pytest.mark.e2ee\n",
        "test_d.py": "import pytest, subprocess\npytestmark = [pytest.mark.e2e]\nsubprocess.run\n",
        "test_e.py": "def test_z():\n    ttt_run('plan', 'llama31_8b')\n",
    }
    assert problems(files, registered()) == [
        "test_a.py: starts processes but has no kind (bad_input, distributed, e2e, parity)",
        "test_b.py: loads a reference implementation but is not marked parity",
        "test_c.py: pytest.mark.e2ee is not registered in pyproject.toml",
        "test_e.py: starts processes but has no kind (bad_input, distributed, e2e, parity)",
    ]
