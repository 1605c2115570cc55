"""The MoE layer any MoE decoder reuses: route -> permute -> dispatch to the experts -> unpermute.

`dispatch` is the hook for expert parallelism: by default the experts of this process compute every
grouped copy; `train/expert_parallel.py` installs a dispatcher that moves the copies to the rank owning
their expert and back (the model itself knows nothing of process groups). A dispatcher is called as
`dispatcher(layer, grouped, grouped_probs, counts)` and returns the expert outputs in grouped order; it
also sets `layer.tokens_per_expert` (the global counts).
"""

from __future__ import annotations

import torch
from torch import nn

from timetotrain.models.common.moe.experts import GroupedExperts, permute, unpermute
from timetotrain.models.common.rows import by_rows


class MoE(nn.Module):
    """Dropless top-k MoE layer; `tokens_per_expert` holds the last forward's counts (on device, no sync).

    `shared`: an optional module every token also goes through (DeepSeek's shared expert), added to the
    routed output; it is replicated, never sharded over experts."""

    def __init__(
        self,
        router: nn.Module,
        n_experts: int,
        top_k: int,
        dim: int,
        ffn_dim: int,
        shared: nn.Module | None = None,
    ):
        super().__init__()
        self.shared = shared
        self.n_experts = n_experts
        self.top_k = top_k
        self.router = router
        self.experts = GroupedExperts(n_experts, dim, ffn_dim)
        # Telemetry for the training loop to read at eval time; not a checkpointed state.
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts, dtype=torch.long), persistent=False)
        self.dispatcher = None  # None: all experts are local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, experts = self.router(x, shape[:-1])
        grouped, grouped_probs, counts, order = permute(x, experts, probs, self.n_experts)
        if self.dispatcher is None:
            with torch.no_grad():
                self.tokens_per_expert.copy_(counts)
            y = self.experts(grouped, counts, grouped_probs)
        else:
            y = self.dispatcher(self, grouped, grouped_probs, counts)
        out = unpermute(y, order, self.top_k)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

    def init_weights(self, normal, std: float, residual_std: float) -> None:
        """Router and expert fc1 N(0, std); expert fc2 (writes into the residual stream) N(0, residual_std).
        The expert stacks an expert at a time (`by_rows`: a sharded build then draws one expert, not the
        stack)."""
        normal(self.router.weight, std)
        by_rows(normal, self.experts.w1, std)
        by_rows(normal, self.experts.w2, residual_std)
        if self.shared is not None:
            self.shared.init_weights(normal, std, residual_std)
        if hasattr(self.router, "reset_state"):  # routers with state (a balancing bias) start from zero
            self.router.reset_state()
        self.tokens_per_expert.zero_()
