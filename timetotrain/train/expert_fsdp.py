"""Which dimension FSDP2 cuts an MoE model's stacked expert weights on (`GroupedExperts.w1` `[E, 2*ffn, dim]`,
`w2` `[E, dim, ffn]`), so that no rank holds a padded shard.

FSDP2 cuts every parameter on dim 0 by default, as `torch.chunk` does, and pads the short or empty shards
to the longest for its all-gathers. For a stacked expert weight under FSDP2 over more ranks than experts
(`fsdp=N`, hsdp, tp or cp with fsdp, no `ep` to split the experts first) each rank then holds one expert or
none, and every all-gather and reduce-scatter runs over shards padded to one expert each: simulated,
qwen35_397b_grpo's 512 experts under `fsdp=128,cp=8` on 1,024 ranks peaked at 139.9 GiB against the plan's
58.8, which counts 1/1,024 of the stack a rank (docs/scale.md). Cutting the first dimension that divides evenly over the ranks
(dim 0 where the experts do, else the FFN rows, else the model width) gives every rank exactly 1/N of the
stack; torchtitan makes the same choice for its expert FSDP, and `expert_parallel.shard_expert_replicas`
for the slices under `ep=E,fsdp=N`. The experts compute on the gathered, whole stack, so the cut changes
no result; checkpoints (DCP), the loaders' `shards.local_shard` and gradient clipping read any `Shard(d)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import Shard

from timetotrain.models.common.moe.experts import GroupedExperts


def even_dim(shape: tuple[int, ...] | torch.Size, ranks: int) -> int | None:
    """The first dimension of `shape` that splits evenly over `ranks`, None where none does (FSDP2 then
    pads dim 0, its default)."""
    return next((d for d, n in enumerate(shape) if n % ranks == 0), None)


def pads(n_experts: int, dim: int, ffn_dim: int, ranks: int) -> bool:
    """Whether FSDP2 over `ranks` ranks still pads a model's stacked expert weights (`GroupedExperts` of
    `n_experts` x `dim` x `ffn_dim`): more ranks than experts, and a stack no dimension of which splits evenly
    (each rank then holds one expert or none: `train/memory.padded_experts`)."""
    stacks = ((n_experts, 2 * ffn_dim, dim), (n_experts, dim, ffn_dim))  # w1, w2
    return ranks > n_experts and any(even_dim(shape, ranks) is None for shape in stacks)


def expert_placements(model: nn.Module, ranks: int) -> Callable[[nn.Parameter], Shard | None] | None:
    """A `fully_shard` `shard_placement_fn` for FSDP2 over `ranks` ranks: `Shard(d)` on the first even
    dimension of each stacked expert weight whose experts do not split evenly (module docstring), None (the
    default, dim 0) for every other parameter. None where no weight needs it (a dense model, experts that
    split, expert slices FSDP2 does not manage). Call before `fully_shard` replaces the parameters."""
    dims: dict[int, int] = {}  # by id: a Parameter's `in` would compare values
    for module in model.modules():
        if not isinstance(module, GroupedExperts):
            continue
        for p in (module.w1, module.w2):
            d = even_dim(p.shape, ranks)
            if d:  # (0: the default; None: nothing divides, FSDP2 pads dim 0)
                dims[id(p)] = d
    if not dims:
        return None
    return lambda p: Shard(dims[id(p)]) if id(p) in dims else None
