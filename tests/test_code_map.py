"""docs/architecture.md's code map names what the tree holds: every top-level folder of the package, and only files
and folders that exist (a moved module must not leave the map behind)."""

import re

from conftest import REPO

PACKAGE = REPO / "timetotrain"


def code_map() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## How the code is organised", 1)[1]
    return section.split("```", 2)[1]


def test_every_folder_of_the_package_is_in_the_map_and_every_folder_there_exists():
    listed = set(re.findall(r"^  (\w+)/", code_map(), flags=re.M))
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert listed == folders


def test_every_file_the_map_names_exists():
    names = set(re.findall(r"\b([\w/]+\.py)\b", code_map()))
    present = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    missing = [n for n in sorted(names) if not any(p == n or p.endswith("/" + n) for p in present)]
    assert names and missing == []
