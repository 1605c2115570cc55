"""After the STU stack: the timestamp layer-norm postprocessor of each candidate's user embedding
(modules/postprocessors.py:105-182), the item MLP (modules/dlrm_hstu.py:278-289), the prediction head of the
one task and its loss (modules/multitask_module.py: DefaultMultitaskModule, _compute_loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (seconds per unit, units per period): hour of day, day of week (modules/dlrm_hstu.py:228-232).
TIME_FEATURES = ((60 * 60, 24), (24 * 60 * 60, 7))
TWO_PI = 2 * 3.14  # the reference's constant, not math.tau (postprocessors.py _concat_time_features)


class TimestampLayerNorm(nn.Module):
    """LayerNorm(Linear([x, cos/sin of the hour of day and the day of week])), eps 1e-5."""

    def __init__(self, dim: int):
        super().__init__()
        self.combiner = nn.Linear(dim + 2 * len(TIME_FEATURES), dim)
        self.norm = nn.LayerNorm(dim, eps=1e-5)
        self.register_buffer(
            "period_units", torch.tensor([[float(a) for a, _ in TIME_FEATURES]]), persistent=False
        )
        self.register_buffer(
            "units_per_period", torch.tensor([[float(b) for _, b in TIME_FEATURES]]), persistent=False
        )

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The combiner xavier_normal_ (HSTUTransducer re-draws it, hstu_transducer.py:82-91) with zero bias,
        the norm at ones and zeros; the buffers refilled (a meta build's to_empty leaves them unset)."""
        self.period_units.copy_(torch.tensor([[float(a) for a, _ in TIME_FEATURES]]))
        self.units_per_period.copy_(torch.tensor([[float(b) for _, b in TIME_FEATURES]]))
        nn.init.xavier_normal_(self.combiner.weight, generator=generator)
        self.combiner.bias.zero_()
        self.norm.weight.fill_(1.0)
        self.norm.bias.zero_()

    def time_features(self, timestamps: torch.Tensor) -> torch.Tensor:
        """[T] seconds -> [T, 2 * features]: cos and sin of each, interleaved (torch.polar's real view), in
        fp32 whatever the model's dtype (the reference's comment: bf16 would break floor/remainder)."""
        units = torch.div(timestamps.unsqueeze(-1).float(), self.period_units, rounding_mode="floor")
        angle = torch.remainder(units, self.units_per_period) / self.units_per_period * TWO_PI
        return torch.view_as_real(torch.polar(torch.ones_like(angle), angle)).flatten(-2, -1)

    def forward(self, x: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        feats = self.time_features(timestamps).to(x.dtype)
        y = self.combiner(torch.cat([x, feats], dim=-1).to(self.combiner.weight.dtype))
        return self.norm(y)


def masked_bce(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """sum(w * BCE) / max(sum(w), 1) * scale, in fp32 (_compute_loss; w is all ones for dlrmv4, the dataset
    giving no supervision weights, and scale is causal_multitask_weights = 0.2)."""
    logits, labels = logits.float(), labels.float()
    w = torch.ones_like(labels) if weights is None else weights.float()
    loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="none") * w
    return loss.sum() / w.sum().clamp(min=1.0) * scale
