"""A fresh clone has no ../shared/data: its test session fetches the data fixtures into the user's cache
(tests/test_fixtures_download.py) or, where it cannot, skips what needs them and says so in one line (how
many, why, how to get them) instead of a wall of skip reasons only."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e  # a pytest session in a subprocess


@pytest.mark.slow
def test_an_offline_fresh_clone_tries_the_cache_then_says_so_in_one_line(tmp_path):
    """A copy of the test harness with no ../shared/data beside it and no network: the session start tries
    the fetch (a loopback port nobody serves stands for GitHub), leaves nothing in the cache, and the one
    summary line says why and that a folder in the final layout can be passed as it is."""
    clone = tmp_path / "clone"
    (clone / "tests").mkdir(parents=True)
    for name in ("conftest.py", "forked.py", "test_c4_mixtral.py"):
        shutil.copy(REPO / "tests" / name, clone / "tests" / name)
    env = {k: v for k, v in os.environ.items() if k not in ("TTT_SHARED_DATA", "TTT_CACHE")}
    env.update(CI="false", XDG_CACHE_HOME=str(tmp_path / "xdg"), TTT_FIXTURES_MIRROR="http://127.0.0.1:9")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])  # ttt from this checkout
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_c4_mixtral.py"]
    proc = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    cache = tmp_path / "xdg" / "timetotrain" / "fixtures"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ttt: ")]
    assert lines[0] == (
        f"ttt: no data fixtures at {tmp_path / 'shared' / 'data'}: fetching them once into {cache} "
        "(TTT_FETCH_FIXTURES=0 skips this)"
    )
    assert len(lines) == 2 and lines[1].startswith("ttt: 2 test(s) skipped: the data fixtures are not in ")
    assert f"fetching them into {cache} failed, leaving nothing: 127.0.0.1:9 not reached in 5 s" in lines[1]
    assert "ttt data download fixtures --out DIR" in lines[1] and "../shared/data" in lines[1]
    assert "can be passed as it is with TTT_SHARED_DATA=DIR" in lines[1]
    assert not (tmp_path / "xdg").exists()
