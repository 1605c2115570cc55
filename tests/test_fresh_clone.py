"""A fresh clone has no ../shared/data: its test session skips what needs the data fixtures and says so in
one line (how many, why, how to get them) instead of a wall of skip reasons only."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e  # a pytest session in a subprocess


@pytest.mark.slow
def test_missing_fixtures_are_counted_in_one_line(tmp_path):
    empty = tmp_path / "no-fixtures"
    empty.mkdir()
    env = {**os.environ, "TTT_SHARED_DATA": str(empty), "CI": "false"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_c4_mixtral.py"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ttt: ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    line = lines[0]
    assert line.startswith(f"ttt: 2 test(s) skipped: the data fixtures are not in {empty};")
    assert "ttt data download fixtures --out DIR" in line and "TTT_SHARED_DATA=DIR" in line
    assert "../shared/data" in line
