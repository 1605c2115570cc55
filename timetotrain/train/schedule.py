"""Learning-rate schedules with each reference framework's exact off-by-ones.

`step` is the number of optimizer steps already completed (0 for the first update). `make(rule, ...)`
returns a callable step -> lr. `decay_steps` is the framework's own decay argument, the value a run logs as
`opt_learning_rate_decay_steps` (max_steps - W unless a tier says otherwise); the rules read it as their
framework does:

- "nemo" (NeMo CosineAnnealing; llama31_8b, llama31_405b): s <= W: base * (s + 1) / (W + 1); then cosine
  from base to `end` over the `decay_steps` steps after W (ending at max_steps); `end` after that.
- "megatron" (Megatron OptimizerParamScheduler; gpt_oss_20b, deepseekv3_671b): s <= W: base * s / W, so the
  very first update uses lr 0; then the same cosine, but ending *at step* `decay_steps` (Megatron's
  `lr_decay_steps` counts from step 0, warmup included): Primus passes lr_decay_iters = max_steps - W,
  so the reference decays over max_steps - 2W steps and holds `end` for its last W.
- "hf_cosine" (transformers `get_cosine_schedule_with_warmup`; llama2_70b_lora): s < W: base * s / W; then
  base * 0.5 * (1 + cos(pi * (s - W) / (max_steps - W))), clamped at 0; `end` is 0 by construction.
- "warmup_constant" (torchtitan linear warmup, no decay; flux1): s < W: base * (s + 1) / W; then base.
- "warmup_from_zero" (the DLRMv4 reference's streaming loop, `_apply_lr_warmup` in its train/utils.py:
  base * min(1, s / W) set before each update; dlrmv4): s < W: base * s / W, so the first update uses lr
  0; then base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RULES = ("nemo", "megatron", "hf_cosine", "warmup_constant", "warmup_from_zero")


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup to `base` at step `warmup`, then cosine decay to `end` at step `total`, constant after
    (NeMo, Megatron; `make` turns each framework's decay argument into `total`)."""

    base: float
    end: float
    warmup: int
    total: int
    rule: str = "nemo"

    def __post_init__(self):
        if self.rule not in ("nemo", "megatron"):
            raise ValueError(f"unknown warmup rule {self.rule!r}")
        if not 0 <= self.warmup < self.total:
            raise ValueError(f"warmup {self.warmup} must be in [0, total={self.total})")

    def __call__(self, step: int) -> float:
        w = self.warmup
        if w > 0 and step <= w:
            if self.rule == "nemo":
                return self.base * (step + 1) / (w + 1)
            return self.base * step / w
        if step > self.total:
            return self.end
        frac = (step - w) / (self.total - w)
        return self.end + (self.base - self.end) * 0.5 * (1.0 + math.cos(math.pi * frac))


@dataclass(frozen=True)
class HFCosine:
    base: float
    warmup: int
    total: int

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.base * step / max(1, self.warmup)
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return self.base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class WarmupConstant:
    base: float
    warmup: int
    from_zero: bool = (
        False  # "warmup_from_zero": the ramp's first update at lr 0, one step behind torchtitan's
    )

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            if self.from_zero:  # the reference's order of operations: base * min(1, step / W)
                return self.base * (step / self.warmup)
            return self.base * (step + 1) / self.warmup
        return self.base


def make(rule: str, base: float, end: float, warmup: int, total: int, decay_steps: int | None = None):
    """The schedule of `rule` (see the module docstring) as a callable step -> lr; `total` is max_steps,
    `decay_steps` the framework's decay argument (default total - warmup)."""
    if decay_steps is None:
        decay_steps = total - warmup
    if rule == "nemo":
        return WarmupCosine(base, end, warmup, warmup + decay_steps, rule)
    if rule == "megatron":
        return WarmupCosine(base, end, warmup, decay_steps, rule)
    if rule == "hf_cosine":
        return HFCosine(base, warmup, total)
    if rule in ("warmup_constant", "warmup_from_zero"):
        return WarmupConstant(base, warmup, from_zero=rule == "warmup_from_zero")
    raise ValueError(f"unknown schedule rule {rule!r}: choose one of {', '.join(RULES)}")


def for_tier(rule: str, tier):
    """The schedule a run of `tier` follows (train/step.py), from the values its log records."""
    return make(rule, tier.lr, tier.end_lr, tier.warmup_steps, tier.max_steps, tier.decay_steps)
