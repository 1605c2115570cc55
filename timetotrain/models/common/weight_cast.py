"""Casting weights that autocast does not see, once per optimizer step.

Autocast casts an fp32 weight to bf16 once per outermost autocast context, from its cache, for the ops it
knows (`linear`, `mm`, ...): `train/step.py` enters one context per step, so every linear weight is cast
once per step. `torch._grouped_mm` is not such an op, so the MoE experts cast their stacked weights
themselves (`moe/experts.py`), which without this module happens every micro-batch (and again in every
activation-checkpointed recomputation): the whole `[n_experts, ...]` stack, since at training batch sizes
every expert has tokens.

`cast(w, dtype)` is that cast; inside `cached()` (the step enters it alongside its autocast context) it
returns the same bf16 copy for the same weight until the context exits, under autocast's own rule: a leaf
fp32 tensor that requires grad, in grad mode, unchanged since it was cast (its `_version`). Every
micro-batch's backward then flows through the one cast node, whose gradient (the bf16 gradient, rounded
to fp32) accumulates into `w.grad` exactly as separate casts would: losses and gradients are bitwise those
of one cast per micro-batch. Cost: the copies live until the step ends, as autocast's do (2 B/param).
Compiled code (`--compile`) does not use the cache (Dynamo cannot trace it): it casts in its graph, per call.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_CACHE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("weight_cast_cache", default=None)


@contextlib.contextmanager
def cached():
    """Casts inside share one copy per weight and dtype; the copies are dropped on exit. Re-entrant: an
    inner context (an activation-checkpointed recomputation runs inside the step) reuses the outer cache."""
    if _CACHE.get() is not None:
        yield
        return
    token = _CACHE.set({})
    try:
        yield
    finally:
        _CACHE.reset(token)


def active() -> bool:
    """Whether a `cached()` context is open (the caller is inside a training step)."""
    return not torch.compiler.is_compiling() and _CACHE.get() is not None


def cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`w.to(dtype)`, from the cache where `cached()` is active and the weight qualifies (module docstring)."""
    if torch.compiler.is_compiling():  # Dynamo cannot trace the cache; a compiled graph casts in-graph
        return w.to(dtype)
    cache = _CACHE.get()
    if (
        cache is None
        or w.dtype != torch.float32
        or dtype == w.dtype
        or not (w.is_leaf and w.requires_grad and torch.is_grad_enabled())
    ):
        return w.to(dtype)
    key = (id(w), dtype)
    hit = cache.get(key)
    # The entry keeps `w` alive, so its id cannot be reused by another tensor while cached.
    if hit is not None and hit[0] is w and hit[1] == w._version:
        return hit[2]
    out = w.to(dtype)
    cache[key] = (w, w._version, out)
    return out
