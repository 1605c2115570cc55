"""AdamW with the Megatron weight-decay mask, and global-norm clipping."""

from __future__ import annotations

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's rule: no decay on biases and other 1-D tensors (norm weights)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_adamw(
    model: nn.Module, lr: float, betas, eps: float, weight_decay: float, fused: bool | None = None
) -> torch.optim.AdamW:
    """`fused=None` picks the fused kernel where the device has one, else the foreach implementation."""
    params = param_groups(model, weight_decay)
    dev = next(model.parameters()).device
    if fused is None:
        fused = dev.type in ("cuda", "cpu")
    kwargs = {"fused": True} if fused else {"foreach": True}
    try:
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
