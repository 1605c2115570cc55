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

from timetotrain.cli import main
from timetotrain.cli.suite_driver import Suite, SuiteOptions, finished_seeds, recipe_for, select
from timetotrain.data import govreport
from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import check_log
from timetotrain.spec import registry

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent


def _env(tmp_path):
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, "TTT_EXTRA_BENCHMARKS": "toy_benchmark", "OMP_NUM_THREADS": "1",
            "TTT_CACHE": str(tmp_path / "cache"), "XDG_CACHE_HOME": str(tmp_path / "user-cache")}  # fmt: skip


def suite_cmd(tmp_path, runs: int, *extra: str) -> list[str]:
    """The toy's suite with --data SRC: its data comes from the toy task's own recipe, into the cache."""
    (tmp_path / "src").mkdir(exist_ok=True)
    return ttt_command("suite", "--tier", "tiny", "--only", "toy_classify", "--runs", str(runs), "--seed", "7",
                       "--data", str(tmp_path / "src"), "--out", str(tmp_path / "out"), *extra)  # fmt: skip


def test_every_registered_tier_is_found_and_its_data_recipe_named():
    tiny = select("tiny", None)
    assert {b.name for b in tiny} == {n for n in registry.names() if "tiny" in registry.get(n).tiers}
    src = require_file(shared_data_dir())
    for b in tiny:
        tier = b.tiers["tiny"]
        for bench, t in [(b, tier)] + ([(tier.base.benchmark, tier.base.pretraining)] if tier.base else []):
            r = recipe_for(bench, t, src)
            if r is None:  # a benchmark with data of its own kind: prepared by hand (--data BENCH=DIR)
                assert bench.task.data_name(t) is None
                continue
            assert r.name == bench.task.data_name(t), b.name
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
        recipe_for(registry.get("llama31_8b"), registry.get("llama31_8b").tiers["tiny"], tmp_path)


@pytest.mark.slow
def test_suite_runs_scores_and_resumes(tmp_path, monkeypatch):
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
    # The toy task's recipe made the data once, into the cache; the restart found it there.
    assert "toy points: cached in" in res.stderr and (tmp_path / "cache" / "data").is_dir()
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
    """The keying (another user's, host's or commit's run time is not used) is tests/test_terminal.py's."""
    s = Suite(
        SuiteOptions(tier="tiny", out=tmp_path / "out", cache=tmp_path / "cache", history=tmp_path / "h.json")
    )
    s.state = {"tier": "tiny", "seeds": {}, "seconds": {}}
    assert s.eta("llama31_8b", 2) == "ETA: no earlier run on this machine (of this code, tier and flags)"
    s._remember("llama31_8b", 50.0)
    s._remember("llama31_8b", 70.0)
    assert (
        s.eta("llama31_8b", 2) == "ETA 2.0 min for llama31_8b, from this machine's earlier runs of this code"
    )
    s.state["seconds"]["llama31_8b"] = [90.0]
    assert s.eta("llama31_8b", 3) == "ETA 4.5 min for llama31_8b"


@pytest.mark.parametrize("name", ["rgat", "flux1"])
def test_tasks_outside_the_two_kinds_prepare_their_tiny_data(name, tmp_path):
    """`ttt suite --data SRC` reaches rgat and flux1 through their tasks' recipes (in-process calls): the
    tiny data a recipe writes is what the tier's resolve accepts; a reference tier, whose data no recipe
    makes, is a one-line error and has no data name."""
    bench = registry.get(name)
    src = require_file(shared_data_dir())
    recipe = bench.task.data_recipe(bench.tier("tiny"), src)
    assert recipe.name == bench.task.data_name(bench.tier("tiny")) and recipe.call is not None
    recipe.call(tmp_path / "tiny")
    bench.task.resolve(bench.tier("tiny"), tmp_path / "tiny")
    with pytest.raises(UserError, match="--data " + name + "=DIR"):
        bench.task.data_recipe(bench.tier("reference"), src)
    assert bench.task.data_name(bench.tier("reference")) is None


def test_data_prepare_for_runs_the_tasks_recipe(tmp_path, monkeypatch, capsys):
    """`ttt data prepare --for BENCH --tier T` runs the recipe the suite runs: the toy's in-process call,
    and llama2_70b_lora's two `ttt data prepare govreport` steps (in this process)."""
    monkeypatch.setenv("TTT_EXTRA_BENCHMARKS", "toy_benchmark")
    (tmp_path / "src").mkdir()
    toy = registry.get("toy_classify")
    argv = ["data", "prepare", "--for", "toy_classify", "--tier", "tiny", "--src", str(tmp_path / "src")]
    assert main([*argv, "--out", str(tmp_path / "toy")]) == 0
    toy.task.resolve(toy.tier("tiny"), tmp_path / "toy")
    assert "2,048 toy points" in capsys.readouterr().out
    src = require_file(shared_data_dir())
    lora = registry.get("llama2_70b_lora")
    out = tmp_path / "gov"
    argv = ["data", "prepare", "--for", lora.name, "--tier", "tiny", "--src", str(src), "--out", str(out)]
    assert main(argv) == 0
    recipe = lora.task.data_recipe(lora.tier("tiny"), src)
    assert len(recipe.steps) == 2 and recipe.call is None
    # Both splits (the tier's resolve needs its base as well: tests/test_lora_tiny.py runs it).
    for split in ("train", "validation"):
        assert all((out / name).is_file() for name in govreport.array_names(split))
        assert (out / f"{govreport.dataset_name(split)}.manifest.json").is_file()


@pytest.mark.parametrize(
    "dataset, extra, says",
    [
        (["c4"], ["--tier", "tiny"], "DATASET does not go with --for"),
        ([], ["--tier", "tiny", "--split", "train"], "--split does not go with --for"),
        ([], [], "needs --tier T"),
        ([], ["--tier", "huge"], "huge"),
    ],
)
def test_data_prepare_for_bad_input_is_one_line(tmp_path, monkeypatch, capsys, dataset, extra, says):
    monkeypatch.setenv("TTT_EXTRA_BENCHMARKS", "toy_benchmark")
    argv = [
        "data",
        "prepare",
        *dataset,
        "--for",
        "toy_classify",
        "--src",
        str(tmp_path),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ttt: error:") and says in err[0], err
    assert not (tmp_path / "o").exists()
