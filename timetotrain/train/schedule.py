"""Learning-rate schedules with each reference framework's exact off-by-ones (spec §14.4).

`step` is the number of optimizer steps already completed (0 for the first update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup then cosine decay from `base` to `end` at `total` steps, constant after.

    warmup rules:
      - "nemo" (NeMo CosineAnnealing, llama31_8b/405b): s <= W: base * (s + 1) / (W + 1); the decay
        phase is measured from W over (total - W) steps.
      - "megatron" (OptimizerParamScheduler, gpt_oss_20b/deepseek): s <= W: base * s / W, so the very
        first update uses lr 0; decay over (total - W) steps.
    """

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
