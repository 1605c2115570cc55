"""Qwen3.5-MoE's text model (the MLPerf 6.1 `qwen35_397b_grpo` policy), docs/models/qwen3_5_moe.md.

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

import torch
from torch import nn

from timetotrain.models.common.layers import FeedForward, rope_tables
from timetotrain.models.common.moe import MoE, TopKRouter
from timetotrain.models.common.moe.telemetry import expert_load
from timetotrain.models.common.sequence_shard import SequenceShard, check_length, head_loss, rope_at
from timetotrain.models.family import ModelFamily
from timetotrain.models.qwen3_5_moe.attention import CenteredRMSNorm, GatedAttention, KVCache
from timetotrain.models.qwen3_5_moe.config import Qwen35MoeConfig
from timetotrain.models.qwen3_5_moe.deltanet import DELTANET_CHUNK, GatedDeltaNet, LinearState
from timetotrain.models.qwen3_5_moe.hf import hf_export, hf_mapping
from timetotrain.models.qwen3_5_moe.parallelize import check_shape, tensor_parallel


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
        """`state`/`valid`/`mask`: decoding only (`DecodeCache`); training passes `x, cos, sin` (and under
        context parallelism `mask`, the attention's `ShardAttention`)."""
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
        # Columns from here on are real in every row: the DeltaNet layers skip their padding mask there.
        self.pad_end = int(n_pad.max()) if n_pad.numel() else 0
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

    def hidden(self, tokens: torch.Tensor, shard: SequenceShard | None = None) -> torch.Tensor:
        """Final-normed hidden states `[B, T, dim]` of unpadded (or right-padded) rows starting at position 0.
        Under a `shard` (context parallelism, `common/sequence_shard.py`) `tokens` are the whole sequences
        and the states this part's; the DeltaNet layers must then run their CP forward
        (train/context_parallel_deltanet.py), which the harness swaps in."""
        check_length(tokens, self.cfg.max_seq_len)
        tokens, cos, sin = rope_at(self.rope_cos, self.rope_sin, tokens, shard)
        mask = None if shard is None else shard.attend(None)
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, cos, sin, mask=mask)
        return self.norm(x)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        reduction: str = "mean",
        cache: DecodeCache | None = None,
        temperature: float = 1.0,
        shard: SequenceShard | None = None,
    ) -> torch.Tensor:
        """`tokens` `[B, T]` -> logits `[B, T, vocab]`; with `labels` (-100 ignored) their cross-entropy
        (`reduction="none"`: per token, of the logits / `temperature`: GRPO's log-probabilities, negated). With
        `cache`: decoding (`decode`), through `forward` so that FSDP2's root hooks gather the embedding and head.
        Under a `shard`: this part's share of the mean or summed loss (`common/sequence_shard.py`)."""
        if cache is not None:
            return self.decode(tokens, cache)
        return head_loss(self.hidden(tokens, shard), self.head, labels, reduction, shard, temperature)

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers]

    def tokens_per_expert(self) -> torch.Tensor:
        return torch.stack([m.tokens_per_expert for m in self.moe_layers()])

    # ---- decoding ----

    def new_cache(self, n_pad: torch.Tensor, capacity: int) -> DecodeCache:
        """A cache for `len(n_pad)` rows, row b left-padded by `n_pad[b]`, holding up to `capacity` columns."""
        B, device = n_pad.shape[0], self.embed.weight.device
        layers = [
            b.attn.new_cache(capacity) if b.full_attention else b.attn.new_state(B, device)
            for b in self.layers
        ]
        cols = torch.arange(capacity, device=device)
        return DecodeCache(layers, cols.unsqueeze(0) >= n_pad.to(device).unsqueeze(1), n_pad.to(device))

    def decode(self, tokens: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        """(Called as `model(tokens, cache=cache)`.) Logits `[B, T, vocab]` of the next `T` columns of every row (the prompt block, then one column per
        step), extending `cache`."""
        B, T = tokens.shape
        start = cache.length
        cols = torch.arange(start, start + T, device=tokens.device)
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"decoding past max_seq_len {self.cfg.max_seq_len}")
        positions = (cols.unsqueeze(0) - cache.n_pad.unsqueeze(1)).clamp(min=0)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        valid = cache.valid[:, start : start + T] if start < cache.pad_end else None
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
    """in_proj (HF's in_proj_qkv, _z, _b, _a), the conv taps, dt_bias, A_log, the gated norm, out_proj."""
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
    C, dk, dv = min(DELTANET_CHUNK, seq_len), cfg.lin_k_dim, cfg.lin_v_dim
    per_head = 2 * C * dk + C * (dv + dk) / 2 + C * dv + 3 * dk * dv  # multiply-adds per token
    linear = (cfg.n_layers - cfg.n_full_layers()) * 6 * cfg.lin_v_heads * per_head
    return 6 * matmul + full + linear


def block_activation_elements(cfg: Qwen35MoeConfig, full_attention: bool) -> float:
    """Elements autograd keeps per token for one block of either kind, counted in the compute precision with fp32
    tensors as two elements (what bf16 training keeps; tests/test_qwen3_5_moe.py checks the count against the
    bytes autograd saves under CPU bf16 autocast).

    - Each of the two 1-centred norms: its input upcast and its normalised output, in fp32, and the output in the
      compute dtype (5h).
    - The MoE, as deepseek_v3 counts it: the router's fp32 logits and softmax (2E), top-k (2k), per routed copy the
      permuted input (h), fc1's output (2f), the weighted activation (f) and the expert output (h), the combine's
      input (k h); the shared expert's fc1 output and fc2 input (3 f_s) and its gate (2).
    - Gated attention: the block input (h), the fused q/gate/k/v projection's output, kept whole because the gate,
      a view of it, is saved ((2 H + 2 kv) hd), q and k through their fp32 norms (4 (H + kv) hd), the rotated q, k and
      v (H hd + 2 kv hd), SDPA's output (H hd), the gate's sigmoid and the gated product (2 H hd), o_proj's input
      (H hd).
    - Gated DeltaNet: the block input (h), the conv's input and output (2 C_conv), then in fp32: per value head the
      chunk's C x C matrices (decays, the triangular system, the in-chunk scores and their products: 5 C), the
      key- and value-sized tensors of the normalisation, head repeat, solves and output norm (10 d_k + 8 d_v),
      beta and g (8), and the state entering each chunk (4 d_k d_v / C).
    """
    h, f, k, fs = cfg.dim, cfg.expert_ffn_dim, cfg.top_k, cfg.shared_ffn_dim
    norms = 2 * 5 * h
    moe = 2 * cfg.n_experts + 2 * k + k * (h + 2 * f + f + h) + k * h + 3 * fs + 2
    if full_attention:
        H, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        mixer = (
            h + (2 * H + 2 * kv) * hd + 4 * (H + kv) * hd + (H + 2 * kv) * hd + H * hd + 2 * H * hd + H * hd
        )
    else:
        Hv, dk, dv, C = cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim, DELTANET_CHUNK
        fp32 = Hv * (5 * C + 10 * dk + 8 * dv + 8 + 4 * dk * dv / C)
        mixer = h + 2 * cfg.conv_dim + 2 * fp32
    return norms + moe + mixer


def activation_elements(cfg: Qwen35MoeConfig) -> float:
    """`block_activation_elements` averaged over the layer pattern (what `ttt plan` multiplies by `n_layers`)."""
    n_full = cfg.n_full_layers()
    full, linear = block_activation_elements(cfg, True), block_activation_elements(cfg, False)
    return (n_full * full + (cfg.n_layers - n_full) * linear) / cfg.n_layers


def tensor_parallel_elements(cfg: Qwen35MoeConfig, tp: int) -> float:
    """`activation_elements` per token on one rank under the TP plan (parallelize.py), averaged over the layer
    pattern: the block norms 1/tp (sequence parallelism), the mixer's per-head tensors 1/tp (heads split) but
    its input gathered whole (h), the router, routed experts and shared gate whole (every TP rank of a group
    runs them on all the group's tokens), the shared expert's SwiGLU 1/tp (its width cut)."""
    h, f, k, fs = cfg.dim, cfg.expert_ffn_dim, cfg.top_k, cfg.shared_ffn_dim
    whole = 2 * cfg.n_experts + 2 * k + k * (h + 2 * f + f + h) + k * h + 2
    shared = 3 * fs
    norms = 2 * 5 * h
    # what the whole count holds besides the norms and the MoE: the mixer, its input among them
    mixer = activation_elements(cfg) - norms - whole - shared
    return (norms + mixer - h + shared) / tp + h + whole


def tensor_parallel_whole(cfg: Qwen35MoeConfig) -> tuple[int, int]:
    """(The model's parameters besides the routed experts that the TP plan keeps whole, those of one block):
    the embedding, head and final norm; in every layer the router and the shared expert's gate (its SwiGLU
    is cut)."""
    moe = _moe_params(cfg, 0) - 3 * cfg.dim * cfg.shared_ffn_dim
    return 2 * cfg.vocab_size * cfg.dim + cfg.dim + cfg.n_layers * moe, moe


def peak_block_elements(cfg: Qwen35MoeConfig) -> float:
    """The larger of the two kinds of block: what one block's recomputation holds under activation checkpointing."""
    kinds = [cfg.is_full_attention(i) for i in range(cfg.n_layers)]
    return max(block_activation_elements(cfg, full) for full in set(kinds))


def decode_state_bytes(cfg: Qwen35MoeConfig, capacity: int, act_bytes: int) -> float:
    """One row's decode cache at `capacity` tokens: each full-attention layer's K and V (`kv` heads of `head_dim`,
    in the compute precision), each DeltaNet layer's fp32 state (`lin_v_heads` x d_k x d_v) and conv window."""
    n_full = cfg.n_full_layers()
    kv = n_full * 2 * cfg.n_kv_heads * cfg.head_dim * capacity * act_bytes
    state = (
        (cfg.n_layers - n_full)
        * 4
        * (cfg.lin_v_heads * cfg.lin_k_dim * cfg.lin_v_dim + cfg.conv_dim * (cfg.conv_kernel - 1))
    )
    return float(kv + state)


def telemetry(model: Qwen35Moe) -> tuple[dict, str]:
    """Tokens routed to each expert in the last training forward per layer, and the load spread."""
    return expert_load(model.tokens_per_expert().tolist())


FAMILY = ModelFamily(
    name="qwen3_5_moe",
    build=Qwen35Moe,
    init=init_weights,
    param_count=param_count,
    active_param_count=active_param_count,
    flops_per_token=flops_per_token,
    block_params=block_params,
    activation_elements=activation_elements,
    peak_block_elements=peak_block_elements,
    decode_state_bytes=decode_state_bytes,
    telemetry=telemetry,
    hf_mapping=hf_mapping,
    hf_export=hf_export,
    tensor_parallel=tensor_parallel,
    tensor_parallel_check=check_shape,
    tensor_parallel_elements=tensor_parallel_elements,
    tensor_parallel_whole=tensor_parallel_whole,
)

__all__ = ["DecodeCache", "GatedSharedExpert", "HybridBlock", "KVCache", "LinearState", "Qwen35Moe", "FAMILY"]
