"""Same seed, same bits: a rerun of llama31_8b tiny repeats every train_loss and eval value exactly, in one
process (twice in the same interpreter, so no state leaks from one run into the next) and under DDP on 2
gloo processes. docs/reliability.md "Reproducibility" says which parallel modes this covers and why the others are not
claimed."""

import pytest
from conftest import mllog
from test_distributed import curves, launch

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

STEPS = 20  # the warmup's end and the first eval point (every 20 steps)


def _record(log):
    recs = mllog(log)
    loss = [r["value"] for r in recs if r["key"] == "train_loss"]
    evals = [(r["metadata"]["samples_count"], r["value"]) for r in recs if r["key"] == "eval_accuracy"]
    return loss, evals


@pytest.mark.slow
def test_one_process_reruns_bit_for_bit(c4_prepared, tmp_path):
    from timetotrain.train import loop

    runs = []
    for k in range(2):
        opts = loop.RunOptions(
            "llama31_8b", "tiny", c4_prepared, tmp_path / str(k), seed=21, echo=False, max_steps=STEPS
        )
        res = loop.run(opts)
        assert res.steps == STEPS and res.status == "aborted"  # the step limit, before the target
        runs.append(_record(res.log_path))
    (loss, evals), again = runs
    assert len(loss) == STEPS and len(evals) == 1
    assert (loss, evals) == again  # exact float equality, not a tolerance


@pytest.mark.slow
def test_ddp_two_processes_rerun_bit_for_bit(c4_prepared, tmp_path, llama_ddp_20):
    # The first run is conftest's (shared with tests/test_distributed.py), made with the same command.
    again = launch(c4_prepared, tmp_path, 2, "--max-steps", str(STEPS), "--parallel", "dp=2")
    runs = []
    for proc, logdir in (llama_ddp_20, (again, tmp_path)):
        assert proc.returncode == 1 and "ttt: error" not in proc.stderr, proc.stderr[-3000:]
        loss, evals, _ = curves(logdir)
        runs.append((loss.tolist(), evals))
    (loss, evals), again = runs
    assert len(loss) == STEPS and len(evals) == 1
    assert (loss, evals) == again
