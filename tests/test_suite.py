"""`ttt suite`: benchmarks and their data found through the registry, one results folder, the scorecard,
and resuming (an interrupted suite started again reruns nothing that finished).

The end-to-end tests drive the toy benchmark (tests/toy_benchmark.py, seconds per run) through the real
command; the registered benchmarks' recipes are checked against the shared fixtures without running them.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import require_file, shared_data_dir, ttt_command
from toy_benchmark import make_data

from timetotrain import suite
from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import check_log
from timetotrain.runner import data as recipes
from timetotrain.runner.suite import finished_seeds, select

HERE = Path(__file__).parent


def _env(tmp_path):
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, "TTT_EXTRA_BENCHMARKS": "toy_benchmark", "OMP_NUM_THREADS": "1",
            "TTT_CACHE": str(tmp_path / "cache")}  # fmt: skip


def suite_cmd(tmp_path, runs: int, *extra: str) -> list[str]:
    return ttt_command("suite", "--tier", "tiny", "--only", "toy_classify", "--runs", str(runs), "--seed", "7",
                       "--data", f"toy_classify={tmp_path / 'data'}", "--out", str(tmp_path / "out"), *extra)  # fmt: skip


def test_every_registered_tier_is_found_and_its_data_recipe_named():
    tiny = select("tiny", None)
    assert {b.name for b in tiny} == {n for n in suite.names() if "tiny" in suite.get(n).tiers}
    src = require_file(shared_data_dir())
    for b in tiny:
        tier = b.tiers["tiny"]
        for bench, t in [(b, tier)] + ([(tier.base.benchmark, tier.base.pretraining)] if tier.base else []):
            r = recipes.recipe_for(bench, t, src)
            if r is None:  # a benchmark with data of its own kind: prepared by hand (--data BENCH=DIR)
                assert recipes.cache_name(bench, t) is None
                continue
            assert r.name == recipes.cache_name(bench, t), b.name
            assert all(p.exists() for p in r.sources)
            for step in r.steps:  # each step is a `ttt data prepare` line the parser accepts
                from timetotrain.cli import build_parser

                build_parser().parse_args([str(a) for a in step])


def test_bad_suite_input_is_one_line(tmp_path):
    with pytest.raises(UserError, match="--only llama31_8b has no tier"):
        select("huge", ["llama31_8b"])
    with pytest.raises(UserError, match="no benchmark has it"):
        select("huge", None)
    with pytest.raises(UserError, match="no c4-train"):
        recipes.lm_recipe(suite.get("llama31_8b").tiers["tiny"].data, tmp_path)


@pytest.mark.slow
def test_suite_runs_scores_and_resumes(tmp_path, monkeypatch):
    make_data(tmp_path / "data")
    out = tmp_path / "out"
    folder = out / "toy_classify" / "tiny"
    # Two runs; stopped (SIGINT, as Ctrl-C) once the first has finished.
    proc = subprocess.Popen(suite_cmd(tmp_path, 2), env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 240
    while not finished_seeds(folder) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    first = finished_seeds(folder)
    assert first, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    done = finished_seeds(folder)
    assert proc.returncode != 0 and len(done) < 2, err[-2000:]
    kept = {s: (p, p.read_bytes()) for s, p in done.items()}
    # Started again: only the missing seeds run; the finished logs stay as they were.
    res = subprocess.run(
        suite_cmd(tmp_path, 2), env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    final = finished_seeds(folder)
    assert sorted(final) == [7, 8]
    for s, (p, text) in kept.items():
        assert final[s] == p and p.read_bytes() == text
    assert f"{len(kept)} of 2 run(s) already finished" in res.stderr
    assert "ETA" in res.stderr
    # The scorecard: one row for the benchmark, every log passing the official checker.
    row = next(line for line in res.stdout.splitlines() if line.startswith("toy_classify"))
    assert "2/2" in row and "2/2 pass" in row
    card = json.loads((out / "scorecard.json").read_text())
    (row,) = card["benchmarks"]
    # Two runs are too few for the olympic score; the mean run time is there, and the note says why.
    assert row["compliant"] == 2 and row["score"] is None and row["mean_minutes"] > 0
    assert "too few" in row["note"]
    monkeypatch.setenv("TTT_EXTRA_BENCHMARKS", "toy_benchmark")  # the checker finds the toy's rule file
    assert all(check_log(p).ok for p in final.values())
    # A third start: nothing left to run, nothing rewritten.
    stamps = {p: p.stat().st_mtime_ns for p in final.values()}
    again = subprocess.run(
        suite_cmd(tmp_path, 2), env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0 and "already finished" in again.stderr and "not rerun" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in finished_seeds(folder).values()} == stamps


def test_eta_comes_from_this_suite_then_from_earlier_ones(tmp_path):
    from timetotrain.runner.suite import Suite, SuiteOptions

    s = Suite(SuiteOptions(tier="tiny", out=tmp_path / "out", cache=tmp_path / "cache"))
    s.state = {"tier": "tiny", "seeds": {}, "seconds": {}}
    assert s.eta("llama31_8b", 2) == "ETA after its first run"
    s._remember("llama31_8b", 50.0)
    s._remember("llama31_8b", 70.0)
    assert s.eta("llama31_8b", 2) == "ETA 2.0 min for llama31_8b, from earlier suites"
    s.state["seconds"]["llama31_8b"] = [90.0]
    assert s.eta("llama31_8b", 3) == "ETA 4.5 min for llama31_8b"


@pytest.mark.parametrize("name", ["rgat", "flux1"])
def test_tasks_outside_the_two_kinds_prepare_their_tiny_data(name, tmp_path):
    """`ttt suite --data SRC` reaches rgat and flux1 through Task.prepare_data: the tiny data it writes is
    what the tier's resolve accepts; a reference tier, whose data no recipe makes, is a one-line error."""
    bench = suite.get(name)
    src = require_file(shared_data_dir())
    bench.task.prepare_data(bench.tier("tiny"), src, tmp_path / "tiny")
    bench.task.resolve(bench.tier("tiny"), tmp_path / "tiny")
    with pytest.raises(UserError, match="--data " + name + "=DIR"):
        bench.task.prepare_data(bench.tier("reference"), src, tmp_path / "ref")
    assert not (tmp_path / "ref").exists()
