"""Qwen3.5's gated full attention (every fourth layer) and the 1-centred RMSNorm the family uses.

Grouped-query attention with per-head QK-norm, partial RoPE and an output gate (HF `Qwen3_5MoeAttention`):
`q_proj` (here the first rows of the fused `qkv`) gives per head `head_dim` query values then `head_dim` gate values; q and k pass a 1-centred RMSNorm
over the head; RoPE rotates the first `rope_dim` dimensions of each head (the two halves of that slice, HF's
`rotate_half` convention) and leaves the rest; softmax scale `head_dim ** -0.5`; the attention output is
multiplied by `sigmoid(gate)` before `o_proj`. No biases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.models.common.layers import apply_rope
from timetotrain.models.common.sequence_shard import ShardAttention


class CenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from 1 (`y = norm(x) * (1 + w)`, w initialised to 0; HF
    `Qwen3_5MoeRMSNorm`, Megatron `--apply-layernorm-1p`), normalised in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())
        return y.type_as(x)


class KVCache:
    """One full-attention layer's keys and values `[B, kv_heads, capacity, head_dim]`, filled up to `length`;
    allocated at the first append, in the dtype the layer computes in (bf16 under FSDP2 mixed precision)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.k = self.v = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot hold {end}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def keep(self, rows: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """RoPE on the first `rope_dim` dimensions of `x` `[B, T, heads, head_dim]`; the rest pass through."""
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    return torch.cat((apply_rope(rot, cos, sin), rest), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_dim = cfg.rope_dim
        # HF's q_proj (with the gate), k_proj and v_proj as one matmul, rows [q+gate | k | v].
        self.qkv_sizes = [
            2 * cfg.n_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
        ]
        self.qkv = nn.Linear(cfg.dim, sum(self.qkv_sizes), bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = CenteredRMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = CenteredRMSNorm(cfg.head_dim, cfg.norm_eps)

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(capacity)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x` `[B, T, dim]`; `cos`/`sin` `[T, rope_dim / 2]` (shared positions) or `[B, T, rope_dim / 2]` (per
        row). Without `cache` and `mask`: causal attention over `x`. With `cache`: the new keys/values are
        appended and the queries attend over the whole cache under `mask` `[B, 1, T, cached + T]` (True =
        attend), which the caller builds (causality and padding)."""
        B, T, _ = x.shape
        H, hd = self.n_heads, self.head_dim
        qg, k, v = self.qkv(x).split(self.qkv_sizes, dim=-1)
        q, gate = qg.reshape(B, T, H, 2 * hd).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(B, T, self.n_kv_heads, hd))
        v = v.reshape(B, T, self.n_kv_heads, hd)
        cos, sin = (
            (cos.unsqueeze(1), sin.unsqueeze(1)) if cos.dim() == 2 else (cos.unsqueeze(2), sin.unsqueeze(2))
        )
        q, k = partial_rope(q, cos, sin, self.rope_dim), partial_rope(k, cos, sin, self.rope_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.append(k, v)
        group = H // self.n_kv_heads
        if isinstance(mask, ShardAttention):  # context parallelism: against the whole sequence's keys
            out = mask(q, k, v)
        elif mask is None and cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
        else:
            # An explicit mask (decoding): fold each KV head's query heads into its query rows instead of
            # repeating the cached keys and values (query head h uses KV head h // group, as HF's repeat_kv).
            kv, L = self.n_kv_heads, k.shape[2]
            q = q.reshape(B, kv, group * T, hd)
            mask = mask.unsqueeze(2).expand(B, 1, group, T, L).reshape(B, 1, group * T, L)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).view(B, H, T, hd)
        out = out.transpose(1, 2).reshape(B, T, H * hd) * torch.sigmoid(gate.reshape(B, T, H * hd))
        return self.o_proj(out)

    def init_weights(self, normal, std: float, residual_std: float) -> None:
        normal(self.qkv.weight, std)
        normal(self.o_proj.weight, residual_std)
        nn.init.zeros_(self.q_norm.weight)
        nn.init.zeros_(self.k_norm.weight)
