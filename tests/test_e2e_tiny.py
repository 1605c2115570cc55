"""End to end: the llama31_8b tiny tier to its target, its log through the official compliance engine,
and the ways a run ends aborted (step limit, SIGTERM, non-finite loss)."""

import signal
import subprocess
import time

import pytest
import torch
from conftest import mllog, official_errors, ttt_command, ttt_run
from test_golden import assert_matches_golden, golden, golden_env

from timetotrain.mlperf.compliance import check_log

pytestmark = pytest.mark.e2e


def ttt(*argv, **kw):
    return ttt_run(*argv, **kw)


def tiny(data, logdir, *extra):
    return [
        "run",
        "llama31_8b",
        "--tier",
        "tiny",
        "--data",
        str(data),
        "--logdir",
        str(logdir),
        "--quiet",
        *extra,
    ]


@pytest.mark.slow
def test_tiny_reaches_target_and_passes_the_official_checker(c4_prepared, tmp_path):
    case = "llama31_8b_tiny_single"
    proc = ttt(*tiny(c4_prepared, tmp_path, "--seed", str(golden(case)["seed"])), env=golden_env(case))
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = tmp_path / "llama31_8b" / "tiny" / "result_0.txt"
    assert_matches_golden(log, case)  # the first 60 steps as recorded before the harness redesign
    recs = mllog(log)
    keys = [r["key"] for r in recs]
    # Order of the timed run.
    assert keys[0] == "cache_clear" and keys[1] == "init_start"
    assert keys.index("init_stop") + 1 == keys.index("run_start")
    assert keys.index("seed") < keys.index("init_stop")
    assert keys[-1] == "run_stop" and recs[-1]["metadata"]["status"] == "success"
    evals = [r for r in recs if r["key"] == "eval_accuracy"]
    assert [e["metadata"]["samples_count"] for e in evals] == [320 * (i + 1) for i in range(len(evals))]
    assert evals[-1]["value"] <= 4.8 < min(e["value"] for e in evals[:-1])
    steps = [r for r in recs if r["key"] == "train_loss"]
    assert len(steps) == evals[-1]["metadata"]["samples_count"] // 16
    assert next(r["value"] for r in recs if r["key"] == "seed") == 1234
    verdict = check_log(log)
    assert verdict.ok, verdict.output
    assert official_errors(log, "6.0.0", "tiny") == []  # the official common.yaml + open_common.yaml
    print(
        f"tiny seed 1234: {len(steps)} steps, eval {evals[-1]['value']:.4f}; {proc.stderr.strip().splitlines()[-1]}"
    )


@pytest.mark.slow
def test_sigterm_aborts_with_flushed_log(c4_prepared, tmp_path):
    proc = subprocess.Popen(
        ttt_command(*tiny(c4_prepared, tmp_path, "--seed", "3")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "llama31_8b" / "tiny" / "result_0.txt"
    live = log.with_name(log.name + ".partial")  # renamed to `log` once run_stop is written
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (live.exists() and '"train_loss"' in live.read_text()):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    recs = mllog(log)
    assert recs[-1]["key"] == "run_stop" and recs[-1]["metadata"]["status"] == "aborted"
    assert "signal SIGTERM" in err


def test_non_finite_loss_aborts(c4_prepared, tmp_path, monkeypatch):
    from timetotrain.train import loop, step

    def nan_step(*args, **kwargs):
        return torch.tensor([float("nan"), 0.0])

    monkeypatch.setattr(step.Training, "step", nan_step)
    res = loop.run(
        loop.RunOptions("llama31_8b", "tiny", c4_prepared, tmp_path, seed=5, echo=False, max_steps=50)
    )
    assert res.status == "aborted" and "non-finite" in res.reason and res.exit_code == 1
    assert mllog(res.log_path)[-1]["metadata"]["status"] == "aborted"
    assert res.steps <= 2  # caught within one step of lag


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_sigint_is_also_an_abort(c4_prepared, tmp_path, sig):
    proc = subprocess.Popen(
        ttt_command(*tiny(c4_prepared, tmp_path, "--seed", "4")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "llama31_8b" / "tiny" / "result_0.txt"
    live = log.with_name(log.name + ".partial")  # renamed to `log` once run_stop is written
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (live.exists() and '"run_start"' in live.read_text()):
        time.sleep(0.1)
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    assert mllog(log)[-1]["metadata"]["status"] == "aborted"


@pytest.mark.slow
def test_step_limit_aborts_with_nonzero_exit_and_never_overwrites(c4_prepared, tmp_path):
    """`--runs 3` gives distinct logged seeds and numbered files; each run stopped by the step limit is aborted
    with one run_stop and fails the check; a later `ttt run` into the same folder starts a new file."""
    proc = ttt(*tiny(c4_prepared, tmp_path, "--runs", "3", "--max-steps", "2"))
    # None can meet the target in 2 steps, but the set completes.
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "0/3 runs met the target" in proc.stderr
    first = (tmp_path / "llama31_8b" / "tiny" / "result_0.txt").read_text()
    proc = ttt(*tiny(c4_prepared, tmp_path, "--seed", "7", "--max-steps", "3"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    logs = sorted((tmp_path / "llama31_8b" / "tiny").glob("result_*.txt"))
    assert [p.name for p in logs] == ["result_0.txt", "result_1.txt", "result_2.txt", "result_3.txt"]
    seeds = [next(r["value"] for r in mllog(p) if r["key"] == "seed") for p in logs]
    assert len(set(seeds[:3])) == 3 and seeds[3] == 7
    for log in logs:
        recs = mllog(log)
        assert recs[-1]["key"] == "run_stop" and recs[-1]["metadata"]["status"] == "aborted"
        assert [r["key"] for r in recs].count("run_stop") == 1
        assert not check_log(log).ok  # the target was never met
    assert logs[0].read_text() == first and first.count("run_start") == 1  # the later run did not append
