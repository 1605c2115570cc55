"""Every tiny tier needs training: its first evaluation comes after real steps, and the model it starts from
misses the target by the margin `untrained.py` states. The from-scratch language-model tiers are evaluated
here, freshly built, and the three tiers that continue a shipped base (deepseekv3_671b, llama31_405b,
qwen35_397b_grpo) from that base, each on the tier's own eval set; flux1 and rgat in their end-to-end tests
(where their data is prepared). The tier that fine-tunes a shipped base (llama2_70b_lora) is held to the
fine-tuning rule instead."""

import pytest
import torch
from conftest import require_file, shared_data_dir
from untrained import (
    assert_first_eval_after_training,
    assert_misses_target,
    fine_tunes_shipped_base,
    needs_real_steps,
)

from timetotrain.cli import main
from timetotrain.data import c4
from timetotrain.errors import UserError
from timetotrain.spec import registry
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.train.base_model import shipped_base
from timetotrain.train.step import build_training

# Every tier of ours (every tier but the reference), of every registered benchmark.
OURS = [(n, t) for n in registry.names() for t in registry.get(n).tiers if t != "reference"]


@pytest.mark.parametrize("name,tier", OURS, ids=[f"{n}-{t}" for n, t in OURS])
def test_first_eval_comes_after_real_training(name, tier):
    bench = get(name)
    assert_first_eval_after_training(bench, bench.tier(tier))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama31_8b", "gpt_oss_20b"])
def test_untrained_model_misses_the_target(name, c4_prepared):
    bench = get(name)
    tier = bench.tier("tiny")
    dev = torch.device("cpu")
    tr = build_training(bench, tier, dev, 0)  # the benchmark's own init, no step taken
    data = bench.task.open(
        tier, bench.task.resolve(tier, c4_prepared), 0, Share.of(tier.global_batch_size), dev
    )
    try:
        assert_misses_target(bench, tier, data.evaluate(tr.model))
    finally:
        data.close()


def starting_eval(bench, tier, data_dir) -> float:
    """The tier's eval metric on the model its runs start from, before any step: the shipped base (LoRA's
    adapters start at B = 0 and add nothing), cut or mapped to the tier's vocabulary as a run does."""
    dev = torch.device("cpu")
    base = shipped_base(tier.base)
    tr = build_training(bench, tier, dev, 0, None, base)
    data = bench.task.open(
        tier,
        bench.task.resolve(tier, data_dir, init_checkpoint=base),
        0,
        Share.of(tier.global_batch_size),
        dev,
    )
    try:
        return data.evaluate(tr.model)
    finally:
        data.close()


# The tiers that fine-tune a shipped base: held to the fine-tuning rule (tests/untrained.py) instead of the
# margin, which LoRA's small gain on held-out summaries cannot meet (0.02-0.035 nats where the margin asks
# 0.26; docs/benchmarks/llama2_70b_lora.md, "Tiny tier").
FINE_TUNING = [(n, t) for n, t in OURS if fine_tunes_shipped_base(get(n), get(n).tier(t))]


def test_the_fine_tuning_tiers_are_the_lora_tier():
    """What `fine_tunes_shipped_base` picks: the LoRA tier; the other shipped bases train whole models and
    meet the margin (below)."""
    assert FINE_TUNING == [("llama2_70b_lora", "tiny")]


@pytest.mark.slow
@pytest.mark.parametrize("name,tier", FINE_TUNING, ids=[f"{n}-{t}" for n, t in FINE_TUNING])
def test_a_fine_tuning_tier_needs_real_steps(name, tier, tmp_path):
    """The fine-tuning rule (tests/untrained.py): a start the same on every seed and host, a target beyond
    the first eval's spread over seeds, and out of reach at LR 0 and 1e-12. The tier's data as `ttt data
    prepare --for` makes it from the shared sources."""
    src = shared_data_dir()
    bench = get(name)
    t = bench.tier(tier)
    try:
        bench.task.data_recipe(t, src)
    except UserError as e:  # a source missing from the shared data: skipped here, failed under CI=true
        require_file(src / f"(a source of {name} {tier}: {e})")
    assert (
        main(["data", "prepare", "--for", name, "--tier", tier, "--src", str(src), "--out", str(tmp_path)])
        == 0
    )
    resolved = bench.task.resolve(t, tmp_path, init_checkpoint=shipped_base(t.base))
    needs_real_steps(bench, t, resolved)


def test_the_shipped_deepseek_base_misses_the_target(c4_prepared):
    """The shipped base scores 5.3478 on the tier's 32 windows; the target 5.09 was set 5% under it
    (docs/benchmarks/deepseekv3_671b.md, "Tiny tier")."""
    bench = get("deepseekv3_671b")
    assert_misses_target(bench, bench.tier("tiny"), starting_eval(bench, bench.tier("tiny"), c4_prepared))


def test_the_shipped_405b_base_misses_the_target_on_mixtral_ids(c4_src, tmp_path):
    tok = require_file(shared_data_dir() / "tokenizers" / "mixtral-8x22b" / "tokenizer.model")
    for split in ("train", "validation"):
        c4.prepare(c4_src, split, "mixtral", tmp_path, workers=2, tokenizer_model=tok)
    bench = get("llama31_405b")
    assert_misses_target(bench, bench.tier("tiny"), starting_eval(bench, bench.tier("tiny"), tmp_path))


def test_the_shipped_grpo_base_misses_the_target(tmp_path):
    """pass@4 of the shipped base on the tier's 256 validation problems (written by the tier's data recipe,
    as `ttt data prepare --for qwen35_397b_grpo` does): rewarded from the first rollouts, and short of the
    target (higher is better) by the margin."""
    bench = get("qwen35_397b_grpo")
    tier = bench.tier("tiny")
    bench.task.data_recipe(tier, tmp_path).call(tmp_path)
    start = starting_eval(bench, tier, tmp_path)
    assert start > 0.1
    assert_misses_target(bench, tier, start)
