"""LR schedules: each framework's warmup off-by-one, checked value by value."""

import math

import pytest

from timetotrain.train.schedule import WarmupCosine

pytestmark = pytest.mark.parity


def test_nemo_warmup_is_s_plus_one_over_w_plus_one():
    s = WarmupCosine(base=4e-4, end=4e-5, warmup=16, total=1_200_000, rule="nemo")
    # First update (0 completed steps) already uses base/(W+1), not 0.
    assert s(0) == pytest.approx(4e-4 * 1 / 17, rel=1e-15)
    assert s(7) == pytest.approx(4e-4 * 8 / 17, rel=1e-15)
    assert s(15) == pytest.approx(4e-4 * 16 / 17, rel=1e-15)
    assert s(16) == pytest.approx(4e-4, rel=1e-15)  # s == W is still the warmup branch: base exactly


def test_nemo_cosine_phase_and_end():
    base, end, w, t = 1e-3, 1e-4, 10, 110
    s = WarmupCosine(base, end, w, t, "nemo")
    # Half-way through the decay window the cosine is at its midpoint.
    assert s(w + 50) == pytest.approx(end + (base - end) * 0.5, rel=1e-12)
    assert s(w + 1) == pytest.approx(end + (base - end) * 0.5 * (1 + math.cos(math.pi / 100)), rel=1e-12)
    assert s(t) == pytest.approx(end, rel=1e-12)
    assert s(t + 1) == end and s(10 * t) == end


def test_megatron_warmup_starts_at_zero():
    s = WarmupCosine(base=4e-4, end=4e-5, warmup=128, total=1_200_000, rule="megatron")
    assert s(0) == 0.0
    assert s(64) == pytest.approx(2e-4, rel=1e-15)
    assert s(128) == pytest.approx(4e-4, rel=1e-15)


def test_reference_schedule_is_nearly_constant_after_warmup():
    s = WarmupCosine(4e-4, 4e-5, 16, 1_200_000, "nemo")
    # Convergence happens within ~10k steps: the LR there is within 2e-4 relative of base.
    assert s(10_000) == pytest.approx(4e-4, rel=2e-4)
    assert s(10_000) < 4e-4


def test_no_warmup_and_bad_arguments():
    s = WarmupCosine(1.0, 0.0, 0, 100, "nemo")
    assert s(0) == 1.0
    with pytest.raises(ValueError):
        WarmupCosine(1.0, 0.1, 100, 100, "nemo")
    with pytest.raises(ValueError):
        WarmupCosine(1.0, 0.1, 1, 100, "torchtitan")


def test_hf_cosine_equals_transformers():
    """HF cosine (llama2_70b_lora): transformers' own get_cosine_schedule_with_warmup, step by step."""
    import torch
    from conftest import require

    from timetotrain.train.schedule import make

    transformers = require("transformers")
    for warmup, total in ((0, 1024), (10, 100)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=4e-4)
        hf = transformers.get_cosine_schedule_with_warmup(opt, warmup, total)
        ours = make("hf_cosine", 4e-4, 0.0, warmup, total)
        for step in range(total + 3):
            assert ours(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-18), (
                warmup,
                step,
            )
            opt.step()
            hf.step()


def test_warmup_constant_is_torchtitans_off_by_one():
    """torchtitan's linear warmup (flux1): (s + 1) / W for s < W, then the base LR for good."""
    from timetotrain.train.schedule import make

    s = make("warmup_constant", 2e-4, 2e-4, 4, 30_000)
    assert [s(i) for i in range(6)] == pytest.approx([0.5e-4, 1e-4, 1.5e-4, 2e-4, 2e-4, 2e-4])
    assert s(29_999) == 2e-4
    with pytest.raises(ValueError, match="unknown schedule rule"):
        make("linear", 1.0, 0.0, 0, 10)


# Steps where a schedule's off-by-ones show: the warmup edges, where the RCP runs converge (3,000-5,000),
# mid-decay, and the end of Primus' cosine at 1,200,000 - W.
def _probe_steps(w: int) -> list[int]:
    d = 1_200_000 - w
    return [0, 1, w - 1, w, w + 1, 1000, 3071, 4704, 12_345, 600_000, d - 1, d, d + 1, 1_200_000]


@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex:UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("gbs,lr,w", [(16, 4e-4, 128), (32, 8e-4, 128), (64, 1e-3, 192)])
def test_gpt_oss_reference_schedule_is_megatron_core_with_primus_decay(gbs, lr, w):
    """gpt_oss_20b's reference LR at each RCP batch size is bit for bit megatron-core's
    OptimizerParamScheduler configured as Primus configures it: lr_decay_iters = train_iters - warmup
    (config_*.sh: PRIMUS_LR_DECAY_ITERS=$((PRIMUS_TRAIN_ITERS-PRIMUS_LR_WARMUP_ITERS))), init_lr 0, and
    min_lr 4e-5 at every GBS. The logged decay steps are that same argument."""
    import torch
    from conftest import require

    from timetotrain.spec.benchmark import apply_overrides
    from timetotrain.spec.registry import get
    from timetotrain.train.schedule import for_tier

    core = require("megatron.core.optimizer_param_scheduler")
    bench = get("gpt_oss_20b")
    tier = apply_overrides(bench, bench.tier("reference"), [f"global_batch_size={gbs}"])
    assert (tier.lr, tier.warmup_steps, tier.end_lr) == (lr, w, 4e-5)
    assert dict(bench.hyperparameters(tier))["opt_learning_rate_decay_steps"] == 1_200_000 - w
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    megatron = core.OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=tier.lr, min_lr=tier.end_lr, lr_warmup_steps=w,
        lr_decay_steps=1_200_000 - w, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=1_200_000, wd_incr_style="constant",
    )  # fmt: skip
    ours = for_tier(bench.schedule, tier)
    for step in _probe_steps(w):
        megatron.num_steps = step  # what step() would have counted after `step` updates
        assert ours(step) == megatron.get_lr(opt.param_groups[0]), step
    # A cosine to max_steps (the rule before issue 16) misses where runs converge by ~1e-8 relative.
    megatron.num_steps = 4704
    assert WarmupCosine(tier.lr, tier.end_lr, w, 1_200_000, "megatron")(4704) != megatron.get_lr(
        opt.param_groups[0]
    )


# (samples_count, lr) of `train_loss` lines in the official gpt_oss_20b RCP log at GBS 64 (mlcommons/training,
# small_llm_moe_pretraining/primus/rcp_logs/gbs64/run_0.log): two in the warmup, five where runs converge.
GPT_OSS_RCP_LOG_LRS = {
    0: 5.208333333333333e-06,
    128: 1.5625e-05,
    274688: 0.0009999723177203208,
    274752: 0.0009999723042185464,
    275008: 0.000999972250178531,
    276480: 0.0009999719384263422,
    278016: 0.0009999716112631452,
}


def test_gpt_oss_reproduces_the_lrs_its_official_rcp_run_logged():
    """Primus logs, with each step's train_loss at samples_count s, the LR its Megatron scheduler holds after
    that step: num_steps = s / GBS + 1, the argument our schedule takes (see the megatron-core test above).
    Float equality: the decay over 1.2M - 2W steps (lr_decay_iters = 1.2M - W, ending at that iteration)
    gives these bits; a cosine over max_steps - W missed them by about 1e-8."""
    from timetotrain.spec.benchmark import apply_overrides
    from timetotrain.spec.registry import get
    from timetotrain.train.schedule import for_tier

    bench = get("gpt_oss_20b")
    tier = apply_overrides(bench, bench.tier("reference"), ["global_batch_size=64"])
    ours = for_tier(bench.schedule, tier)
    assert {s: ours(s // 64 + 1) for s in GPT_OSS_RCP_LOG_LRS} == GPT_OSS_RCP_LOG_LRS
    old = WarmupCosine(tier.lr, tier.end_lr, tier.warmup_steps, 1_200_000, "megatron")
    assert all(old(s // 64 + 1) != lr for s, lr in GPT_OSS_RCP_LOG_LRS.items() if s > 64 * 192)


def test_llama_and_tiny_schedules_still_end_at_max_steps():
    """NeMo's decay argument counts after the warmup, so llama31_8b still reaches its end LR at max_steps;
    gpt_oss_20b tiny keeps the cosine to max_steps its golden runs were recorded with."""
    from timetotrain.spec.registry import get
    from timetotrain.train.schedule import for_tier

    llama = get("llama31_8b")
    for name in ("reference", "tiny"):
        t = llama.tier(name)
        ours, old = for_tier("nemo", t), WarmupCosine(t.lr, t.end_lr, t.warmup_steps, t.max_steps, "nemo")
        steps = list(range(0, 2 * t.warmup_steps + 2)) + [t.max_steps // 2, t.max_steps - 1, t.max_steps]
        assert [ours(s) for s in steps] == [old(s) for s in steps]
        assert ours(t.max_steps - 1) > t.end_lr and ours(t.max_steps) == t.end_lr
    gpt = get("gpt_oss_20b")
    t = gpt.tier("tiny")
    ours, old = for_tier("megatron", t), WarmupCosine(3e-3, 3e-4, 20, 2000, "megatron")
    assert [ours(s) for s in range(2100)] == [old(s) for s in range(2100)]
    assert dict(gpt.hyperparameters(t))["opt_learning_rate_decay_steps"] == 2000


def test_megatron_warmup_must_end_before_the_decay_does():
    from timetotrain.errors import UserError
    from timetotrain.spec.benchmark import apply_overrides
    from timetotrain.spec.registry import get

    bench = get("gpt_oss_20b")
    apply_overrides(bench, bench.tier("reference"), ["warmup_steps=599999"])  # cosine over 599,999..600,001
    with pytest.raises(UserError, match="the cosine ends at step 600000"):
        apply_overrides(bench, bench.tier("reference"), ["warmup_steps=600000"])
