"""Tensor parallelism's harness side (`--parallel tp=T[,fsdp=F]`). A family's own plan (`ModelFamily.
tensor_parallel`, e.g. models/llama/parallelize.py) parallelises its modules with PyTorch's DTensor
`parallelize_module`; `train/parallel.apply` builds the (fsdp, tp) mesh and calls it. What the harness needs
whatever the plan, is here:

Stacked layouts. A column-wise cut of a fused weight holding two sub-tensors along dim 0 (SwiGLU's `fc1`:
all gate rows, then all up rows) would give one rank only gates. A plan therefore lets such a DTensor stand
for the rows reordered as [gate_0, up_0, gate_1, up_1, ...] (rank r's slices side by side) and says so by
setting `TP_STACKED_OVER` (models/family.py) on the module to the TP degree; `mark_stacked` turns that into
`STACKED` on the parameter, again after anything that replaces the parameter objects. `logical(full, param)`
reorders a full tensor of the model's layout into that order, so initialisation and checkpoint loading
(train/shards.py) fill the right rows. A gathered `full_tensor()` is in the reordered layout (`unstack`
reverses it). Sub-tensors of unequal sizes (qwen3_5_moe's fused [q+gate | k | v] attention input, the
DeltaNet's [q | k | v | z | b | a] input projection and [q | k | v] convolution) are named by their row
counts instead of their number: the plan also sets `TP_STACKED_PARTS` on the module, {parameter name:
rows of each sub-tensor}, and each rank's slices are the r-th T-th of every sub-tensor, side by side.

Partial gradients. A replicated parameter that computes on sequence-cut or feature-cut inputs (the norms under
sequence parallelism, a row-parallel layer's LoRA `B`, models/common/lora_parallel.py) gets a `Partial()`
DTensor gradient: each rank holds its part of the sum. FSDP2 reduces those itself before it shards; without
it `replicate_partial_grads` does, once per step, before clipping reads the norm (a norm of the partial
parts is not the norm of their sum) and the optimizer (which would all-reduce them again in every op).

Gradient clipping needs the norm over distinct elements: `clip_grad_norm_tp` sums each rank's local
squares weighted by how many ranks hold the same values, then one all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from timetotrain.models.family import TP_STACKED_OVER, TP_STACKED_PARTS
from timetotrain.train.expert_parallel import expert_slice

# Parameter attribute: (the sub-tensors stacked along dim 0: their number if equal, else a tuple of their
# rows; TP degree).
STACKED = "_ttt_tp_stacked"


def _parts(full: torch.Tensor, parts) -> tuple[torch.Tensor, ...]:
    """`full` cut into its stacked sub-tensors (`parts`: their number, or their rows)."""
    return full.chunk(parts, dim=0) if isinstance(parts, int) else full.split(list(parts), dim=0)


def logical(full: torch.Tensor, param) -> torch.Tensor:
    """`full` (the model's layout) reordered as the DTensor `param` stands for it (module docstring)."""
    stacked = getattr(param, STACKED, None)
    if stacked is None:
        return full
    parts, tp = stacked
    pieces = [sub.chunk(tp, dim=0) for sub in _parts(full, parts)]
    return torch.cat([piece[r] for r in range(tp) for piece in pieces], dim=0)


def unstack(full: torch.Tensor, param) -> torch.Tensor:
    """The inverse of `logical`: a gathered `full_tensor()` back in the model's layout."""
    stacked = getattr(param, STACKED, None)
    if stacked is None:
        return full
    return unstack_rows(full, *stacked)


def stacked_layouts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{parameter name: (sub-tensors, TP degree)} of the stacked parameters of `model` (module docstring)."""
    return {n: tuple(getattr(p, STACKED)) for n, p in model.named_parameters() if hasattr(p, STACKED)}


def unstack_rows(full: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """`unstack` of a tensor whose rows were stacked as `parts` sub-tensors over `tp` ranks."""
    local = parts if isinstance(parts, int) else [rows // tp for rows in parts]
    per_rank = [_parts(r, local) for r in full.chunk(tp, dim=0)]
    return torch.cat([per_rank[r][p] for p in range(len(per_rank[0])) for r in range(tp)], dim=0)


@torch.no_grad()
def replicate_partial_grads(params) -> None:
    """Sum every `Partial()` gradient over its mesh dimension, in place of the parameter's gradient (module
    docstring): one all-reduce per such parameter, after the backward of the last micro-batch."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=p.placements)


@torch.no_grad()
def clip_grad_norm_tp(params, max_norm: float, world: int) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over parameters sharded and replicated over all `world` ranks in
    any mix (TP and FSDP DTensors, plain tensors every rank holds whole, expert slices each held by world /
    ep ranks): each local square sum counts once per distinct copy (divided by the number of ranks holding
    it), one all-reduce gives the total."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            shards = 1
            for i, placement in enumerate(g.placements):
                # Shard or FSDP's _StridedShard over a TP shard (whose is_shard() is False).
                if not (placement.is_replicate() or placement.is_partial()):
                    shards *= g.device_mesh.size(i)
            local = g.to_local()
            # (an expert slice FSDP2 shards over its replicas: 1 / ep of the experts, cut over its mesh)
            total += local.float().pow(2).sum() * (shards / world) / _held_by(p)
        else:
            total += g.float().pow(2).sum() / (world * _held_by(p))
    dist.all_reduce(total)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm


def _held_by(p: torch.Tensor) -> float:
    """The share of the model's copy of `p` that `p` holds: 1, or 1 / ep for an expert slice (`tp=T,ep=E`:
    each slice of 1 / ep of the experts sits on world / ep ranks, its TP ranks and replicas; a slice FSDP2
    shards over its replicas, `pp=P,ep=E,fsdp=N`, is cut further by its DTensor placement)."""
    part = expert_slice(p)
    return 1.0 if part is None else p.shape[0] / part[0]


def mark_stacked(model: nn.Module) -> None:
    """Mark every stacked parameter (a block's `fc1` weight: gate, up; the modules' `TP_STACKED_PARTS`) as
    stacked over the TP ranks; again after anything that replaces the parameter objects (FSDP2's sharding,
    `to_empty`)."""
    for module in model.modules():
        tp = getattr(module, TP_STACKED_OVER, None)
        if tp is not None:
            for name, parts in getattr(module, TP_STACKED_PARTS, {"weight": 2}).items():
                setattr(
                    getattr(module, name), STACKED, (parts if isinstance(parts, int) else tuple(parts), tp)
                )
