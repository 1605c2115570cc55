"""dlrm_dcnv2 tiny end to end: `ttt data synth-criteo --scale tiny`, `ttt run` to the AUC target on the
generated days, the log through `ttt check` (our rule file on the official engine); the untrained model
misses the target on the same validation rows; the task's recipe names the same data."""

import os

import pytest
import torch
from conftest import mllog, ttt_run
from untrained import assert_first_eval_after_training, assert_misses_target

from timetotrain.errors import UserError
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.train.step import build_training

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def ttt(*argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return ttt_run(*argv, env=env)


@pytest.fixture(scope="module")
def run(tmp_path_factory, criteo_tiny):
    made, data = criteo_tiny  # conftest's, shared with tests/test_dlrm_dcnv2_distributed.py
    assert made.returncode == 0, made.stderr
    assert "day 23" in made.stdout and "hidden model's validation AUC" in made.stdout
    root = tmp_path_factory.mktemp("dlrm")
    p = ttt("run", "dlrm_dcnv2", "--tier", "tiny", "--data", str(data), "--logdir", str(root / "logs"),
            "--seed", "100", "--quiet")  # fmt: skip
    return root, data, p


def test_tiny_run_reaches_the_target_and_passes_the_engine(run):
    root, _, p = run
    assert p.returncode == 0, p.stderr[-2000:]
    log = root / "logs" / "dlrm_dcnv2" / "tiny" / "result_0.txt"
    records = mllog(log)
    evals = [r for r in records if r["key"] == "eval_accuracy"]
    assert evals[-1]["value"] >= 0.70 and all("epoch_num" in r["metadata"] for r in evals)
    assert 0 < evals[0]["metadata"]["epoch_num"] < 0.06  # 20 evals an epoch, counted from 0
    assert [r["value"] for r in records if r["key"] == "eval_samples"] == [16_384]
    checked = ttt("check", str(log))
    assert checked.returncode == 0 and "PASS" in checked.stdout, checked.stdout + checked.stderr


def test_untrained_model_misses_the_target(run):
    _, data_dir, _ = run
    bench = get("dlrm_dcnv2")
    tier = bench.tier("tiny")
    assert_first_eval_after_training(bench, tier)
    dev = torch.device("cpu")
    tr = build_training(bench, tier, dev, 0)
    data = bench.task.open(tier, bench.task.resolve(tier, data_dir), 0, Share.of(tier.global_batch_size), dev)
    try:
        assert_misses_target(bench, tier, data.evaluate(tr.model))
    finally:
        data.close()


def test_the_recipe_names_the_generated_data(tmp_path):
    bench = get("dlrm_dcnv2")
    recipe = bench.task.data_recipe(bench.tier("tiny"), tmp_path)
    assert recipe.name == bench.task.data_name(bench.tier("tiny")) == "criteo-synth-tiny"
    with pytest.raises(UserError, match="--data dlrm_dcnv2=DIR"):
        bench.task.data_recipe(bench.tier("reference"), tmp_path)
    assert bench.task.data_name(bench.tier("reference")) is None
