"""GRPO's advantages and loss (timetotrain/tasks/policy_gradient.py) against computations by hand on a batch of
2 prompts x 4 generations, in the reference's conventions (docs/benchmarks/qwen35_397b_grpo.md): leave-one-out
baseline and std, zero std left undivided, forced on-policy ratio or the clipped ratio, seq-mask-tis,
token-level mean over the global batch's valid tokens."""

import math

import pytest
import torch

from timetotrain.tasks.policy_gradient import (
    STD_EPS,
    LossConfig,
    group_advantages,
    logprob_error_mask,
    policy_loss,
)

S = math.sqrt(1 / 3)  # the unbiased std of three rewards of which one differs: [1, 0, 0] or [0, 1, 1]


def test_leave_one_out_advantages_by_hand():
    # Prompt A: one success of four. Rollout 0's others are [0, 0, 0] (std 0): 1 - 0, undivided. Rollouts 1-3
    # see [1, 0, 0]: baseline 1/3, std sqrt(1/3). Prompt B: three of four; rollout 0 sees [1, 1, 1] (std 0):
    # 0 - 1 undivided; rollouts 1-3 see [0, 1, 1]: baseline 2/3, std sqrt(1/3).
    rewards = torch.tensor([1.0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.float64)
    want = [1.0] + [-(1 / 3) / (S + STD_EPS)] * 3 + [-1.0] + [(1 / 3) / (S + STD_EPS)] * 3
    assert group_advantages(rewards, 4).tolist() == pytest.approx(want, abs=1e-12)


def test_a_group_of_equal_rewards_has_no_advantage():
    for value in (0.0, 1.0):
        assert group_advantages(torch.full((8,), value), 4).tolist() == [0.0] * 8


def test_without_leave_one_out_the_group_mean_and_unbiased_std():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0], dtype=torch.float64)
    s_a, s_b = math.sqrt((1 / 4 - 1 / 16) * 4 / 3), math.sqrt((1 / 2 - 1 / 4) * 4 / 3)
    want = [(1 - 1 / 4) / (s_a + STD_EPS)] + [(-1 / 4) / (s_a + STD_EPS)] * 3
    want += [(1 / 2) / (s_b + STD_EPS)] * 2 + [(-1 / 2) / (s_b + STD_EPS)] * 2
    assert group_advantages(rewards, 4, leave_one_out=False).tolist() == pytest.approx(want, abs=1e-12)
    assert group_advantages(rewards, 4, normalize=False, leave_one_out=False).tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    )


def _batch():
    """8 rollouts of lengths 1..4 tokens (then padding), one advantage each."""
    lengths = [1, 2, 3, 4, 4, 3, 2, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths])
    adv = torch.tensor([1.0, -0.5, -0.5, -0.5, -1.0, 0.5, 0.5, 0.5])
    logp = torch.linspace(-2.0, -0.1, 32).view(8, 4).clone().requires_grad_(True)
    return lengths, mask, adv, logp


def test_forced_on_policy_loss_and_gradient_by_hand():
    """Ratio 1 in value: the loss is -sum_i A_i n_i / N over the N = 20 valid tokens, and d loss / d logp_it =
    -A_i / N on valid tokens, 0 on padding; sampler = trainer, so every importance weight is 1."""
    lengths, mask, adv, logp = _batch()
    n = sum(lengths)
    loss = policy_loss(logp, logp.detach().clone(), adv, mask, torch.ones(8), n)
    assert loss.item() == pytest.approx(-sum(a * k for a, k in zip(adv.tolist(), lengths, strict=True)) / n)
    loss.backward()
    want = [[-a / n if t < k else 0.0 for t in range(4)] for a, k in zip(adv.tolist(), lengths, strict=True)]
    assert logp.grad.view(-1).tolist() == pytest.approx(sum(want, []), abs=1e-7)


def test_the_global_token_count_makes_micro_batches_add_up():
    lengths, mask, adv, logp = _batch()
    gen = logp.detach().clone()
    whole = policy_loss(logp, gen, adv, mask, torch.ones(8), 20)
    halves = sum(
        policy_loss(logp[i : i + 4], gen[i : i + 4], adv[i : i + 4], mask[i : i + 4], torch.ones(4), 20)
        for i in (0, 4)
    )
    assert halves.item() == pytest.approx(whole.item())


def test_clipped_ratio_by_hand():
    """Against an old policy: each rollout has one token. A > 0, r = 1.5: the clip 1.28 wins (no gradient).
    A < 0, r = 0.5: -A * 0.8 wins (no gradient). A < 0, r = 1.5: -A * 1.5 wins (gradient -A r / N).
    A > 0, r = 1.1 (inside): -A * 1.1 (gradient -A r / N)."""
    old = torch.zeros(4, 1)
    r = torch.tensor([[1.5], [0.5], [1.5], [1.1]])
    logp = r.log().clone().requires_grad_(True)
    adv = torch.tensor([2.0, -1.0, -1.0, 3.0])
    cfg = LossConfig(force_on_policy=False)
    loss = policy_loss(logp, old, adv, torch.ones(4, 1), torch.ones(4), 4, old_logp=old, cfg=cfg)
    terms = [-2.0 * 1.28, 1.0 * 0.8, 1.0 * 1.5, -3.0 * 1.1]
    assert loss.item() == pytest.approx(sum(terms) / 4)
    loss.backward()
    # d(-A r)/d logp = -A r (r = exp(logp - old)).
    assert logp.grad.view(-1).tolist() == pytest.approx([0.0, 0.0, 1.0 * 1.5 / 4, -3.0 * 1.1 / 4])


def test_seq_mask_tis_drops_a_mismatched_rollout():
    """Rollout 0's sampler log-probabilities are 0.01 above the trainer's: its geometric-mean weight
    exp(-0.01) = 0.990 is under 0.999, so it weighs 0; the rest keep weight 1. The token count stays 20."""
    lengths, mask, adv, logp = _batch()
    gen = logp.detach().clone()
    gen[0] += 0.01
    loss = policy_loss(logp, gen, adv, mask, torch.ones(8), 20)
    kept = sum(a * k for a, k in zip(adv.tolist()[1:], lengths[1:], strict=True))
    assert loss.item() == pytest.approx(-kept / 20)
    # Inside the bounds, the weight is the raw token ratio exp(prev - gen) (not truncated to 1).
    gen = logp.detach().clone()
    gen[0] -= 0.001
    loss = policy_loss(logp, gen, adv, mask, torch.ones(8), 20)
    kept += adv[0].item() * math.exp(0.001)
    assert loss.item() == pytest.approx(-kept / 20)


def test_the_sample_mask_removes_a_rollout_from_the_sum_only():
    lengths, mask, adv, logp = _batch()
    sample = torch.ones(8)
    sample[3] = 0
    loss = policy_loss(logp, logp.detach().clone(), adv, mask, sample, 16)
    kept = [a * k for i, (a, k) in enumerate(zip(adv.tolist(), lengths, strict=True)) if i != 3]
    assert loss.item() == pytest.approx(-sum(kept) / 16)


def test_logprob_error_mask():
    """Mean exp(|gen - prev|) over a rollout's tokens: 1 when they agree; exp(1) = 2.718 > 2 drops it."""
    prev = torch.zeros(3, 2)
    gen = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])  # errors: 1, e, (e + 1) / 2 = 1.86
    mask = torch.ones(3, 2)
    assert logprob_error_mask(gen, prev, mask, 2.0).tolist() == [1.0, 0.0, 1.0]
    assert logprob_error_mask(gen, prev, mask, None).tolist() == [1.0, 1.0, 1.0]
