"""The FLUX.1 MMDiT (torchtitan's `flux-schnell` flavor): a rectified-flow transformer over VAE latent patches,
conditioned on T5 hidden states (as tokens), a CLIP pooled vector and the timestep (as AdaLN modulation).

Shape (torchtitan's flux-schnell, the reference; docs/benchmarks/flux1.md):
- image tokens: the latent `[C, H, W]` patchified `p x p` -> `(H/p)(W/p)` tokens of `C p^2` channels, `img_in`;
  text tokens: T5 states -> `txt_in`; both to `dim`;
- conditioning vector `vec = time_in(sinusoid(1000 t)) + vector_in(pooled)`; every modulation Linear reads
  `silu(vec)` (computed once per forward here, not once per block);
- `n_double` double-stream blocks: each stream (image, text) has its own weights, the attention is joint over
  `[text; image]`; then `n_single` single-stream blocks over the joint sequence, whose one input Linear
  yields Q, K, V and the MLP input in parallel; then the final AdaLN + Linear on the image tokens;
- 3-axis RoPE: each token has ids (0, row, col) (text: all zeros, so text is not rotated); head dims are split
  `axes_dim` per axis, and within each axis pairs `(x[2i], x[2i+1])` rotate (the interleaved layout of the
  reference checkpoints), in fp32 as torchtitan does;
- attention is non-causal SDPA.

`model.layers` holds the double blocks, then the single blocks (FSDP2, activation checkpointing and compile
wrap each from outside); the forward tells them apart by index (`cfg.n_double`).

Initialisation (`init`): DiT-style, as the reference: Xavier-uniform projections with zero biases, N(0, 0.02) for
the two embedder MLPs, every modulation Linear and the final layer zero, so the model starts as the
identity in every block and predicts 0.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.models.common.layers import RMSNorm
from timetotrain.models.family import ModelFamily
from timetotrain.models.flux.config import FluxConfig
from timetotrain.models.flux.hf import diffusers_mapping

# ------------------------------------------------------------------------------------------------ layers


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of `1000 t` (`t` in [0, 1], shape `[B]`): cos of the `dim/2` frequencies, then
    sin, frequencies `max_period^(-i / (dim/2))`, in fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (1000.0 * t.float())[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


def rope_tables(cfg: FluxConfig, txt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[txt_len + img_len, head_dim // 2]` (fp32, CPU) for ids (0, row, col) of the image
    patches after `txt_len` text tokens with ids 0. Angles in fp64 as the references compute them."""
    r, c = torch.meshgrid(torch.arange(cfg.grid), torch.arange(cfg.grid), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(r), r, c], dim=-1).reshape(-1, 3)
    ids = torch.cat([torch.zeros(txt_len, 3, dtype=img_ids.dtype), img_ids]).double()
    angles = []
    for axis, d in enumerate(cfg.axes_dim):
        inv = 1.0 / cfg.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles.append(torch.outer(ids[:, axis], inv))
    a = torch.cat(angles, dim=-1)
    return a.cos().float(), a.sin().float()


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs `(x[2i], x[2i+1])` of `x` `[B, T, H, D]` by `freqs` = cos + i sin `[T, 1, D/2]`
    (complex64), in fp32.

    As one complex product, pair i read as x[2i] + i x[2i+1]: the same four products and two sums per pair
    as the real form (x0 cos - x1 sin, x1 cos + x0 sin), but one contiguous kernel forward and one backward
    instead of strided half-width multiplies and a stack (about 5x less time for this op on CPU)."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, freqs) -> torch.Tensor:
    """Joint non-causal attention: q, k, v `[B, T, H, D]` (q, k normed) -> `[B, T, H * D]`."""
    q, k = rope(q, freqs), rope(k, freqs)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """AdaLN: LayerNorm without affine, then `(1 + scale) x + shift` (`shift`/`scale` `[B, 1, dim]`)."""
    return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=eps), 1 + scale)


class MLPEmbedder(nn.Module):
    """Linear -> SiLU -> Linear, for the timestep features and the pooled text vector."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x)))


class Stream(nn.Module):
    """One stream (image or text) of a double block: its modulation, QKV, QK norms, output projection, MLP."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        d = cfg.dim
        self.mod = nn.Linear(d, 6 * d)  # shift, scale, gate for attention, then for the MLP
        self.qkv = nn.Linear(d, 3 * d)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.eps)
        self.proj = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, d)
        self.n_heads, self.eps = cfg.n_heads, cfg.eps

    def qkv_of(self, x: torch.Tensor, shift, scale):
        q, k, v = self.qkv(modulate(x, shift, scale, self.eps)).unflatten(-1, (3, self.n_heads, -1)).unbind(2)
        return self.q_norm(q), self.k_norm(k), v

    def finish(self, x, attn, mods):
        _, _, gate1, shift2, scale2, gate2 = mods
        x = torch.addcmul(x, gate1, self.proj(attn))
        h = self.fc2(F.gelu(self.fc1(modulate(x, shift2, scale2, self.eps)), approximate="tanh"))
        return torch.addcmul(x, gate2, h)


class DoubleBlock(nn.Module):
    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.img = Stream(cfg)
        self.txt = Stream(cfg)

    def forward(self, img, txt, svec, freqs):
        im = self.img.mod(svec).unsqueeze(1).chunk(6, dim=-1)
        tm = self.txt.mod(svec).unsqueeze(1).chunk(6, dim=-1)
        qi, ki, vi = self.img.qkv_of(img, im[0], im[1])
        qt, kt, vt = self.txt.qkv_of(txt, tm[0], tm[1])
        L = txt.shape[1]
        out = attention(torch.cat([qt, qi], 1), torch.cat([kt, ki], 1), torch.cat([vt, vi], 1), freqs)
        return self.img.finish(img, out[:, L:], im), self.txt.finish(txt, out[:, :L], tm)


class SingleBlock(nn.Module):
    """Over the joint sequence: one Linear gives Q, K, V and the MLP input; one Linear maps the attention
    output and GELU(MLP input), concatenated, back."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        d = cfg.dim
        self.mod = nn.Linear(d, 3 * d)  # shift, scale, gate
        self.linear1 = nn.Linear(d, 3 * d + cfg.mlp_dim)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.eps)
        self.linear2 = nn.Linear(d + cfg.mlp_dim, d)
        self.dim, self.mlp_dim, self.n_heads, self.eps = d, cfg.mlp_dim, cfg.n_heads, cfg.eps

    def forward(self, x, svec, freqs):
        shift, scale, gate = self.mod(svec).unsqueeze(1).chunk(3, dim=-1)
        qkv, mlp = self.linear1(modulate(x, shift, scale, self.eps)).split([3 * self.dim, self.mlp_dim], -1)
        q, k, v = qkv.unflatten(-1, (3, self.n_heads, -1)).unbind(2)
        out = attention(self.q_norm(q), self.k_norm(k), v, freqs)
        return torch.addcmul(x, gate, self.linear2(torch.cat([out, F.gelu(mlp, approximate="tanh")], -1)))


class Flux(nn.Module):
    """`forward(img, txt, vec, t)`: patchified noisy latents `[B, img_len, in_channels]`, T5 states
    `[B, L, txt_dim]`, CLIP pooled `[B, vec_dim]`, timesteps `[B]` in [0, 1] -> velocity
    `[B, img_len, in_channels]`."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.img_in = nn.Linear(cfg.in_channels, d)
        self.txt_in = nn.Linear(cfg.txt_dim, d)
        self.time_in = MLPEmbedder(cfg.time_dim, d)
        self.vector_in = MLPEmbedder(cfg.vec_dim, d)
        self.layers = nn.ModuleList(
            [DoubleBlock(cfg) for _ in range(cfg.n_double)] + [SingleBlock(cfg) for _ in range(cfg.n_single)]
        )
        self.final_mod = nn.Linear(d, 2 * d)  # shift, scale
        self.final_out = nn.Linear(d, cfg.in_channels)
        # RoPE tables of the image grid after `txt_len` text tokens; not saved, recomputed by `reset_rope`
        # after a meta-device build + `to_empty` (and for another text length in `forward`).
        self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_dim // 2), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        if self.rope_cos.is_meta:
            return
        cos, sin = rope_tables(self.cfg, self.cfg.txt_len)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def _tables(self, txt_len: int):
        cos, sin = self.rope_cos, self.rope_sin
        if txt_len != self.cfg.txt_len:  # text ids are 0: its rows are cos 1, sin 0 whatever its length
            img_cos, img_sin = cos[self.cfg.txt_len :], sin[self.cfg.txt_len :]
            cos = torch.cat([img_cos.new_ones(txt_len, img_cos.shape[1]), img_cos])
            sin = torch.cat([img_sin.new_zeros(txt_len, img_sin.shape[1]), img_sin])
        # Complex built per forward, not stored: Module.to(dtype) would cast a complex buffer to a real one.
        return torch.complex(cos.float(), sin.float()).unsqueeze(1)

    def forward(self, img, txt, vec, t):
        cfg = self.cfg
        img, txt = self.img_in(img), self.txt_in(txt)
        feats = timestep_features(t, cfg.time_dim).to(img.dtype)
        svec = F.silu(self.time_in(feats) + self.vector_in(vec))
        L = txt.shape[1]
        freqs = self._tables(L)
        for block in self.layers[: cfg.n_double]:
            img, txt = block(img, txt, svec, freqs)
        x = torch.cat([txt, img], dim=1)
        for block in self.layers[cfg.n_double :]:
            x = block(x, svec, freqs)
        shift, scale = self.final_mod(svec).unsqueeze(1).chunk(2, dim=-1)
        return self.final_out(modulate(x[:, L:], shift, scale, cfg.eps))


# ------------------------------------------------------------------------------------------------ init


@torch.no_grad()
def init(model: Flux, generator: torch.Generator | None) -> None:
    """DiT initialisation (as the reference); modulation and final layers zero."""

    def xavier(lin: nn.Linear):
        nn.init.xavier_uniform_(lin.weight, generator=generator)
        nn.init.zeros_(lin.bias)

    def normal(lin: nn.Linear):
        nn.init.normal_(lin.weight, 0.0, 0.02, generator=generator)
        nn.init.zeros_(lin.bias)

    def zero(lin: nn.Linear):
        nn.init.zeros_(lin.weight)
        nn.init.zeros_(lin.bias)

    xavier(model.img_in)
    xavier(model.txt_in)
    for emb in (model.time_in, model.vector_in):
        normal(emb.fc1)
        normal(emb.fc2)
    for block in model.layers:
        # By attribute, not class: under the sharded build `parallel.apply` (activation checkpointing)
        # may already have wrapped the blocks, and wrappers forward attributes.
        streams = [block.img, block.txt] if hasattr(block, "img") else [block]
        for s in streams:
            zero(s.mod)
            for name in ("qkv", "proj", "fc1", "fc2", "linear1", "linear2"):
                if hasattr(s, name):
                    xavier(getattr(s, name))
            nn.init.ones_(s.q_norm.weight)
            nn.init.ones_(s.k_norm.weight)
    zero(model.final_mod)
    zero(model.final_out)
    model.reset_rope()


# ------------------------------------------------------------------------------------------------ sizes


def _lin(i: int, o: int) -> int:
    return i * o + o


def double_block_params(cfg: FluxConfig) -> int:
    d, m, h = cfg.dim, cfg.mlp_dim, cfg.head_dim
    return 2 * (_lin(d, 6 * d) + _lin(d, 3 * d) + 2 * h + _lin(d, d) + _lin(d, m) + _lin(m, d))


def single_block_params(cfg: FluxConfig) -> int:
    d, m, h = cfg.dim, cfg.mlp_dim, cfg.head_dim
    return _lin(d, 3 * d) + _lin(d, 3 * d + m) + 2 * h + _lin(d + m, d)


def param_count(cfg: FluxConfig) -> int:
    d = cfg.dim
    outer = (
        _lin(cfg.in_channels, d)
        + _lin(cfg.txt_dim, d)
        + _lin(cfg.time_dim, d)
        + _lin(d, d)
        + _lin(cfg.vec_dim, d)
        + _lin(d, d)
        + _lin(d, 2 * d)
        + _lin(d, cfg.in_channels)
    )
    return outer + cfg.n_double * double_block_params(cfg) + cfg.n_single * single_block_params(cfg)


def flops_per_sample(cfg: FluxConfig, txt_len: int | None = None) -> float:
    """Training FLOPs (forward + backward = 3 x forward) of one image with `txt_len` text tokens: 2 per
    multiply-add of every matmul a token or the conditioning vector goes through, plus the joint
    non-causal attention, `4 T^2 head_dim` per head and layer (QK^T and AV over the full square)."""
    L = cfg.txt_len if txt_len is None else txt_len
    d, m, Li = cfg.dim, cfg.mlp_dim, cfg.img_len
    T = L + Li
    n = cfg.n_double + cfg.n_single
    # Per token and block, double and single alike: QKV 3d^2, out d^2, MLP 2dm (single: d(3d+m) + (d+m)d).
    per_token_block = 4 * d * d + 2 * d * m
    macs = (
        Li * cfg.in_channels * d
        + L * cfg.txt_dim * d
        + T * n * per_token_block
        + Li * d * cfg.in_channels
        # the conditioning path, once per sample: embedders, modulation Linears, final modulation
        + cfg.time_dim * d
        + cfg.vec_dim * d
        + 2 * d * d
        + cfg.n_double * 12 * d * d
        + cfg.n_single * 3 * d * d
        + 2 * d * d
    )
    attn = 4 * T * T * d * n  # all heads: 4 T^2 head_dim x n_heads
    return 3.0 * (2.0 * macs + attn)


def flops_per_token(cfg: FluxConfig, seq_len: int | None = None, causal: bool = False) -> float:
    """`flops_per_sample` per token of the joint sequence (`seq_len` = text + image tokens); the attention
    is never causal here."""
    T = cfg.seq_len if seq_len is None else seq_len
    return flops_per_sample(cfg, T - cfg.img_len) / T


# ------------------------------------------------------------------------------------------------ memory
#
# What autograd keeps for backward, counted from the forward above (`ttt plan`, train/memory.py), with `a`
# bytes per activation element (2 under bf16 parameters, 4 in fp32), d = dim, m = mlp_dim, H = heads. Each
# tensor counts once however many ops save it (a view keeps its whole storage alive). Per token:
# - a stream of a double block: the block input (LayerNorm), the normalised and the modulated values (the
#   modulation's addcmul, the QKV Linear), the Q and K RMSNorm outputs (the learnable scale's mul), rotated
#   Q and K, joint V and the SDPA output, the contiguous copy of this stream's slice of it that the
#   projection reads (a Linear copies a strided 3-d input; at micro-batch 1 the slice is contiguous and this
#   copy is not made), the projection's output (the gated residual), the mid-block residual, its normalised
#   and modulated values, fc1's output (GELU), GELU's output (fc2), fc2's output (gate): 15d + 2m elements.
#   The QK norms read their inputs as fp32: in fp32 that keeps the whole QKV output (3d x 4 bytes), in bf16
#   they keep fp32 copies of Q and K (2d x 4 bytes) instead;
# - a single block: input, normalised, modulated (3d), linear1's output (3d + m, kept by V, GELU and, in
#   fp32, the QK norms), the QK norm outputs and rotated Q and K (4d), the SDPA output (d), the
#   concatenation of it and GELU's output that linear2 reads (d + m; GELU's output itself only feeds it),
#   linear2's output (d): 13d + 2m elements, plus the fp32 copies of Q and K (2d x 4 bytes) in bf16;
# - fp32 statistics: 2 per LayerNorm (mean, rstd), H per QK norm (rstd), H for the SDPA logsumexp
#   (flash attention keeps no T x T matrix, only these softmax statistics).
# Per sample and block: the modulation Linear's output (6d per stream, kept by the gate views) and the
# `1 + scale` tensors (2 per stream): 16d a for a double block, 4d a for a single one.
# Outside the blocks, per sample: the inputs the embedders keep (latent patches, T5 states, timestep
# features, CLIP pooled), the embedder MLPs' hidden values (4d), the summed conditioning and its SiLU (2d),
# the last block's output (T d, read by the final norm), the final normalised and modulated image tokens
# (2 img_len d) and `1 + scale` (d), and the loss's fp32 prediction and target (2 img_len C p^2 x 4).
# Per forward: the complex RoPE table cos + i sin [T, head_dim / 2] that each q/k rotation keeps (8 bytes each).
# The frozen T5, CLIP and VAE never run while training: the data are their precomputed outputs.
# Under DDP's autocast (bf16 without FSDP) the LayerNorms run in fp32 and their outputs stay fp32: about 5%
# more than this count, which assumes FSDP2's bf16 parameters (every activation bf16 but the parts named).


def _qk_norm_bytes(cfg: FluxConfig, a: int, whole_qkv: int) -> int:
    """Per token: what the fp32 QK norms keep beyond the a-byte tensors (see above)."""
    return whole_qkv * cfg.dim * 4 if a == 4 else 2 * cfg.dim * 4


def _stats_bytes(cfg: FluxConfig, layer_norms: int) -> int:
    return 4 * (2 * layer_norms + 3 * cfg.n_heads)


def double_block_bytes(cfg: FluxConfig, a: int) -> tuple[int, int]:
    """(bytes per token of the joint sequence, bytes per sample) a double block keeps for backward."""
    d, m = cfg.dim, cfg.mlp_dim
    per_token = a * (15 * d + 2 * m) + _qk_norm_bytes(cfg, a, 3) + _stats_bytes(cfg, 2)
    return per_token, 16 * d * a


def single_block_bytes(cfg: FluxConfig, a: int) -> tuple[int, int]:
    """(bytes per token, bytes per sample) a single block keeps for backward."""
    d, m = cfg.dim, cfg.mlp_dim
    per_token = a * (13 * d + 2 * m) + _qk_norm_bytes(cfg, a, 0) + _stats_bytes(cfg, 1)
    return per_token, 4 * d * a


def outer_bytes(cfg: FluxConfig, a: int) -> int:
    """Bytes per sample kept outside the blocks: embedder inputs and hidden values, the conditioning, the
    final layer and the loss."""
    d, T, Li, C = cfg.dim, cfg.seq_len, cfg.img_len, cfg.in_channels
    inputs = Li * C + cfg.txt_len * cfg.txt_dim + cfg.time_dim + cfg.vec_dim
    conditioning = 4 * d + 2 * d
    final = T * d + 2 * Li * d + d
    return a * (inputs + conditioning + final) + 4 * 2 * Li + 4 * 2 * Li * C


def activation_bytes(cfg: FluxConfig, samples: int, act_bytes: int, ac: bool) -> float:
    """Bytes autograd keeps for a micro-batch of `samples` images (the count above). With activation
    checkpointing each block keeps only its input (T d), plus one block's activations while it is
    recomputed (the larger kind, less the input it already counts)."""
    a, T = act_bytes, cfg.seq_len
    dt, ds = double_block_bytes(cfg, a)
    st, ss = single_block_bytes(cfg, a)
    if ac:
        recompute = max(T * dt + ds, T * st + ss) - T * cfg.dim * a
        body = cfg.n_layers * T * cfg.dim * a + recompute
    else:
        body = cfg.n_double * (T * dt + ds) + cfg.n_single * (T * st + ss)
    return float(samples * (body + outer_bytes(cfg, a)) + rope_table_bytes(cfg))


def rope_table_bytes(cfg: FluxConfig) -> int:
    """Once per forward, not per sample: the complex RoPE table [T, head_dim / 2] (complex64) that every q/k
    product keeps (`Flux._tables` builds it per forward, so it is an activation, not a buffer)."""
    return cfg.seq_len * (cfg.head_dim // 2) * 8


def activation_elements(cfg: FluxConfig) -> float:
    """Elements per token of the larger block in bf16 (the family interface's per-token figure; `ttt plan`
    uses `activation_bytes`, which also counts the fp32 parts exactly)."""
    return max(double_block_bytes(cfg, 2)[0], single_block_bytes(cfg, 2)[0]) / 2


def largest_block_params(cfg: FluxConfig) -> int:
    """The double block: the largest unit FSDP2 gathers at once."""
    return max(double_block_params(cfg), single_block_params(cfg))


def with_layers(cfg: FluxConfig, n: int) -> FluxConfig:
    """`ttt synth --layers n`: n blocks at the same width, split double:single as the reference's 19:38
    (a third double-stream, rounded): 3 -> 1 + 2, 6 -> 2 + 4, 57 -> 19 + 38, 1 -> 0 + 1."""
    n_double = round(n * 19 / 57)
    return dataclasses.replace(cfg, n_double=n_double, n_single=n - n_double)


FAMILY = ModelFamily(
    name="flux",
    build=Flux,
    init=init,
    param_count=param_count,
    active_param_count=param_count,
    flops_per_token=flops_per_token,
    block_params=largest_block_params,
    activation_elements=activation_elements,
    hf_mapping=diffusers_mapping,
    activation_bytes=activation_bytes,
    with_layers=with_layers,
)
