"""Dropless expert computation: group token copies by expert (`permute`), run the stacked SwiGLU experts
on the grouped layout (`GroupedExperts`), and return to token order (`unpermute`).

The grouped layout is what an expert-parallel all-to-all produces, so `GroupedExperts` runs unchanged on
a shard of experts (train/expert_parallel.py). Expert weights are stacked `[n_experts, ...]` so they can
be sharded along dim 0.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from timetotrain.fakes import host_sizes, real_host
from timetotrain.models.common import weight_cast
from timetotrain.models.common.fused import swiglu, weight_by_probs


def permute(
    x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the `N * k` (token, slot) copies by expert.

    Returns (tokens `[N*k, dim]` ordered by expert, their probs `[N*k]`, counts `[n_experts]` int64,
    order `[N*k]`: position p holds the flat (token * k + slot) index of grouped row p). Within an expert the
    copies keep token order (stable sort), as Megatron's permutation does. No host synchronisation.
    """
    n, k = experts.shape
    sorted_experts, order = torch.sort(experts.reshape(-1), stable=True)
    # Replicate by expand + reshape (backward: a fixed-order sum over the k copies) instead of indexing with
    # repeated token ids, whose backward accumulates with atomics on GPUs.
    replicated = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, x.shape[-1])
    grouped = replicated.index_select(0, order)
    grouped_probs = probs.reshape(-1).index_select(0, order)
    # Counts from the sorted ids: `bincount` would sync with the host on CUDA to size its output.
    ends = torch.searchsorted(sorted_experts, torch.arange(n_experts, device=x.device), right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return grouped, grouped_probs, counts, order


def unpermute(y: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Inverse of `permute` for the expert outputs `[N*k, dim]` -> `[N, dim]` (sum over the k slots)."""
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    # Gather back to (token, slot) order and sum the slots in a fixed order: a scatter-add combine would add
    # in atomic order on GPUs and make runs non-reproducible.
    return y.index_select(0, inverse).view(-1, top_k, y.shape[-1]).sum(dim=1)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: `_grouped_mm`'s backward rejects the stride-0
    gradients that e.g. `.sum()` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _swiglu(h: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    a = swiglu(h)  # silu(gate) * up with a copy-free backward
    if probs is None:
        return a
    # Megatron's `activation_func_with_probs`: weight in the probs' dtype (fp32), round back once.
    return weight_by_probs(a, probs)


def _experts_grouped_mm(x, counts, w1, w2, probs):
    if torch.is_autocast_enabled(x.device.type):
        # `_grouped_mm` is not an autocast op; cast as autocast would cast a linear, the weights once per
        # step where the step caches them (common/weight_cast.py).
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w1, w2 = x.to(dtype), weight_cast.cast(w1, dtype), weight_cast.cast(w2, dtype)
    offsets = counts.cumsum(0).to(torch.int32)
    h = _ContiguousGrad.apply(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    a = _swiglu(h, probs)
    return _ContiguousGrad.apply(torch._grouped_mm(a, w2.transpose(-2, -1), offs=offsets))


def _experts_loop(x, counts, w1, w2, probs):
    # One matmul pair per expert over its contiguous slice; `tolist` is the only host sync of the MoE layer.
    sizes = host_sizes(counts, x.shape[0])
    if torch.is_autocast_enabled(x.device.type) and weight_cast.active():
        # Within a step: the whole stack once per step (common/weight_cast.py) instead of autocast casting
        # each active expert's slice (a view, which its cache skips) every micro-batch.
        dtype = torch.get_autocast_dtype(x.device.type)
        w1, w2 = weight_cast.cast(w1, dtype), weight_cast.cast(w2, dtype)
    xs = x.split(sizes)
    ps = probs.split(sizes) if probs is not None else [None] * len(sizes)
    outs = [
        F.linear(_swiglu(F.linear(xe, w1[e]), ps[e]), w2[e]) for e, xe in enumerate(xs) if xe.shape[0] > 0
    ]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


@functools.cache
def grouped_mm_supported(
    device: torch.device, dtype: torch.dtype, dim: int, ffn_dim: int, fake: bool = False
) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward correctly here (probed once per key).

    Support differs by build and device (CUDA builds have wanted sm90+, bf16 and 16-byte-aligned rows; this
    CPU build takes fp32/bf16 but not fp64), so probing beats encoding the rules. The probe forces grad mode:
    a first call from an eval under `no_grad`/`inference_mode` must not cache a spurious False. `fake`: the
    inputs are fake tensors (`ttt plan --simulate`), which run the op's meta kernel; it takes what CUDA takes
    (bf16), so it is asked too, on meta tensors.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    if fake:
        try:
            with real_host():
                a = torch.empty(4, dim, device="meta", dtype=dtype)
                torch._grouped_mm(a, torch.empty(3, dim, 16, device="meta", dtype=dtype),
                                  offs=torch.tensor([1, 1, 4], device="meta", dtype=torch.int32))  # fmt: skip
        except RuntimeError:
            return False
    try:
        with (
            # The probe asks this machine's kernels: real tensors even under a fake-tensor mode (`ttt plan
            # --simulate`, timetotrain/fakes.py), whose tensors hold no values to compare.
            real_host(),
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autocast(device_type=device.type, enabled=False),
            # Keep the probe's saved tensors its own: the first call may come from an activation-checkpointed
            # forward (the sharded build warms up the wrapped blocks), whose recomputation, with the probe
            # cached, would then save fewer tensors than the forward did.
            torch.autograd.graph.saved_tensors_hooks(_keep, _keep),
        ):
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(4, dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
            w1 = torch.randn(3, 2 * ffn_dim, dim, device=device, dtype=dtype, generator=gen)
            w2 = torch.randn(3, dim, ffn_dim, device=device, dtype=dtype, generator=gen)
            w1.requires_grad_(True)
            w2.requires_grad_(True)
            counts = torch.tensor([1, 0, 3], device=device)  # an empty group on purpose
            out = _experts_grouped_mm(x, counts, w1, w2, None)
            out.backward(torch.ones_like(out))
            ref = _experts_loop(x.detach(), counts, w1.detach(), w2.detach(), None)
            tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
            ok = torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
            return bool(ok and w1.grad[1].abs().max().item() == 0)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


@torch.compiler.assume_constant_result
def grouped_mm_compiles(device: torch.device, dtype: torch.dtype, dim: int, ffn_dim: int) -> bool:
    """`grouped_mm_supported` for a compiled call: Dynamo runs this once per key while tracing and keeps the
    answer as a constant (calling the cached probe itself would break the graph). Tracing runs the op's meta
    kernel on fake tensors, which wants bf16 where this CPU build's kernel takes fp32 too, so both are asked."""
    runs = grouped_mm_supported(device, dtype, dim, ffn_dim)
    return runs and grouped_mm_supported(device, dtype, dim, ffn_dim, fake=True)


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU FFNs, stacked: `w1` `[E, 2*ffn, dim]` (gate rows, then up), `w2` `[E, dim, ffn]`.

    `forward(tokens grouped by expert, counts per expert, probs)`: the layout an expert-parallel all-to-all
    produces, so this module can run on a shard of experts unchanged.
    """

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        # None: use `torch._grouped_mm` when the probe says it works for this device/dtype; True/False forces.
        self.use_grouped_mm: bool | None = None

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        use = self.use_grouped_mm
        if use is None:
            dtype = (
                torch.get_autocast_dtype(x.device.type)
                if torch.is_autocast_enabled(x.device.type)
                else x.dtype
            )
            key = (x.device, dtype, self.w1.shape[2], self.w2.shape[2])
            if torch.compiler.is_compiling():
                use = grouped_mm_compiles(*key)
            else:
                use = grouped_mm_supported(*key, is_fake(x))
        fn = _experts_grouped_mm if use else _experts_loop
        return fn(x, counts, self.w1, self.w2, probs)
