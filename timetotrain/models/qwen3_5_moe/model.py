"""Qwen3.5-MoE's text model (the MLPerf 6.1 `qwen35_397b_grpo` policy), docs/benchmarks/qwen35_397b_grpo.md.

Block: 1-centred RMSNorm -> token mixer -> residual, 1-centred RMSNorm -> MoE -> residual; final 1-centred RMSNorm
and an untied head. The token mixer is Gated DeltaNet linear attention (`deltanet.py`) in three of every four
layers and gated full attention with partial RoPE (`attention.py`) in every fourth (`cfg.is_full_attention`).
Every layer's FFN is a mixture of experts (`common/moe/`): a softmax router whose top-k weights are renormalised
to sum 1 (HF `norm_topk_prob`; the shared `TopKRouter`, softmax over the k selected logits, is the same
function), `n_experts` routed SwiGLU experts, plus one shared SwiGLU expert every token goes through, scaled by
`sigmoid(shared_expert_gate x)` (`GatedSharedExpert`).

Decoding (`generate.py`) runs the same blocks with a `DecodeCache`: a KV cache per full-attention layer and a
conv + recurrent state per linear-attention layer, prompts left-padded, each row's positions counted from its
first real token, padding positions masked as keys and zeroed at the linear layers' input (so they add nothing).
"""

from __future__ import annotations

import math
import statistics

import torch
from torch import nn

from timetotrain.models.common.head_loss import logits_or_loss
from timetotrain.models.common.layers import RMSNORM_SAVED, FeedForward, rope_tables
from timetotrain.models.common.moe import MoE, TopKRouter
from timetotrain.models.family import ModelFamily
from timetotrain.models.qwen3_5_moe.attention import CenteredRMSNorm, GatedAttention, KVCache
from timetotrain.models.qwen3_5_moe.config import Qwen35MoeConfig
from timetotrain.models.qwen3_5_moe.deltanet import GatedDeltaNet, LinearState
from timetotrain.models.qwen3_5_moe.hf import hf_export, hf_mapping


class GatedSharedExpert(nn.Module):
    """The shared expert: a SwiGLU FFN whose output is scaled per token by `sigmoid(gate(x))`."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.ffn = FeedForward(dim, ffn_dim)
        self.gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.ffn(x)

    def init_weights(self, normal, std: float, residual_std: float) -> None:
        self.ffn.init_weights(normal, std, residual_std)
        normal(self.gate.weight, std)


def make_moe(cfg: Qwen35MoeConfig) -> MoE:
    router = TopKRouter(cfg.dim, cfg.n_experts, cfg.top_k)
    shared = GatedSharedExpert(cfg.dim, cfg.shared_ffn_dim)
    return MoE(router, cfg.n_experts, cfg.top_k, cfg.dim, cfg.expert_ffn_dim, shared=shared)


class HybridBlock(nn.Module):
    def __init__(self, cfg: Qwen35MoeConfig, layer: int):
        super().__init__()
        self.full_attention = cfg.is_full_attention(layer)
        self.attn_norm = CenteredRMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = GatedAttention(cfg) if self.full_attention else GatedDeltaNet(cfg)
        self.ffn_norm = CenteredRMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = make_moe(cfg)

    def forward(self, x, cos, sin, state=None, valid=None, mask=None) -> torch.Tensor:
        """`state`/`valid`/`mask`: decoding only (`DecodeCache`); training passes `x, cos, sin`."""
        h = self.attn_norm(x)
        if self.full_attention:
            h = self.attn(h, cos, sin, state, mask)
        else:
            h = self.attn(h, state, valid)
        h = x + h
        return h + self.ffn(self.ffn_norm(h))

    def init_weights(self, normal, std: float, residual_std: float, generator=None) -> None:
        if self.full_attention:
            self.attn.init_weights(normal, std, residual_std)
        else:
            self.attn.init_weights(normal, std, residual_std, generator)
        self.ffn.init_weights(normal, std, residual_std)
        nn.init.zeros_(self.attn_norm.weight)
        nn.init.zeros_(self.ffn_norm.weight)


class DecodeCache:
    """Decoding state for a batch of left-padded rows: one `KVCache` or `LinearState` per layer, which columns
    hold real tokens (`valid` `[B, capacity]`), how many are filled (`length`) and each row's left padding."""

    def __init__(self, layers: list, valid: torch.Tensor, n_pad: torch.Tensor):
        self.layers = layers
        self.valid = valid
        self.n_pad = n_pad
        self.length = 0

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in `rows` (finished sequences), so later steps compute only the live ones."""
        for s in self.layers:
            s.keep(rows)
        self.valid, self.n_pad = self.valid.index_select(0, rows), self.n_pad.index_select(0, rows)


class Qwen35Moe(nn.Module):
    """Built initialised (`init_weights` with the global RNG); on the meta device nothing is computed."""

    def __init__(self, cfg: Qwen35MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([HybridBlock(cfg, i) for i in range(cfg.n_layers)])
        self.norm = CenteredRMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Non-persistent, as the shared decoder's: derived from the config (`reset_rope`).
        half = cfg.rope_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.init_weights()

    def reset_rope(self) -> None:
        if self.rope_cos.is_meta:
            return
        c = self.cfg
        cos, sin = rope_tables(c.rope_dim, c.rope_theta, c.max_seq_len)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states `[B, T, dim]` of unpadded (or right-padded) rows starting at position 0."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.norm(x)

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """`tokens` `[B, T]` -> logits `[B, T, vocab]`; with `labels` (-100 ignored) their cross-entropy."""
        return logits_or_loss(self.hidden(tokens), self.head, labels, reduction)

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers]

    def tokens_per_expert(self) -> torch.Tensor:
        return torch.stack([m.tokens_per_expert for m in self.moe_layers()])

    # ---- decoding ----

    def new_cache(self, n_pad: torch.Tensor, capacity: int) -> DecodeCache:
        """A cache for `len(n_pad)` rows, row b left-padded by `n_pad[b]`, holding up to `capacity` columns."""
        B = n_pad.shape[0]
        p = self.embed.weight
        layers = [
            b.attn.new_cache(B, capacity, p.device, p.dtype)
            if b.full_attention
            else b.attn.new_state(B, p.device, p.dtype)
            for b in self.layers
        ]
        cols = torch.arange(capacity, device=p.device)
        return DecodeCache(layers, cols.unsqueeze(0) >= n_pad.to(p.device).unsqueeze(1), n_pad.to(p.device))

    def decode(self, tokens: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        """Logits `[B, T, vocab]` of the next `T` columns of every row (the prompt block, then one column per
        step), extending `cache`."""
        B, T = tokens.shape
        start = cache.length
        cols = torch.arange(start, start + T, device=tokens.device)
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"decoding past max_seq_len {self.cfg.max_seq_len}")
        positions = (cols.unsqueeze(0) - cache.n_pad.unsqueeze(1)).clamp(min=0)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        valid = cache.valid[:, start : start + T]
        keys = torch.arange(start + T, device=tokens.device)
        # A query sees the real keys up to its own column; a padding query sees itself (a finite, unused row).
        mask = (keys.unsqueeze(0) <= cols.unsqueeze(1)).unsqueeze(0) & cache.valid[:, None, : start + T]
        mask = (mask | (keys.unsqueeze(0) == cols.unsqueeze(1)).unsqueeze(0)).unsqueeze(1)
        x = self.embed(tokens)
        for block, state in zip(self.layers, cache.layers, strict=True):
            x = block(x, cos, sin, state, valid, mask)
        cache.length = start + T
        return self.head(self.norm(x))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Megatron-style: N(0, init_std) for the embedding, head and matmul weights except those writing into the
        residual stream (attention/DeltaNet output, expert down projections: N(0, init_std / sqrt(2 L))); the
        1-centred norms 0 (a gain of 1), the DeltaNet gated norm 1, its decay parameters as HF initialises them."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)

        def normal(t: torch.Tensor, s: float) -> None:
            nn.init.normal_(t, mean=0.0, std=s, generator=generator)

        normal(self.embed.weight, std)
        for block in self.layers:
            block.init_weights(normal, std, residual_std, generator)
        nn.init.zeros_(self.norm.weight)
        normal(self.head.weight, std)
        self.reset_rope()


def init_weights(model: Qwen35Moe, generator: torch.Generator | None = None) -> None:
    model.init_weights(generator)


# ---- sizes and FLOPs ----


def _full_attention_params(cfg: Qwen35MoeConfig) -> int:
    """q (with its gate), k, v, o projections and the two head norms."""
    H, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return cfg.dim * (2 * H + 2 * kv) * hd + H * hd * cfg.dim + 2 * hd


def _linear_attention_params(cfg: Qwen35MoeConfig) -> int:
    """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, the conv taps, dt_bias, A_log, the gated norm, out_proj."""
    value = cfg.lin_v_heads * cfg.lin_v_dim
    matmul = cfg.dim * (cfg.conv_dim + value + 2 * cfg.lin_v_heads) + value * cfg.dim
    return matmul + cfg.conv_dim * cfg.conv_kernel + 2 * cfg.lin_v_heads + cfg.lin_v_dim


def _moe_params(cfg: Qwen35MoeConfig, experts: int) -> int:
    """Router, `experts` routed experts, the shared expert and its gate."""
    return (
        cfg.dim * cfg.n_experts + (experts * cfg.expert_ffn_dim + cfg.shared_ffn_dim) * 3 * cfg.dim + cfg.dim
    )


def _mixer_params(cfg: Qwen35MoeConfig, layer: int) -> int:
    return _full_attention_params(cfg) if cfg.is_full_attention(layer) else _linear_attention_params(cfg)


def _count(cfg: Qwen35MoeConfig, experts: int) -> int:
    layers = sum(_mixer_params(cfg, i) + _moe_params(cfg, experts) + 2 * cfg.dim for i in range(cfg.n_layers))
    return layers + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def param_count(cfg: Qwen35MoeConfig) -> int:
    """All parameters: embedding, head, final norm and every layer with all its experts."""
    return _count(cfg, cfg.n_experts)


def active_param_count(cfg: Qwen35MoeConfig) -> int:
    """Parameters one token touches: as `param_count` with `top_k` routed experts per layer."""
    return _count(cfg, cfg.top_k)


def block_params(cfg: Qwen35MoeConfig) -> int:
    """The larger of the two kinds of block (what FSDP2 gathers at once, for `ttt plan`)."""
    mixer = max(_full_attention_params(cfg), _linear_attention_params(cfg))
    return mixer + _moe_params(cfg, cfg.n_experts) + 2 * cfg.dim


def flops_per_token(cfg: Qwen35MoeConfig, seq_len: int, causal: bool = True) -> float:
    """Training (forward + backward) FLOPs per token: 6 x the matmul weights a token uses (every layer's mixer
    projections, router, `top_k` routed and the shared expert with its gate; the LM head), plus

    - full attention: QK^T and PV over `n_heads` heads of `head_dim`, `6 * 2 * H * hd` per (query, key) pair,
      `T / 2` keys per query with `causal` (the llama convention);
    - Gated DeltaNet, chunked over C = 64 tokens, multiply-adds per value head and token: the in-chunk q k^T and
      k k^T scores (`2 C d_k`, the whole C x C square as computed), the two triangular solves (`C (d_v + d_k) / 2`),
      the in-chunk scores times U (`C d_v`) and the state terms W_k S, q S and k^T U (`3 d_k d_v`); 2 FLOPs per
      multiply-add, the backward twice the forward.
    Conv taps, norms, gates, RoPE and the router softmax are left out."""
    matmul = sum(_mixer_params(cfg, i) + _moe_params(cfg, cfg.top_k) for i in range(cfg.n_layers))
    matmul += cfg.dim * cfg.vocab_size
    keys = seq_len / 2 if causal else seq_len
    full = cfg.n_full_layers() * 6 * 2 * cfg.n_heads * cfg.head_dim * keys
    C, dk, dv = min(64, seq_len), cfg.lin_k_dim, cfg.lin_v_dim
    per_head = 2 * C * dk + C * (dv + dk) / 2 + C * dv + 3 * dk * dv  # multiply-adds per token
    linear = (cfg.n_layers - cfg.n_full_layers()) * 6 * cfg.lin_v_heads * per_head
    return 6 * matmul + full + linear


def activation_elements(cfg: Qwen35MoeConfig) -> float:
    """Elements autograd keeps per token for one block, averaged over the layer pattern (train/memory.py).

    Every block: two norms (3h each); the MoE as deepseek_v3 counts it: the router's fp32 logits and softmax (2E),
    top-k (2k), per routed copy the permuted input (h), fc1's output (2f), the weighted activation (f) and the
    expert output (h), the combine's input (k h); the shared expert's fc1 output and fc2 input (3 f_s) and its
    gate (2). Full attention: q and gate (2 H hd), normed and rotated q, k, v (H hd + 2 kv hd, counted twice for
    the norm and RoPE), SDPA's output and the gated product (2 H hd). Gated DeltaNet: the qkv projection and conv
    output (2 C_conv), fp32 normalised q, k, v after the head repeat (4 bytes: 2x under bf16, so counted twice:
    2 H_v (2 d_k + d_v)), beta and g, z (H_v d_v), the chunked solves' W_v, W_k and the per-chunk U
    (H_v (2 d_v + d_k)), the core output and the gated norm's tensors (3 H_v d_v), out_proj's input (H_v d_v).
    """
    h, f, k, fs = cfg.dim, cfg.expert_ffn_dim, cfg.top_k, cfg.shared_ffn_dim
    moe = 2 * cfg.n_experts + 2 * k + k * (h + 2 * f + f + h) + k * h + 3 * fs + 2
    H, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    full = 2 * H * hd + 2 * (H * hd + 2 * kv * hd) + 2 * H * hd
    Hv, dk, dv = cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    linear = 2 * cfg.conv_dim + 2 * Hv * (2 * dk + dv) + 2 * Hv + Hv * dv + Hv * (2 * dv + dk) + 4 * Hv * dv
    n_full = cfg.n_full_layers()
    mixer = (n_full * full + (cfg.n_layers - n_full) * linear) / cfg.n_layers
    return 2 * RMSNORM_SAVED * h + mixer + moe


def telemetry(model: Qwen35Moe) -> tuple[dict, str]:
    """Tokens routed to each expert in the last training forward per layer, and the load spread."""
    per_layer = model.tokens_per_expert().tolist()
    totals = [sum(col) for col in zip(*per_layer, strict=True)]
    mean = statistics.fmean(totals)
    cv = statistics.pstdev(totals) / mean if mean else 0.0
    figures = {
        "ttt_tokens_per_expert": per_layer,
        "ttt_expert_load": {"min": min(totals), "max": max(totals), "cv": cv},
    }
    return figures, f"  experts min {min(totals)} max {max(totals)} CV {cv:.2f}"


FAMILY = ModelFamily(
    name="qwen3_5_moe",
    build=Qwen35Moe,
    init=init_weights,
    param_count=param_count,
    active_param_count=active_param_count,
    flops_per_token=flops_per_token,
    block_params=block_params,
    activation_elements=activation_elements,
    telemetry=telemetry,
    hf_mapping=hf_mapping,
    hf_export=hf_export,
)

__all__ = ["DecodeCache", "GatedSharedExpert", "HybridBlock", "KVCache", "LinearState", "Qwen35Moe", "FAMILY"]
