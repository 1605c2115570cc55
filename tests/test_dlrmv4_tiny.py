"""dlrmv4 tiny end to end: `ttt data synth-yambda --scale tiny`, `ttt run` to the AUC target streaming the day
windows in time order, the log through `ttt check` (our rule file on the official engine); the untrained model
misses the target on the same held-out window; the optimizer pair: Adam on the dense parameters, row-wise
Adagrad on the tables (rows not looked up bit-unchanged), the clip over the dense parameters only."""

import os

import pytest
import torch
from conftest import mllog, ttt_run
from untrained import assert_first_eval_after_training, assert_misses_target

from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.train.adagrad import SparseAdagrad
from timetotrain.train.optim import OptimizerPair
from timetotrain.train.step import build_training

pytestmark = pytest.mark.e2e


def ttt(*argv):
    return ttt_run(*argv, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("yambda") / "data"
    made = ttt("data", "synth-yambda", "--scale", "tiny", "--out", str(out), "--seed", "0")
    assert made.returncode == 0, made.stderr
    return out


def _opened(data_dir):
    bench = get("dlrmv4")
    tier = bench.tier("tiny")
    dev = torch.device("cpu")
    tr = build_training(bench, tier, dev, 0)
    run = bench.task.open(tier, bench.task.resolve(tier, data_dir), 0, Share.of(tier.global_batch_size), dev)
    return bench, tier, tr, run


@pytest.mark.slow
def test_tiny_run_reaches_the_target_and_passes_the_engine(data, tmp_path):
    p = ttt("run", "dlrmv4", "--tier", "tiny", "--data", str(data), "--logdir", str(tmp_path), "--seed", "100",
            "--quiet")  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    log = tmp_path / "dlrmv4" / "tiny" / "result_0.txt"
    records = mllog(log)
    evals = [r for r in records if r["key"] == "eval_accuracy"]
    assert evals[-1]["value"] >= 0.60 and all(r["metadata"]["samples_count"] % 1280 == 0 for r in evals)
    assert evals[0]["metadata"]["samples_count"] == 1280
    assert [r["value"] for r in records if r["key"] == "eval_samples"] == [3312]
    checked = ttt("check", "--ruleset", "6.1.0", str(log))
    assert checked.returncode == 0 and "PASS" in checked.stdout, checked.stdout + checked.stderr


@pytest.mark.slow
def test_untrained_misses_the_target_and_the_optimizer_pair(data):
    bench, tier, tr, run = _opened(data)
    assert_first_eval_after_training(bench, tier)
    assert_misses_target(bench, tier, run.evaluate(tr.model))
    # Adam on the dense parameters, row-wise Adagrad on the one table weight; the clip leaves the table out.
    table = tr.bare.embedding.weight
    assert isinstance(tr.opt, OptimizerPair) and isinstance(tr.opt.dense, torch.optim.Adam)
    assert isinstance(tr.opt.tables, SparseAdagrad) and tr.opt.tables.param_groups[0]["rowwise"]
    assert [p for g in tr.opt.tables.param_groups for p in g["params"]] == [table]
    assert all(p is not table for p in tr.params) and len(tr.params) == len(list(tr.bare.parameters())) - 1
    # One step at the tier's LR (step 10 of the warmup): the rows looked up move by Adagrad's row-wise rule,
    # the others stay bit-identical; both optimizers see the same LR.
    batch = run.batch(0)
    before = table.detach().clone()
    loss = run.loss(tr.model, batch)
    loss.backward()
    g = table.grad.coalesce()
    rows, vals = g.indices()[0], g.values()
    tr.opt.zero_grad()
    tr.step(10, batch, 1, run.loss)
    lr = tier.lr * 10 / tier.warmup_steps
    assert {grp["lr"] for grp in tr.opt.param_groups} == {lr}
    want = before.clone()
    want[rows] -= lr * vals / (vals.pow(2).mean(1).sqrt() + 1e-8).unsqueeze(1)
    untouched = torch.ones(len(table), dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(table.detach()[untouched], before[untouched])
    torch.testing.assert_close(table.detach()[rows], want[rows], rtol=1e-5, atol=1e-7)
