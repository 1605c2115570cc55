"""LR schedules: each framework's warmup off-by-one, checked value by value."""

import math

import pytest

from timetotrain.train.schedule import WarmupCosine


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
