"""Routers: which experts each token goes to, and with what weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """Linear `dim -> n_experts` (no bias) in fp32; top-k over the logits, then softmax over those k."""

    def __init__(self, dim: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # A bare Parameter, not nn.Linear: module-swapping tools (float8 training, TP plans) target nn.Linear,
        # and the router must stay a full-precision matmul (Megatron `moe_router_dtype: fp32`).
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[N, dim]` -> (probs `[N, k]` fp32 (fp64 for fp64 inputs), expert ids `[N, k]` int64)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        # Autocast would run the linear in bf16; near-tied logits would then pick different experts.
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
        top_logits, experts = logits.topk(self.top_k, dim=-1)
        # `moe_router_pre_softmax: false`: the k selected weights sum to 1; scaling factor 1.0.
        return top_logits.softmax(dim=-1), experts
