"""Tensor parallelism for the decoder families (`--parallel tp=T[,fsdp=F]`), applied from outside the model
with PyTorch's DTensor `parallelize_module` plans (Megatron-style, as torchtitan applies them):

- per block: the fused QKV and the fused SwiGLU input (`fc1`) column-wise, the attention output (`proj`) and
  the FFN output (`fc2`) row-wise; the two block norms sequence-parallel, so the residual stream between
  the row-wise outputs and the next column-wise inputs is a DTensor cut along the sequence (`Shard(1)`):
  a reduce-scatter after each row-wise layer and an all-gather before each column-wise one;
- the embedding stays whole on every TP rank and its output is cut along the sequence; the final norm
  gathers the sequence back, so the head and its fused loss (models/common/head_loss.py) see plain tensors.

Layouts. The fused QKV rows are grouped per KV head (models/common/layers.py), so a column-wise cut into T
contiguous parts gives each rank whole KV groups (n_kv_heads must divide by T) and the attention runs
locally on n_heads / T query heads. `fc1` holds all gate rows, then all up rows; a contiguous cut would give
one rank only gates. Its DTensor therefore stands for the rows reordered as [gate_0, up_0, gate_1, up_1, ...]
(rank r's gate and up slices side by side), so each rank's local rows are [gate_r; up_r] and the model's
SwiGLU splits them in halves as it does unsharded. `STACKED` marks such a parameter; `logical(full, param)`
reorders a full tensor of the model's layout into that order, so initialisation and checkpoint loading
(train/shards.py) fill the right rows. A gathered `full_tensor()` of `fc1` is in the reordered layout
(`unstack` reverses it).

Gradient clipping needs the norm over distinct elements: `clip_grad_norm_tp` sums each rank's local
squares weighted by how many ranks hold the same values, then one all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from timetotrain.errors import UserError

STACKED = "_ttt_tp_stacked"  # parameter attribute: (sub-tensors stacked along dim 0, TP degree)


def check_shape(cfg, tp: int) -> None:
    """One line naming what does not divide: heads and FFN width must split evenly over the TP ranks."""
    problems = []
    if cfg.n_kv_heads % tp:
        problems.append(f"n_kv_heads {cfg.n_kv_heads}")
    if cfg.ffn_dim % tp:
        problems.append(f"ffn_dim {cfg.ffn_dim}")
    if problems:
        raise UserError(f"--parallel tp={tp}: {' and '.join(problems)} of the model do not divide by {tp}")


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Parallelise `model` (a `models.common.decoder.Decoder` with dense FFNs) over the 1-D `tp_mesh`, in place;
    works on the meta device (before `to_empty`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    check_shape(model.cfg, tp)
    # The embedding's whole output, cut along the sequence for the first block.
    parallelize_module(
        model.embed,
        tp_mesh,
        PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        ),
    )
    for block in model.layers:
        if not hasattr(block.ffn, "fc1"):
            raise UserError("--parallel tp: only dense (SwiGLU) blocks have a tensor-parallel plan, not MoE")
        gathered = PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        )
        plan = {
            "attn_norm": SequenceParallel(),
            "attn": gathered,
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "ffn_norm": SequenceParallel(),
            "ffn": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
            "ffn.fc1": ColwiseParallel(),
            "ffn.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        parallelize_module(block, tp_mesh, plan)
        block.ffn.fc1._ttt_tp_stacked_over = tp  # on the module: FSDP2 and to_empty replace the parameter
        # The attention computes on this rank's heads (whole KV groups, see the module docstring).
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
        if block.attn.q_norm is not None:
            raise UserError("--parallel tp: attention with QK-norm has no tensor-parallel plan yet")
    parallelize_module(
        model.norm,
        tp_mesh,
        PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    )
    mark_stacked(model)


def logical(full: torch.Tensor, param) -> torch.Tensor:
    """`full` (the model's layout) reordered as the DTensor `param` stands for it (module docstring)."""
    stacked = getattr(param, STACKED, None)
    if stacked is None:
        return full
    parts, tp = stacked
    pieces = [sub.chunk(tp, dim=0) for sub in full.chunk(parts, dim=0)]
    return torch.cat([pieces[p][r] for r in range(tp) for p in range(parts)], dim=0)


def unstack(full: torch.Tensor, param) -> torch.Tensor:
    """The inverse of `logical`: a gathered `full_tensor()` back in the model's layout."""
    stacked = getattr(param, STACKED, None)
    if stacked is None:
        return full
    parts, tp = stacked
    per_rank = [r.chunk(parts, dim=0) for r in full.chunk(tp, dim=0)]
    return torch.cat([per_rank[r][p] for p in range(parts) for r in range(tp)], dim=0)


@torch.no_grad()
def clip_grad_norm_tp(params, max_norm: float, world: int) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over parameters sharded and replicated over all `world` ranks in
    any mix (TP and FSDP DTensors, plain tensors every rank holds whole): each local square sum counts
    once per distinct copy (divided by the number of ranks holding it), one all-reduce gives the total."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in grads:
        if isinstance(g, DTensor):
            shards = 1
            for i, placement in enumerate(g.placements):
                # Shard or FSDP's _StridedShard over a TP shard (whose is_shard() is False).
                if not (placement.is_replicate() or placement.is_partial()):
                    shards *= g.device_mesh.size(i)
            local = g.to_local()
            total += local.float().pow(2).sum() * (shards / world)
        else:
            total += g.float().pow(2).sum() / world
    dist.all_reduce(total)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm


def mark_stacked(model: nn.Module) -> None:
    """Mark every block's `fc1` weight as stacked (gate, up) over the TP ranks; again after anything that
    replaces the parameter objects (FSDP2's sharding, `to_empty`)."""
    for module in model.modules():
        tp = getattr(module, "_ttt_tp_stacked_over", None)
        if tp is not None:
            setattr(module.weight, STACKED, (2, tp))
