"""Scale-out correctness on CPU with gloo: 1 process and 2 processes (DDP, FSDP2) at the same global batch
train the same model; gradient accumulation is equivalent; data is sharded without overlap; a failing rank
or a SIGTERM ends every rank with a complete, aborted log."""

import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import launch_llama_tiny as launch
from conftest import mllog

from timetotrain.data.gpt_dataset import GPTWindows
from timetotrain.data.indexed import IndexedDataset
from timetotrain.data.loader import TokenSource
from timetotrain.spec.task import Share

pytestmark = pytest.mark.distributed

STEPS = 20


def curves(logdir: Path):
    logs = list((logdir / "llama31_8b" / "tiny").glob("result_*.txt"))
    assert len(logs) == 1, logs  # one log, whatever the process count
    recs = mllog(logs[0])
    loss = [r["value"] for r in recs if r["key"] == "train_loss"]
    evals = [(r["metadata"]["samples_count"], r["value"]) for r in recs if r["key"] == "eval_accuracy"]
    return np.array(loss), evals, recs


@pytest.fixture(scope="module")
def single(c4_prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    proc = launch(c4_prepared, out, 1, "--max-steps", str(STEPS))
    assert proc.returncode == 1, proc.stderr[-2000:]  # step limit before the target: aborted, by design
    return curves(out)


# The DDP and FSDP2 runs are conftest's, shared with tests/test_reproducible.py (DDP) and tests/test_golden.py
# (FSDP2): their STEPS steps and first eval are compared.
SHARED = {"dp=2": "llama_ddp_20", "fsdp=2": "llama_fsdp2_20"}


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["dp=2", "fsdp=2", "cp=2"])
def test_two_processes_match_one(request, c4_prepared, tmp_path, single, parallel):
    if parallel in SHARED:
        proc, logdir = request.getfixturevalue(SHARED[parallel])
    else:
        proc = launch(c4_prepared, tmp_path, 2, "--max-steps", str(STEPS), "--parallel", parallel)
        logdir = tmp_path
    assert proc.returncode != 0  # aborted at the step limit, as the single-process run
    assert "injected" not in proc.stderr and "ttt: error" not in proc.stderr, proc.stderr[-3000:]
    loss, evals, recs = curves(logdir)
    ref_loss, ref_evals, _ = single
    assert len(ref_loss) == STEPS and len(loss) >= STEPS
    np.testing.assert_allclose(loss[:STEPS], ref_loss, rtol=1e-5)
    assert [s for s, _ in ref_evals] == [320] == [s for s, _ in evals[:1]]  # global samples_count
    np.testing.assert_allclose([v for _, v in evals[:1]], [v for _, v in ref_evals], rtol=1e-5)
    keys = {r["key"]: r["value"] for r in recs}
    assert keys["gradient_accumulation_steps"] == 1 and keys["global_batch_size"] == 16
    assert parallel in keys["ttt_parallel"]
    assert keys["context_parallelism"] == (2 if parallel == "cp=2" else 1)


@pytest.mark.slow
def test_gradient_accumulation_is_equivalent(c4_prepared, tmp_path, single):
    proc = launch(c4_prepared, tmp_path, 1, "--max-steps", str(STEPS), "--set", "micro_batch_size=4")
    assert proc.returncode == 1, proc.stderr[-2000:]
    loss, evals, recs = curves(tmp_path)
    np.testing.assert_allclose(loss, single[0], rtol=1e-5)
    np.testing.assert_allclose([v for _, v in evals], [v for _, v in single[1]], rtol=1e-5)
    assert next(r["value"] for r in recs if r["key"] == "gradient_accumulation_steps") == 4


@pytest.mark.slow
def test_ddp_with_accumulation_matches(c4_prepared, tmp_path, single):
    proc = launch(c4_prepared, tmp_path, 2, "--max-steps", str(STEPS), "--set", "micro_batch_size=2")
    assert "ttt: error" not in proc.stderr, proc.stderr[-3000:]
    loss, _, recs = curves(tmp_path)
    np.testing.assert_allclose(loss, single[0], rtol=1e-5)
    assert next(r["value"] for r in recs if r["key"] == "gradient_accumulation_steps") == 4  # 8 local / 2


def test_sharding_sees_every_sample_once_per_epoch(c4_prepared):
    ds = IndexedDataset(c4_prepared / "c4-train_text_document")
    win = GPTWindows(ds, 256, 3 * 1664, seed=3, shuffle=True)
    per_epoch = win.total_samples // win.num_epochs if win.num_epochs > 1 else len(win)
    gbs, world = 16, 2
    seen = []
    for rank in range(world):
        share = Share.of(gbs, rank, world)
        src = TokenSource(win, gbs, None, share.local, share.offset)
        for step in range(per_epoch // gbs):
            start = step * gbs + src.offset
            seen.extend(win.sample_id(i) for i in range(start, start + src.local))
    steps = per_epoch // gbs
    assert len(seen) == steps * gbs == len(set(seen))  # no window twice
    expected = {win.sample_id(i) for i in range(steps * gbs)}
    assert set(seen) == expected  # the ranks together read exactly the global batches


def _wait_for(log: Path, needle: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and needle in log.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{needle} never appeared in {log}")


@pytest.mark.slow
def test_failing_rank_ends_every_rank_with_an_aborted_log(c4_prepared, tmp_path):
    t0 = time.monotonic()
    proc = launch(c4_prepared, tmp_path, 2, "--parallel", "dp=2", "--abort-grace", "5", "--dist-timeout", "60",
                  env_extra={"TTT_INJECT_FAULT": "1:5"})  # fmt: skip
    seconds = time.monotonic() - t0
    assert proc.returncode != 0
    assert "injected fault on rank 1" in proc.stderr
    # Rank 0 alone says how its run ended (the watcher's SIGTERM, or the broken collective) and where its log is.
    stops = [ln for ln in proc.stderr.splitlines() if ln.startswith("ttt run ")]
    assert len(stops) == 1 and stops[0].endswith("result_0.txt"), proc.stderr[-3000:]
    _, _, recs = curves(tmp_path)
    assert recs[-1]["key"] == "run_stop" and recs[-1]["metadata"]["status"] == "aborted"
    print(f"failing rank: whole job ended in {seconds:.1f} s (including start-up)")


@pytest.mark.slow
def test_sigterm_to_launcher_aborts_with_flushed_log(c4_prepared, tmp_path):
    proc = launch(c4_prepared, tmp_path, 2, "--parallel", "dp=2", "--abort-grace", "5", wait=False)
    log = tmp_path / "llama31_8b" / "tiny" / "result_0.txt"
    _wait_for(log.with_name(log.name + ".partial"), '"train_loss"')  # the live name until run_stop
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    recs = mllog(log)
    assert recs[-1]["key"] == "run_stop" and recs[-1]["metadata"]["status"] == "aborted", err[-2000:]
