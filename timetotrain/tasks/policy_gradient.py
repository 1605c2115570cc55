"""GRPO's arithmetic, as the MLPerf reference (NeMo-RL at the commit mlcommons/training pins) computes it:
group-relative advantages and the token-level clipped policy-gradient loss with importance-sampling
correction. Sources, with lines: docs/benchmarks/qwen35_397b_grpo.md ("GRPO as the reference computes it").

Shapes: B = prompts x G rollouts, grouped contiguously (rows g*G .. g*G+G-1 answer prompt g); T the
completion's token positions (padded; `mask` 1 on real completion tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Sums a row statistic `[B]` over the parts of the sequences (context parallelism: each rank holds some
# positions of every row, train/context_parallel.py `SequenceParts.rows`); None: the rows are whole here.
Across = Callable[[torch.Tensor], torch.Tensor] | None

# The reference's constants (grpo_qwen35_397b_swe_openhands_async.yaml, advantage_estimator.py).
STD_EPS = 1e-6
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
TIS_MIN, TIS_MAX = 0.999, 1.002
LOGPROB_ERROR_THRESHOLD = 2.0


def group_advantages(
    rewards: torch.Tensor, group: int, leave_one_out: bool = True, normalize: bool = True
) -> torch.Tensor:
    """One advantage per rollout `[B]`: reward minus its baseline, divided by its std where that is > 0.

    With `leave_one_out` (the reference) a rollout's baseline is the mean reward of the other G-1 rollouts of
    its prompt and its std the unbiased std of those G-1 (utils.calculate_baseline_and_std_per_prompt);
    without, both are over all G. A zero std leaves the advantage undivided: a group whose rewards are all
    equal has advantage 0 everywhere, and a rollout whose G-1 others all agree gets r - baseline as is."""
    if rewards.dim() != 1 or rewards.numel() % group:
        raise ValueError(f"rewards {tuple(rewards.shape)} are not whole groups of {group}")
    r = rewards.double().view(-1, group)
    if group <= 1:  # the reference's "no valid responses" case: baseline = reward
        return torch.zeros_like(rewards)
    if leave_one_out:
        m = group - 1
        mean = (r.sum(1, keepdim=True) - r) / m
        mean_sq = ((r * r).sum(1, keepdim=True) - r * r) / m
    else:
        m = group
        mean = r.mean(1, keepdim=True).expand_as(r)
        mean_sq = (r * r).mean(1, keepdim=True).expand_as(r)
    with torch.no_grad():  # m/(m-1) is inf at m = 1, and 0 * inf is NaN: the reference maps it to 0
        std = ((mean_sq - mean * mean) * (m / (m - 1) if m > 1 else float("inf"))).sqrt().nan_to_num(0.0)
    adv = r - mean
    if normalize:
        adv = torch.where(std > 0, adv / (std + STD_EPS), adv)
    return adv.view(-1).to(rewards.dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None, norm=None, across: Across = None):
    """sum(values * mask) / (norm or sum(mask)) + 1e-8 in the denominator (the reference's masked_mean, whose
    `global_normalization_factor` is our `norm`); `across` (per row, `dim=-1`): both sums over the row's parts."""
    num, den = (values * mask).sum(dim=dim), mask.sum(dim=dim) if norm is None else norm
    if across is not None:
        num, den = across(num), across(den) if norm is None else den
    return num / (den + 1e-8)


def logprob_error_mask(
    gen_logp: torch.Tensor, prev_logp: torch.Tensor, mask: torch.Tensor, threshold: float | None,
    across: Across = None,
) -> torch.Tensor:  # fmt: skip
    """The sample mask `[B]` keeping a rollout only while its mean exp(|gen - prev|) over its tokens is at most
    `threshold` (grpo.compute_and_apply_seq_logprob_error_masking): a rollout the trainer scores very
    differently from the sampler is dropped from the update. None keeps all. `across`: the rows are in parts
    (`Across`), their sums are summed over them."""
    keep = torch.ones(mask.shape[0], dtype=mask.dtype, device=mask.device)
    if threshold is None:
        return keep
    den, num = mask.sum(-1), (torch.exp((gen_logp - prev_logp).abs() * mask) * mask).sum(-1)
    if across is not None:
        den, num = across(den), across(num)
    err = num / den.clamp(min=1)
    return torch.where((den > 0) & (err > threshold), torch.zeros_like(keep), keep)


@dataclass(frozen=True)
class LossConfig:
    force_on_policy: bool = True  # the reference: ratio fixed at 1 in value (one update per rollout)
    clip_low: float = CLIP_LOW
    clip_high: float = CLIP_HIGH
    tis_min: float | None = TIS_MIN  # seq-mask-tis bounds; None: no truncation
    tis_max: float | None = TIS_MAX
    importance_correction: bool = True


def policy_loss(
    logp: torch.Tensor,
    gen_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    sample_mask: torch.Tensor,
    global_tokens: float | torch.Tensor,
    old_logp: torch.Tensor | None = None,
    cfg: LossConfig = LossConfig(),
    across: Across = None,
) -> torch.Tensor:
    """The clipped policy-gradient loss (loss_functions.ClippedPGLossFn, no KL term), token level: the sum over
    this batch's valid tokens of w * max(-A r, -A clip(r, 1 - low, 1 + high)), divided by `global_tokens`,
    the valid tokens (mask x sample mask) of the whole global batch, so that micro-batches and ranks add up to
    the global token mean.

    `logp` `[B, T]` the trainer's log-probabilities of the completion tokens (with grad); `gen_logp` the
    sampler's; `old_logp` the policy the ratio is taken against (None with `force_on_policy`: logp.detach(),
    ratio 1 in value and the plain policy gradient). The importance weight w = exp(prev - gen), prev the
    ratio's denominator, corrects for sampler-trainer mismatch; under seq-mask-tis a rollout whose geometric
    mean w (over its tokens) is outside [tis_min, tis_max] gets w = 0.

    Under context parallelism (`across`, `Across`) the `[B, T]` tensors are this rank's positions of every
    row: the geometric mean's sums are summed over the row's parts, and the result is this rank's share of
    the loss (its tokens' sum over `global_tokens`), which the caller sums over the parts."""
    prev = logp.detach() if (cfg.force_on_policy or old_logp is None) else old_logp
    if cfg.force_on_policy:
        ratio = torch.exp(logp - logp.detach())
        clipped = ratio
    else:
        ratio = torch.exp(logp - prev)
        clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    adv = advantages.unsqueeze(-1)
    clip_loss = torch.maximum(-adv * ratio, -adv * clipped)
    full = mask * sample_mask.unsqueeze(-1)
    if cfg.importance_correction:
        log_w = torch.nan_to_num((prev - gen_logp).detach(), nan=0.0, posinf=0.0, neginf=0.0)
        w = torch.nan_to_num(torch.exp(log_w), nan=0.0, posinf=0.0, neginf=0.0)
        if cfg.tis_min is not None and cfg.tis_max is not None:
            geo = torch.exp(masked_mean(log_w, mask, dim=-1, across=across))
            keep = ((geo >= cfg.tis_min) & (geo <= cfg.tis_max)).to(w.dtype)
            w = w * keep.unsqueeze(-1)
    else:
        w = torch.ones_like(logp)
    return masked_mean(w * clip_loss, full, norm=global_tokens)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) at `tokens` (fp32): `logits` `[B, T, V]` predicting `tokens` `[B, T]`.
    The distribution the rollout engine reports its sampled tokens' log-probabilities from."""
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
