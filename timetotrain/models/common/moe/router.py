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

    def forward(self, x: torch.Tensor, seq_shape=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[N, dim]` -> (probs `[N, k]` fp32 (fp64 for fp64 inputs), expert ids `[N, k]` int64).
        `seq_shape` (the `[B, T]` the N tokens came from) is unused here."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        # Autocast would run the linear in bf16; near-tied logits would then pick different experts.
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
        top_logits, experts = logits.topk(self.top_k, dim=-1)
        # `moe_router_pre_softmax: false`: the k selected weights sum to 1; scaling factor 1.0.
        return top_logits.softmax(dim=-1), experts


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's router: sigmoid scores, group-limited top-k, auxiliary-loss-free balancing.

    - scores `s = sigmoid(x W^T)` in fp32;
    - selection on `s + bias` only: the experts form `n_groups` equal groups, a group scores the sum of its
      top-2 biased scores, the best `topk_groups` groups stay eligible, and the top-k eligible experts win;
    - weights: the UNBIASED scores of the winners, normalised to sum 1, times `scaling`;
    - `bias` (HF `e_score_correction_bias`) is a buffer, never trained by autograd: after each optimizer step
      the harness calls `update_bias(load)` with the load summed over the global batch, and each expert's bias
      moves by `bias_rate` towards balance (down if above the mean load, up if below; DeepSeek-V3 §2.1.2);
    - in training, `load` accumulates the selections until `update_bias`, and `aux_loss` holds the
      sequence-level balance loss of the last forward (`sequence_aux_loss` over the plain top-k of the
      unbiased scores, as Megatron counts it; times `aux_coeff`), which the model adds to its training loss.
    """

    def __init__(
        self, dim: int, n_experts: int, top_k: int, n_groups: int, topk_groups: int, scaling: float,
        bias_rate: float = 1e-3, aux_coeff: float = 0.0,
    ):  # fmt: skip
        super().__init__()
        if n_experts % n_groups:
            raise ValueError(f"n_experts {n_experts} is not a multiple of n_groups {n_groups}")
        if not 1 <= topk_groups <= n_groups or top_k > topk_groups * (n_experts // n_groups):
            raise ValueError(f"top_k {top_k} does not fit in {topk_groups} of {n_groups} expert groups")
        self.n_experts, self.top_k = n_experts, top_k
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.scaling, self.bias_rate, self.aux_coeff = scaling, bias_rate, aux_coeff
        self.weight = nn.Parameter(torch.empty(n_experts, dim))  # bare: stays fp32, see TopKRouter
        self.register_buffer("bias", torch.zeros(n_experts))  # persistent: it is part of the checkpoint
        self.register_buffer("load", torch.zeros(n_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        # Set from outside under context parallelism (train/context_parallel.py): sums per-sequence counts
        # (no gradient) over the ranks that hold parts of each sequence; the aux loss is then this part's
        # share of the whole sequence's. None: each sequence is whole here.
        self.sequence_sum = None

    def forward(self, x: torch.Tensor, seq_shape=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[N, dim]` -> (weights `[N, k]` fp32, expert ids `[N, k]`); `seq_shape` `[B, T]` with
        `B * T == N` is needed for the sequence-level aux loss (training with `aux_coeff > 0`)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = F.linear(x.to(dtype), self.weight.to(dtype)).sigmoid()
        with torch.no_grad():  # selection is not differentiable; the bias must get no gradient
            experts = select_experts(scores + self.bias, self.top_k, self.n_groups, self.topk_groups)
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        self.aux_loss = None
        if self.training:
            # Under activation checkpointing the recomputed forward counts again: every load doubles, which
            # leaves sign(mean - load), all the update uses, unchanged.
            with torch.no_grad():
                self.load.scatter_add_(0, experts.reshape(-1), self.load.new_ones(experts.numel()))
            if self.aux_coeff > 0 and torch.is_grad_enabled():
                if seq_shape is None:
                    raise ValueError("the sequence-level aux loss needs the [B, T] shape of the tokens")
                # Megatron counts f_i from the plain top-k of the unbiased scores (no bias, no group limit;
                # `compute_routing_scores_for_aux_loss`), not from the routing decision itself.
                with torch.no_grad():
                    plain = scores.topk(self.top_k, dim=-1).indices
                aux = self.aux_coeff * sequence_aux_loss(
                    scores, plain, seq_shape, self.top_k, self.sequence_sum
                )
                # Inside a backward this forward is activation checkpointing's recomputation (computed all the
                # same: it must save what the first forward saved), whose aux loss nobody backpropagates: kept
                # on the module it would hold the recomputed block's graph until the next forward
                # (`ttt plan --simulate` found ~9.9 GiB per deepseekv3_671b layer).
                # Compiled, the forward is traced once and a checkpointed block recomputes inside the
                # compiled backward, never here (and asking autograd's state would break the graph).
                if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
                    self.aux_loss = aux
        return weights, experts

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """One balancing step from `load` `[E]` (selections over the global batch): bias += rate * sign(mean
        load - load). Resets the accumulated `load`."""
        self.bias.add_(torch.sign(load.mean() - load), alpha=self.bias_rate)
        self.load.zero_()

    def reset_state(self) -> None:
        with torch.no_grad():
            self.bias.zero_()
            self.load.zero_()
        self.aux_loss = None


def select_experts(biased: torch.Tensor, top_k: int, n_groups: int, topk_groups: int) -> torch.Tensor:
    """Group-limited top-k over `biased` `[N, E]` scores -> expert ids `[N, k]` (in descending score order)."""
    n, e = biased.shape
    grouped = biased.view(n, n_groups, e // n_groups)
    group_scores = grouped.topk(min(2, e // n_groups), dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, e)
    return masked.topk(top_k, dim=-1).indices


def sequence_aux_loss(
    scores: torch.Tensor, experts: torch.Tensor, seq_shape, top_k: int, sequence_sum=None
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the sequences (before the coefficient).

    Per sequence of T tokens: `sum_i f_i * P_i` with `f_i = E / (k T) * (tokens choosing expert i)` and `P_i`
    the mean over the T tokens of the scores normalised over all E experts, `s_i / sum_j s_j`. The
    selection counts carry no gradient; `P` carries the router's. Equals 1 for perfectly uniform routing.

    With `sequence_sum` (context parallelism: these are parts of the sequences) the counts, and T, are the
    whole sequences' and `P_i` sums this part's tokens only: the loss is linear in `P`, so the parts'
    results add up to the whole sequence's (Megatron reduces the counts over its TP x CP group the same
    way)."""
    b, t = (1, seq_shape[0]) if len(seq_shape) == 1 else seq_shape  # flat tokens: one sequence
    e = scores.shape[-1]
    probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    counts = torch.zeros(b, e, device=scores.device, dtype=scores.dtype)
    counts.scatter_add_(1, experts.view(b, t * top_k), counts.new_ones(b, t * top_k))
    if sequence_sum is None:
        p = probs.view(b, t, e).mean(dim=1)  # [B, E]
        f = counts * (e / (top_k * t))
    else:
        counts = sequence_sum(counts)
        whole = counts.sum(dim=-1, keepdim=True) / top_k  # every token makes k choices: T of the sequence
        p = probs.view(b, t, e).sum(dim=1) / whole
        f = counts * e / (top_k * whole)
    return (f * p).sum(dim=-1).mean()
