"""No function in `timetotrain/` is longer than LIMIT lines: a longer one is a hub that does several things,
to be cut into named steps (the timed run: train/loop.py; a command's flags: cli/flags.py).

Read from the source (AST): a function's length is from its `def` line to its last line, docstring,
comments and blank lines included; methods and nested functions count on their own (a nested function's
lines count in its parent too). `python tests/test_function_size.py` prints the longest ones.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "timetotrain"
LIMIT = 120


def lengths(source: str, where: str) -> list[tuple[int, str]]:
    """(lines, "where:name") of every function and method in `source`."""
    return [
        (node.end_lineno - node.lineno + 1, f"{where}:{node.name}")
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def too_long(files: dict[str, str], limit: int = LIMIT) -> list[str]:
    """The functions over `limit` lines in `files` (path -> source), longest first."""
    found = [row for path, src in files.items() for row in lengths(src, path)]
    return [f"{where}: {n} lines" for n, where in sorted(found, reverse=True) if n > limit]


def package_files() -> dict[str, str]:
    return {str(p.relative_to(ROOT.parent)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_no_function_in_the_package_is_over_the_limit():
    assert too_long(package_files()) == [], f"cut these into named steps (at most {LIMIT} lines each)"


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def test_the_checker_finds_a_planted_long_function_method_and_nested_function():
    at_limit = _function("fits", LIMIT - 1)  # def line + body: exactly LIMIT lines
    over = _function("hub", LIMIT)
    method = "class C:\n" + _function("method", LIMIT, indent="    ")
    nested = "def outer():\n" + _function("inner", LIMIT + 5, indent="    ") + "    return inner\n"
    asynchronous = "async " + _function("coro", LIMIT)
    files = {"a.py": at_limit + over, "b.py": method, "c.py": nested, "d.py": asynchronous}
    assert too_long(files) == [
        f"c.py:outer: {LIMIT + 8} lines",
        f"c.py:inner: {LIMIT + 6} lines",
        f"d.py:coro: {LIMIT + 1} lines",
        f"b.py:method: {LIMIT + 1} lines",
        f"a.py:hub: {LIMIT + 1} lines",
    ]
    assert too_long({"a.py": at_limit}) == []


if __name__ == "__main__":
    rows = sorted((row for p, s in package_files().items() for row in lengths(s, p)), reverse=True)
    for n, where in rows[: int(sys.argv[1]) if len(sys.argv) > 1 else 15]:
        print(f"{n:5}  {where}")
