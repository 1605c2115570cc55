"""Tensor parallelism of LoRA-adapted linears (models/common/lora.py), the adapters placed as Megatron and
NeMo place them so that the frozen base is never gathered. A family's TP plan (e.g.
models/llama/parallelize.py) hands each adapted linear here with the style it gives a plain one:

- column-parallel base (rows of `W` cut over the TP ranks, input whole on every rank): `A` `[r, in]` stays
  whole (a plain tensor, the same on every rank), `B` `[out, r]` is cut by rows like the base, so each rank
  adds its own rows of `B A x` to its rows of `W x`. The gradient of `A x` is a sum over the ranks' rows of
  `B`: `B`'s column-wise style all-reduces it in the backward (an `[tokens, r]` tensor), after which every
  rank computes the same, complete gradient of `A` and its share of the input gradient.
- row-parallel base (columns of `W` cut, input cut along its features): `A` is cut by columns like the
  base, `B` is whole (a replicated DTensor). Each rank's `B A_r x_r` is a partial sum, as its `W_r x_r` is:
  both stay partial (`Partial()`) and are added before the one reduction the plain layer makes (the
  reduce-scatter to the sequence-parallel layout, or an all-reduce): no collective of its own in the
  forward. `B`'s gradient is then partial on each rank (its input was); the harness reduces such gradients
  once per step (train/tensor_parallel.py: `replicate_partial_grads`; FSDP2 does it itself when it shards).
  The adapter's dropout sees only this rank's input columns: it draws the mask of the whole input and keeps
  its columns (`ShardedDropout`), so that the masks, and the training, equal one process's.
- the per-part q/k/v adapters (`QKVLoRALinear`) cut each part's `B` by rows; a column cut of the fused qkv
  keeps whole KV groups per rank, so the wrapper regroups its local parts with n_kv_heads / T groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from timetotrain.models.common.lora import LoRALinear, QKVLoRALinear


class ShardedDropout(nn.Module):
    """Dropout of this rank's slice of the last dimension (chunk `rank` of `parts`), with the mask one
    process would draw for the whole tensor: the whole mask is drawn (every TP rank holds the same RNG
    state and draws the same numbers) and this rank's columns kept. Costs one transient mask of the whole
    input; an independent mask per rank would be cheaper but train differently from one process."""

    def __init__(self, p: float, rank: int, parts: int):
        super().__init__()
        self.p, self.rank, self.parts = p, rank, parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        whole = F.dropout(x.new_ones(*x.shape[:-1], x.shape[-1] * self.parts), self.p)
        # A copy, not a view: autograd keeps the mask for the backward, and a view would keep all of it.
        return x * whole.chunk(self.parts, dim=-1)[self.rank].contiguous()

    def extra_repr(self) -> str:
        return f"p={self.p}, rank={self.rank} of {self.parts}"


def parallelize_adapted(module: nn.Module, tp_mesh, style) -> list[nn.Module]:
    """Parallelise the adapted linear `module` over `tp_mesh` as `style` (a `ColwiseParallel` or
    `RowwiseParallel`, or a subclass: float8's) would its base alone; returns the linears whose weights are
    cut by rows (the base and every `B` of a column-parallel module; none of a row-parallel one), on which a
    plan marks a stacked layout (`TP_STACKED_OVER`)."""
    if isinstance(style, ColwiseParallel):
        return _column(module, tp_mesh, style)
    if isinstance(style, RowwiseParallel):
        return _row(module, tp_mesh, style)
    raise ValueError(f"no LoRA layout for the tensor-parallel style {type(style).__name__}")


def _column(module: nn.Module, tp_mesh, style: ColwiseParallel) -> list[nn.Module]:
    parallelize_module(module.base, tp_mesh, style)
    outs = [module.base]
    for _, _, lora_B in module.pairs():  # A stays a plain tensor, whole on every rank
        parallelize_module(lora_B, tp_mesh, ColwiseParallel())
        outs.append(lora_B)
    if isinstance(module, QKVLoRALinear):
        n_kv, group, head_dim = module.heads
        module.heads = (n_kv // tp_mesh.size(), group, head_dim)
    return outs


def _row(module: nn.Module, tp_mesh, style: RowwiseParallel) -> list[nn.Module]:
    if not isinstance(module, LoRALinear):
        raise ValueError(f"no row-parallel layout for {type(module).__name__}")
    partial = dict(output_layouts=Partial(), use_local_output=False)
    parallelize_module(module.base, tp_mesh, type(style)(input_layouts=style.input_layouts[0], **partial))
    parallelize_module(
        module.lora_A, tp_mesh, RowwiseParallel(input_layouts=style.input_layouts[0], **partial)
    )
    distribute_module(module.lora_B, tp_mesh)  # replicated; its partial input makes a partial output
    if isinstance(module.dropout, nn.Dropout):
        module.dropout = ShardedDropout(module.dropout.p, tp_mesh.get_local_rank(), tp_mesh.size())
    # The one reduction of the base's and the adapter's partial sums, to the layout the plain layer gives.
    parallelize_module(
        module,
        tp_mesh,
        PrepareModuleOutput(
            output_layouts=Partial(),
            desired_output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        ),
    )
    return []
