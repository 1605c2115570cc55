"""The harness interface on a task of another shape (tests/toy_benchmark.py): dict batches, Adam, an
accuracy target met from below, eval points in epochs, warmup+constant. It runs through the real `ttt run`,
its log passes the official compliance engine with the toy's own rule file, and `ttt score` scores it."""

import json
import os
from pathlib import Path

import pytest
from conftest import mllog, official_errors, ttt_run
from toy_benchmark import make_data

HERE = Path(__file__).parent
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
]  # every test launches `ttt` in a subprocess; the fixture runs three trainings


def _env():
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, "TTT_EXTRA_BENCHMARKS": "toy_benchmark", "OMP_NUM_THREADS": "1"}


def ttt(*argv, nproc=1):
    return ttt_run(*argv, nproc=nproc, env=_env(), timeout=300)


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    make_data(root / "data")
    procs = [
        ttt("run", "toy_classify", "--tier", "tiny", "--data", str(root / "data"), "--logdir", str(root / "logs"),
            "--seed", str(seed), "--quiet")
        for seed in (1, 2, 3)
    ]  # fmt: skip
    return root, procs


def test_toy_runs_to_its_target_in_epochs(toy_runs):
    root, procs = toy_runs
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    logs = sorted((root / "logs" / "toy_classify" / "tiny").glob("result_*.txt"))
    assert len(logs) == 3
    recs = mllog(logs[0])
    keys = {r["key"]: r["value"] for r in recs}
    assert keys["opt_name"] == "adam" and keys["gradient_accumulation_steps"] == 2
    evals = [r for r in recs if r["key"] == "eval_accuracy"]
    epochs = [e["metadata"]["epoch_num"] for e in evals]
    assert epochs == pytest.approx([0.25 * (i + 1) for i in range(len(evals))])  # 512 of 2,048 samples
    assert all("samples_count" not in e["metadata"] for e in evals)
    # Higher is better: the run stops at the first eval at or above 0.9, not below it.
    assert evals[-1]["value"] >= 0.9 and all(e["value"] < 0.9 for e in evals[:-1])
    assert recs[-1]["key"] == "run_stop" and recs[-1]["metadata"]["status"] == "success"
    # Warmup then constant: the constant-schedule loss keeps falling on separable clusters.
    losses = [r["value"] for r in recs if r["key"] == "train_loss"]
    assert losses[-1] < losses[0]


def test_toy_log_passes_the_official_engine_with_its_rule_file(toy_runs):
    root, _ = toy_runs
    log = root / "logs" / "toy_classify" / "tiny" / "result_0.txt"
    proc = ttt("check", str(log))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "toy_rules/toy_classify_tiny.yaml" in proc.stdout
    assert official_errors(log, "6.0.0", "tiny") == []  # the official common.yaml (no round lists the toy)


def test_toy_runs_are_scored(toy_runs):
    root, _ = toy_runs
    proc = ttt("score", str(root / "logs"), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (score,) = json.loads(proc.stdout)["results"]
    assert score["benchmark"] == "toy_classify" and len(score["runs"]) == 3
    assert all(r["converged"] and r["compliant"] for r in score["runs"])
    # Convergence points in epochs, as the log counts them (0.25 epoch per eval).
    assert {r["samples_to_converge"] % 0.25 for r in score["runs"]} == {0.0}
    assert score["score_minutes"] > 0


def test_toy_is_not_listed():
    proc = ttt("list")
    assert proc.returncode == 0 and "toy_classify" not in proc.stdout
