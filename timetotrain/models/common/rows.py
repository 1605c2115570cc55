"""`by_rows`: an initialiser run on a stacked tensor one row of dim 0 at a time, for the MoE expert stacks
(`GroupedExperts.w1` / `w2`, `[E, ...]`: an expert a row).

Why: the sharded build (train/shards.py `full_init`) draws a sharded parameter's values on a full tensor of
its global shape so that every layout starts from one process's weights; for an expert stack that tensor is
the whole stack (deepseekv3_671b's `[256, 4096, 7168]` fp32, 28 GiB on every rank). Drawn a row at a time,
the one-process build and every sharded one consume the generator in the same calls, and a sharded build
needs one row at a time (`full_init` recognises `by_rows` and keeps this rank's part of each row).

On the CPU the values equal a whole draw's for `uniform_` always and for `normal_` where a row's element
count is a multiple of 16 (torch fills uniforms, then turns them into normals in blocks of 16 and re-draws a
short tail's last 16); on CUDA they differ from a whole draw's (each call starts at its own Philox offset)
but still equal between the one-process build and every layout. Not for initialisers whose distribution
depends on the shape (`kaiming_*`, `xavier_*` read the fans of the tensor they are given).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import handle_torch_function, has_torch_function_unary


def by_rows(init: Callable[..., object], t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`init(t[e], *args, **kwargs)` for each row `e` of `t`'s dim 0, in order; returns `t`. A torch-function
    mode sees the call whole (`full_init` fills a sharded `t` from each full row)."""
    if has_torch_function_unary(t):
        return handle_torch_function(by_rows, (t,), init, t, *args, **kwargs)
    for e in range(t.shape[0]):
        init(t[e], *args, **kwargs)
    return t
