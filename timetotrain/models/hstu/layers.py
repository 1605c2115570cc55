"""The reference's small MLP blocks (ops/layer_norm.py:238-330 LayerNorm and SwishLayerNorm, computed in fp32
as ops/pytorch/pt_layer_norm.py does): Linear -> SwishLayerNorm -> Linear -> [LayerNorm]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """LayerNorm in fp32 whatever the input's dtype (pt_layer_norm.py pytorch_layer_norm), eps 1e-5."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normed(x).to(x.dtype)


class SwishLayerNorm(LayerNorm):
    """x * sigmoid(LayerNorm(x)), in fp32 (pt_layer_norm.py pytorch_swish_layer_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * torch.sigmoid(self.normed(x))).to(x.dtype)


def swish_mlp(d_in: int, hidden: int, d_out: int, norm_out: bool) -> nn.Sequential:
    """Linear(d_in, hidden) -> SwishLayerNorm(hidden) -> Linear(hidden, d_out) [-> LayerNorm(d_out)]."""
    mods: list[nn.Module] = [nn.Linear(d_in, hidden), SwishLayerNorm(hidden), nn.Linear(hidden, d_out)]
    if norm_out:
        mods.append(LayerNorm(d_out))
    return nn.Sequential(*mods)


@torch.no_grad()
def reset_mlp(seq: nn.Sequential, weight_init, generator: torch.Generator | None) -> None:
    """Linears: `weight_init` (xavier_uniform_ or xavier_normal_), zero bias; norms: ones and zeros."""
    for m in seq:
        if isinstance(m, nn.Linear):
            weight_init(m.weight, generator=generator)
            m.bias.zero_()
        elif isinstance(m, (LayerNorm, nn.LayerNorm)):
            m.weight.fill_(1.0)
            m.bias.zero_()
