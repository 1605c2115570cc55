"""The layers every decoder family here is built from, written once: RMSNorm, RoPE (plain and Llama 3.1
scaled), grouped-query attention over a fused QKV projection (optionally with per-head QK-norm and a
sliding-window band), and the SwiGLU feed-forward.

Fused weight layouts (chosen to equal Megatron-Core's global layouts, so that Megatron checkpoints and
tensor-parallel column sharding map onto them without reshuffling):

- `Attention.qkv.weight`: shape `[(n_heads + 2 * n_kv_heads) * head_dim, dim]`. Rows are grouped by KV head:
  viewed as `[n_kv_heads, n_heads // n_kv_heads + 2, head_dim, dim]`, group `j` holds the query heads
  `j*g .. j*g+g-1` (g = n_heads // n_kv_heads), then key head `j`, then value head `j`. Query head `h`
  therefore attends with KV head `h // g`, the same pairing as HF's `repeat_kv`.
- `FeedForward.fc1.weight`: shape `[2 * ffn_dim, dim]`, gate rows first, then up rows;
  the block computes `fc2(silu(gate) * up)`.
- RoPE rotates the two halves of each head (`x[:hd/2]`, `x[hd/2:]`) as a pair, the convention of
  HF transformers' Llama and Megatron (non-interleaved); HF Llama weights therefore need no permutation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain import fakes
from timetotrain.models.common.fused import qkv_rope, swiglu
from timetotrain.models.common.sequence_shard import ShardAttention

# `enable_gqa` lets SDPA broadcast KV heads inside the kernel instead of us materialising repeated K/V.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling: long wavelengths are stretched by `factor`, short ones kept."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (DeepSeek-V3): frequencies rotating fewer than `beta_slow` times over the original
    context are interpolated by `factor`, those rotating more than `beta_fast` times kept, a linear ramp in
    between (over dimension indices, the bounds rounded outwards as DeepSeek's `truncate` does).

    Two magnitude corrections, each `0.1 * m * ln(factor) + 1` (`yarn_mscale`): the cos/sin tables are
    multiplied by `mscale(mscale) / mscale(mscale_all_dim)` (1 for DeepSeek-V3, where both are 1) and the
    softmax scale by `mscale(mscale_all_dim) ** 2` (`softmax_scale`)."""

    factor: float = 40.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    @property
    def table_scale(self) -> float:
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)

    def softmax_scale(self, head_dim: int) -> float:
        """The attention softmax scale for query/key heads of `head_dim`: `head_dim ** -0.5` times the
        squared all-dimension mscale."""
        m = yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0
        return head_dim**-0.5 * m * m


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    def dim_of(rotations: float) -> float:  # the dimension index that turns `rotations` times
        return (
            head_dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low = max(math.floor(dim_of(s.beta_fast)), 0)
    high = min(math.ceil(dim_of(s.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0.0, 1.0)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide it by factor)
    # 1 / (factor * theta^(2i/d)) rather than inv_freq / factor: the rounding HF and Megatron get.
    interpolated = 1.0 / (
        s.factor * (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    )
    return interpolated * (1 - keep) + inv_freq * keep


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None = None
) -> torch.Tensor:
    """Inverse frequencies (fp32, `[head_dim // 2]`), with Llama 3.1 or YaRN scaling when `scaling` is given.

    Computed in fp32 the same way Megatron and HF do, so the rounding of the tables matches theirs.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    wavelen = 2 * math.pi / inv_freq
    # How many wavelengths fit in the original context decides the blend: fewer than low_freq_factor ->
    # fully stretched (weight 0), more than high_freq_factor -> untouched (weight 1), linear in between.
    # Clamping gives exactly inv/factor and inv at the two ends, as the piecewise definition does.
    keep = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    keep = keep.clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / scaling.factor + keep * inv_freq


def rope_tables(
    head_dim: int, theta: float, max_seq_len: int, scaling: RopeScaling | YarnScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables on the CPU, fp32, shape `[max_seq_len, head_dim // 2]` (YaRN: times its
    `table_scale`)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    if isinstance(scaling, YarnScaling) and scaling.table_scale != 1.0:
        return angles.cos() * scaling.table_scale, angles.sin() * scaling.table_scale
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[B, T, heads, head_dim]` by position; `cos`/`sin` broadcast as `[T, 1, head_dim // 2]`."""
    # Under autocast q/k come out of the linear in bf16 while the tables stay fp32; follow x.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def band_blocks_mask(n_blocks: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean `[n_blocks, W, 2W]` mask for `windowed_attention`: query r of block j sees key c of the
    (previous block, own block) pair iff r <= c <= r + W; block 0 has no previous block."""
    r = torch.arange(window, device=device).unsqueeze(1)
    c = torch.arange(2 * window, device=device).unsqueeze(0)
    band = (c >= r) & (c <= r + window)
    first = band & (c >= window)
    return torch.cat([first.unsqueeze(0), band.unsqueeze(0).expand(n_blocks - 1, -1, -1)])


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sliding-window attention (keys `i - W .. i`) in blocks of W queries, each against its own and the
    previous block's keys: memory and work O(T * 2W) instead of the O(T^2) of a full masked square, which
    the fused kernels cannot skip (they take no band) and which SDPA's math fallback materialises.
    `q`, `k`, `v` `[B, H, T, hd]` with T a multiple of W; `mask` from `band_blocks_mask`."""
    B, H, T, D = q.shape
    n, W = mask.shape[0], mask.shape[1]
    qb = q.reshape(B, H, n, W, D)

    def pairs(t):  # [B, H, n, 2W, D]: (previous block, own block), zeros before the first
        tb = t.reshape(B, H, n, W, D)
        prev = torch.cat([tb.new_zeros(B, H, 1, W, D), tb[:, :, :-1]], dim=2)
        return torch.cat([prev, tb], dim=3)

    out = F.scaled_dot_product_attention(qb, pairs(k), pairs(v), attn_mask=mask)
    return out.reshape(B, H, T, D)


@dataclass(frozen=True)
class NativeWindow:
    """What `Decoder.window_mask` hands a windowed layer instead of a mask where torch's native windowed
    kernel runs (`native_window_works`): the band `i - window <= j <= i` itself."""

    window: int


def _varlen_attn():
    try:
        # heavy (1 s) and optional: CUDA only, and older torch has no varlen_attn
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def native_windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Sliding-window attention by torch's `varlen_attn` (FlashAttention with a window): `q` `[B, T, H, D]`,
    `k`/`v` `[B, T, H_kv, D]` (GQA in the kernel, no repeated K/V), each sample one sequence; window
    `(W, 0)` = keys `i - W .. i`, the band of `sliding_window_mask` (Megatron's `(window, 0)`). Returns
    `[B, T, H, D]`. CUDA only (torch 2.13 has no CPU kernel), so `native_window_works` guards every use."""
    B, T, H, D = q.shape
    cu = torch.arange(0, (B + 1) * T, T, device=q.device, dtype=torch.int32)
    out = _varlen_attn()(
        q.reshape(B * T, H, D), k.reshape(B * T, k.shape[2], D), v.reshape(B * T, v.shape[2], D),
        cu, cu, T, T, window_size=(window, 0), enable_gqa=k.shape[2] != H,
    )  # fmt: skip
    return out.view(B, T, H, D)


def native_window_works(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Whether `native_windowed_attention` runs here and equals the mask path (forward and input
    gradients, at the dtype's tolerance) on a small random case: checked once per key on the device
    itself, so a kernel whose window means something else, or that is missing (CPUs, pre-Ampere GPUs,
    fp32), leaves the layer on the mask path. Under `ttt plan --simulate` (`fakes.gpu_kernels()`: fake
    tensors on the CPU device, counted as a GPU keeps them) the answer is a GPU's that passes the check:
    the op's fake implementation gives its shapes (the check itself needs values)."""
    # The device and dtype first: a CPU run never pays varlen_attn's import (about 1 s).
    if dtype not in (torch.bfloat16, torch.float16) or not (device.type == "cuda" or fakes.gpu_kernels()):
        return False
    if _varlen_attn() is None:
        return False
    return fakes.gpu_kernels() or _checked_on_device(device, dtype, heads, kv_heads, head_dim)


@functools.cache
def _checked_on_device(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int):
    return window_kernel_agrees(device, dtype, heads, kv_heads, head_dim)


def window_kernel_agrees(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> bool:
    """`native_window_works`'s comparison, on whatever kernel `_varlen_attn` returns (tests give it one)."""
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cuda", enabled=False):
            gen = torch.Generator(device=device).manual_seed(0)
            B, T, W = 2, 96, 16

            def rand(h):
                return torch.randn(
                    B, T, h, head_dim, device=device, dtype=dtype, generator=gen
                ).requires_grad_()

            q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
            out = native_windowed_attention(q, k, v, W)
            grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
            g = heads // kv_heads
            qr, kr, vr = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(
                qr, kr.repeat_interleave(g, 1), vr.repeat_interleave(g, 1),
                attn_mask=sliding_window_mask(T, W, device),
            ).transpose(1, 2)  # fmt: skip
            ref_grads = torch.autograd.grad(ref.square().sum(), (qr, kr, vr))
            ok = torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2)
            for a, b in zip(grads, ref_grads, strict=True):
                b = b.transpose(1, 2)
                ok = ok and torch.allclose(a.float(), b, rtol=5e-2, atol=5e-2 * b.abs().max().item())
            return bool(ok)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def sliding_window_mask(seq_len: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean `[T, T]` SDPA mask, True = attend: the band `i - window <= j <= i` (Megatron `(window, 0)`)."""
    i = torch.arange(seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)
    return (j <= i) & (j >= i - window)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype, as Megatron/TE and HF do; bf16 mean-of-squares
        # loses enough precision to change the training curve.
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x)
        return y * self.weight


class Attention(nn.Module):
    """Causal grouped-query attention over the fused QKV layout above, no biases.

    `qk_norm_eps`: RMSNorm over `head_dim` on every query and key head (one weight vector shared by the
    heads, as Megatron builds it), applied before RoPE as Megatron does; None for none.
    """

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm_eps: float | None = None
    ):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.group = n_heads // n_kv_heads
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim, bias=False)
        self.proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x` `[B, T, dim]`; `cos`/`sin` `[T, head_dim // 2]`; `mask` None for full causal attention, else a
        boolean `[T, T]` mask (True = attend), the `[T / W, W, 2W]` blocks of a sliding-window band, or a
        `NativeWindow` (the band by torch's windowed kernel, where `native_window_works`), or a
        `ShardAttention` (context parallelism: this part's queries against the whole sequence)."""
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_kv_heads, self.group + 2, self.head_dim)
        if self.q_norm is None:
            q, k, v = qkv_rope(qkv, cos, sin)  # split + RoPE with a copy-free backward (fused.py)
        else:  # the norm sits between the split and the rotation, so the fused op cannot serve
            q, k, v = qkv.split([self.group, 1, 1], dim=3)
            q, k, v = q.reshape(B, T, self.n_heads, self.head_dim), k.squeeze(3), v.squeeze(3)
            q, k = self.q_norm(q), self.k_norm(k)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(mask, NativeWindow):
            out = native_windowed_attention(q, k, v, mask.window)
            return self.proj(out.reshape(B, T, self.n_heads * self.head_dim))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if isinstance(mask, ShardAttention):
            out = mask(q, k, v)
        elif mask is not None:
            # Repeat KV rather than `enable_gqa`: on CUDA the memory-efficient kernel takes an arbitrary mask
            # but not GQA; SDPA would otherwise fall back to the math kernel and materialise B*H*T*T scores.
            k = k.repeat_interleave(self.group, dim=1)
            v = v.repeat_interleave(self.group, dim=1)
            if mask.dim() == 3:  # a band in blocks (decoder.Decoder.window_mask)
                out = windowed_attention(q, k, v, mask)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.group == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif _SDPA_HAS_GQA:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k = k.repeat_interleave(self.group, dim=1)
            v = v.repeat_interleave(self.group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def init_weights(self, normal, std: float, residual_std: float) -> None:
        normal(self.qkv.weight, std)
        normal(self.proj.weight, residual_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                nn.init.ones_(norm.weight)


class FeedForward(nn.Module):
    """SwiGLU: `fc2(silu(gate) * up)`, gate and up rows fused in `fc1`."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * ffn_dim, bias=False)
        self.fc2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(swiglu(self.fc1(x)))  # silu(gate) * up with a copy-free backward

    def init_weights(self, normal, std: float, residual_std: float) -> None:
        normal(self.fc1.weight, std)
        normal(self.fc2.weight, residual_std)


def attention_matmul_params(dim: int, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Weights of the fused QKV projection and the output projection."""
    return dim * (n_heads + 2 * n_kv_heads) * head_dim + n_heads * head_dim * dim


def attention_saved_elements(dim: int, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Elements autograd keeps per token for one attention layer: rotated q, k, v, SDPA's output (h) and the
    output projection's input (h)."""
    return (n_heads + 2 * n_kv_heads) * head_dim + 2 * dim


# RMSNorm keeps its input, the normalised values and the weighted output: 3 elements per element.
RMSNORM_SAVED = 3


def attention_keys_per_query(seq_len: int, window: int | None, causal: bool) -> float:
    """Keys one query attends to on average, as a kernel computes them: the full square (`T`), its causal
    half (`T / 2`), or for a sliding window `W` its band (`min(W, T)`; causal: the band's area per query,
    `W - W^2 / (2T)` for `T > W`, else the causal triangle)."""
    T = seq_len
    if window is None:
        return T / 2 if causal else T
    W = window
    if causal:
        return W - W * W / (2 * T) if T > W else T / 2
    return min(W, T)
