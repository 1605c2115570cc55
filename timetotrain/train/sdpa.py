"""SDPA backend priority per device, a setting: `TTT_SDPA_PRIORITY=cudnn,flash,efficient,math` (any order of
those names) makes every training step on CUDA try the backends in that order (torch's `sdpa_kernel` with
`set_priority=True`; a backend that cannot take a call is skipped as usual, so the order never makes a call
fail). Unset: torch's own order (FlashAttention-2 first, cuDNN later), until bench/gpu_probe.py has measured
on the device which wins (torchtitan puts cuDNN first on Hopper). CPUs: no effect (their kernels are not
chosen by this list)."""

from __future__ import annotations

import contextlib
import functools
import os

from torch.nn.attention import SDPBackend, sdpa_kernel

from timetotrain.errors import UserError

ENV = "TTT_SDPA_PRIORITY"
_NAMES = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


@functools.cache
def order(spec: str | None) -> tuple | None:
    """The backends `spec` names, in order; None for torch's default. A bad name: one line naming it."""
    if not spec:
        return None
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in _NAMES]
    if bad or not names:
        raise UserError(f"{ENV}={spec!r}: use a comma-separated order of {', '.join(_NAMES)}")
    # Named first, then the rest in torch's order, so that nothing is disabled by omission.
    rest = [n for n in _NAMES if n not in names]
    return tuple(getattr(SDPBackend, _NAMES[n]) for n in names + rest)


def priority(device_type: str):
    """A context that applies the configured order on CUDA; a no-op elsewhere or when unset."""
    backends = order(os.environ.get(ENV)) if device_type == "cuda" else None
    if backends is None:
        return contextlib.nullcontext()
    return sdpa_kernel(list(backends), set_priority=True)


def check() -> None:
    """Preflight: a malformed setting fails before any log line."""
    order(os.environ.get(ENV))
