"""The optimizers the benchmarks' rules name (AdamW, Adam with their weight-decay masks; Adagrad)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from timetotrain.spec.benchmark import Optimizer
from timetotrain.train.adagrad import SparseAdagrad


def param_groups(model: nn.Module, weight_decay: float, mask: str = "megatron") -> list[dict]:
    """mask "megatron": no decay on biases and other 1-D tensors (norm weights); "all": decay everything
    (torchtitan's Flux)."""
    if mask not in ("megatron", "all"):
        raise ValueError(f"unknown weight-decay mask {mask!r}")
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if mask == "megatron" and p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: nn.Module, spec, lr: float, fused: bool | None = None, foreach: bool = True
) -> torch.optim.Optimizer:
    """`spec` is a `spec.benchmark.Optimizer`. `fused=None` picks the fused kernel where the device has one, else
    the foreach implementation (sharded DTensor parameters need foreach: pass fused=False), or with
    `foreach=False` the per-parameter loop (parameters of different meshes or placements in one list, as
    tensor parallelism leaves them, cannot share a foreach kernel)."""
    kinds = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    if spec.name == "adagrad":  # row-sparse for embedding tables, torch's update for the rest
        return SparseAdagrad([p for p in model.parameters() if p.requires_grad], lr, spec.eps, spec.rowwise)
    if spec.name not in kinds:
        raise ValueError(f"unknown optimizer {spec.name!r}: choose one of {', '.join(kinds)}")
    params = _apart_by_kind(param_groups(model, spec.weight_decay, spec.decay_mask))
    dev = next(model.parameters()).device
    if fused is None:
        fused = dev.type in ("cuda", "cpu")
    kwargs = {"fused": True} if fused else {"foreach": foreach}
    cls = kinds[spec.name]
    try:
        return cls(params, lr=lr, betas=spec.betas, eps=spec.eps, **kwargs)
    except (RuntimeError, TypeError):
        return cls(params, lr=lr, betas=spec.betas, eps=spec.eps)


def _apart_by_kind(groups: list[dict]) -> list[dict]:
    """Each group split into its DTensor and its plain parameters, when it holds both (FSDP2 shards next
    to expert-parallel slices, which FSDP2 leaves plain): a foreach kernel takes one kind or the other.
    AdamW's update is elementwise, so the grouping changes no value."""
    out = []
    for g in groups:
        sharded = [p for p in g["params"] if isinstance(p, DTensor)]
        plain = [p for p in g["params"] if not isinstance(p, DTensor)]
        if sharded and plain:
            out += [{**g, "params": sharded}, {**g, "params": plain}]
        else:
            out.append(g)
    return out


def build_adamw(
    model: nn.Module, lr: float, betas, eps: float, weight_decay: float, fused: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW with Megatron's decay mask (kept for callers that have no optimizer spec)."""
    return build_optimizer(model, Optimizer("adamw", tuple(betas), eps, weight_decay), lr, fused)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
