"""Every tiny tier needs training: its first evaluation comes after real steps, and the model it starts from
misses the target by the margin `untrained.py` states. The from-scratch language-model tiers are evaluated
here, freshly built, on the tier's own eval set; flux1 and rgat in their end-to-end tests (where their data is
prepared), llama2_70b_lora's base in tests/test_lora_tiny.py."""

import pytest
import torch
from untrained import assert_first_eval_after_training, assert_misses_target

from timetotrain.suite import get
from timetotrain.train.step import build_training

TIERS = ["llama31_8b", "gpt_oss_20b", "deepseekv3_671b", "llama31_405b", "llama2_70b_lora", "flux1", "rgat"]


@pytest.mark.parametrize("name", TIERS)
def test_first_eval_comes_after_real_training(name):
    bench = get(name)
    assert_first_eval_after_training(bench, bench.tier("tiny"))


@pytest.mark.parametrize("name", ["llama31_8b", "gpt_oss_20b"])
def test_untrained_model_misses_the_target(name, c4_prepared):
    bench = get(name)
    tier = bench.tier("tiny")
    dev = torch.device("cpu")
    tr = build_training(bench, tier, dev, 0)  # the benchmark's own init, no step taken
    data = bench.task.open(tier, bench.task.resolve(tier, c4_prepared), 0, 0, 1, dev)
    try:
        assert_misses_target(bench, tier, data.evaluate(tr.model))
    finally:
        data.close()
