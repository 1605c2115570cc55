"""Every tiny tier needs training: its first evaluation comes after real steps, and the model it starts from
misses the target by the margin `untrained.py` states. The from-scratch language-model tiers are evaluated
here, freshly built, and the four tiers that start from a shipped base (llama2_70b_lora, deepseekv3_671b,
llama31_405b, qwen35_397b_grpo) from that base, each on the tier's own eval set; flux1 and rgat in their
end-to-end tests (where their data is prepared)."""

import pytest
import torch
from conftest import require_file, shared_data_dir
from untrained import assert_first_eval_after_training, assert_misses_target

from timetotrain.data import c4, govreport
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


# Known gap (issue 29, measured 2026-12-01, docs/benchmarks/llama2_70b_lora.md "Tiny tier"): fine-tuning on
# the fixture's ten reports gains 0.02-0.035 nats on the held-out summaries (5.2976 untrained), while the
# margin asks for 0.26; no LR, base or data layout tried gets near it (more training text, 61 or 112 blocks of
# the same 10 reports, gains as little; full fine-tuning would gain 0.29, the head alone 0.19, neither the
# reference's recipe: bench/lora_tiny_gain.py; a rank-16 LoRA adapter on the head as well gains 0.16-0.17,
# still short of the margin; wider bases, bench/lora_base_width.py, gain 0.040 at width 256 and 0.060 at 384;
# training every attention weight instead of adapters gains 0.033, so no adapter on qkv + o can reach it).
# The shipped base makes the untrained score the same
# on every CPU (AVX2 and AVX-512 kernels agree to 2.4e-7), which was the margin's first reason. Strict: the
# day the tier is re-tuned to meet the margin, this turns into a failure to remove the mark.
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="LoRA tiny's gain on held-out summaries is ~0.03, the margin 0.26",
)
def test_the_shipped_lora_base_misses_the_target(tmp_path):
    tok = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")
    src = require_file(shared_data_dir() / "govreport" / "gov_report.validation.scrolls_format.jsonl")
    govreport.prepare_tiny(src, tok, tmp_path)
    bench = get("llama2_70b_lora")
    assert_misses_target(bench, bench.tier("tiny"), starting_eval(bench, bench.tier("tiny"), tmp_path))


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
