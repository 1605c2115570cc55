"""Llama 3.x decoder (the model of the MLPerf `llama31_8b` benchmark) as a plain single-device module.

Architecture (spec §6.1): pre-norm decoder blocks of RMSNorm -> grouped-query causal attention with RoPE
-> residual, RMSNorm -> SwiGLU FFN -> residual; a final RMSNorm and an untied LM head. No biases, no dropout.
Parallelism, activation checkpointing and compilation are applied from outside, per `Llama.layers[i]`.

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

Shape facts that set the FLOPs (per token, `L` layers, model width `d`, `H` query / `Hkv` KV heads of
size `hd`, FFN width `f`, vocabulary `V`, sequence `T`):

- matmul weights per layer: `d*(H + 2*Hkv)*hd` (QKV) + `H*hd*d` (output) + `3*d*f` (SwiGLU); plus the LM head
  `d*V`. The embedding is a gather and the norms are element-wise, so neither counts as matmul work.
- attention scores and the weighted sum: `2 * H * hd * T` multiply-adds per token per layer if the full
  `T x T` square is computed; a causal kernel needs only about half of it.
- training FLOPs per token = 6 * (matmul weights) + 12 * L * H * hd * T (see `flops_per_token`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.models.fused import qkv_rope, swiglu
from timetotrain.models.head_loss import logits_or_loss

# `enable_gqa` lets SDPA broadcast KV heads inside the kernel instead of us materialising repeated K/V.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling: long wavelengths are stretched by `factor`, short ones kept."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | None = None
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


LLAMA31_8B = LlamaConfig(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    vocab_size=128_256,
    max_seq_len=8192,
    norm_eps=1e-5,
    rope_theta=500_000.0,
    rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
    ),
    init_std=0.02,
)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies (fp32, `[head_dim // 2]`), with Llama 3.1 scaling when `scaling` is given.

    Computed in fp32 the same way Megatron and HF do, so the rounding of the tables matches theirs.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    # How many wavelengths fit in the original context decides the blend: fewer than low_freq_factor ->
    # fully stretched (weight 0), more than high_freq_factor -> untouched (weight 1), linear in between.
    # Clamping gives exactly inv/factor and inv at the two ends, as the piecewise definition does.
    keep = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    keep = keep.clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / scaling.factor + keep * inv_freq


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables on the CPU, fp32, shape `[max_seq_len, head_dim // 2]`."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    positions = torch.arange(cfg.max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[B, T, heads, head_dim]` by position; `cos`/`sin` broadcast as `[T, 1, head_dim // 2]`."""
    # Under autocast q/k come out of the linear in bf16 while the tables stay fp32; follow x.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.qkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x` `[B, T, dim]`; `cos`/`sin` `[T, head_dim // 2]`."""
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_kv_heads, self.group + 2, self.head_dim)
        q, k, v = qkv_rope(qkv, cos, sin)  # split + RoPE with a copy-free backward (fused.py)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.group == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif _SDPA_HAS_GQA:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k = k.repeat_interleave(self.group, dim=1)
            v = v.repeat_interleave(self.group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(swiglu(self.fc1(x)))  # silu(gate) * up, gate rows first in fc1


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.ffn(self.ffn_norm(h))


class Llama(nn.Module):
    """Built initialised (`init_weights` with the global RNG); on the meta device nothing is computed."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        # nn.Embedding / nn.Linear (not bare Parameters) so module-swapping tools (float8, TP plans) find them.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Non-persistent: derived from the config, so checkpoints stay weights-only; `init_weights`
        # recomputes them after a meta-device build + `to_empty`.
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        init_weights(self)

    def reset_rope(self) -> None:
        """Fill the RoPE tables; needed after `to_empty` when weights are loaded instead of initialised."""
        if self.rope_cos.is_meta:
            return
        cos, sin = rope_tables(self.cfg)
        with torch.no_grad():
            # Built on the CPU and copied, so every device gets bit-identical tables.
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states `[B, T, dim]`; lets a loss apply the head in chunks."""
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
        """`tokens` `[B, T]` (int64) -> logits `[B, T, vocab_size]`; with `labels` `[B, T]` (-100 = ignored)
        -> their token cross-entropy instead, computed by `head_loss` without materialising the logits."""
        return logits_or_loss(self.hidden(tokens), self.head, labels, reduction)


@torch.no_grad()
def init_weights(model: Llama, generator: torch.Generator | None = None) -> None:
    """Megatron-Core initialisation (spec §6.1) in place; also (re)computes the RoPE tables.

    N(0, init_std) for the embedding, QKV, fc1 (gate/up) and LM head; N(0, init_std / sqrt(2 * n_layers))
    for the two projections that write into the residual stream (attention output, fc2); norm weights 1.
    Works on a model built on the meta device after `to_empty(device=...)`.
    """
    cfg = model.cfg
    std = cfg.init_std
    residual_std = std / math.sqrt(2 * cfg.n_layers)

    def normal(t: torch.Tensor, s: float) -> None:
        nn.init.normal_(t, mean=0.0, std=s, generator=generator)

    normal(model.embed.weight, std)
    for block in model.layers:
        normal(block.attn.qkv.weight, std)
        normal(block.attn.proj.weight, residual_std)
        normal(block.ffn.fc1.weight, std)
        normal(block.ffn.fc2.weight, residual_std)
        nn.init.ones_(block.attn_norm.weight)
        nn.init.ones_(block.ffn_norm.weight)
    nn.init.ones_(model.norm.weight)
    normal(model.head.weight, std)
    model.reset_rope()


def _matmul_params(cfg: LlamaConfig) -> int:
    qkv = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    proj = cfg.n_heads * cfg.head_dim * cfg.dim
    ffn = 3 * cfg.dim * cfg.ffn_dim
    return cfg.n_layers * (qkv + proj + ffn) + cfg.dim * cfg.vocab_size


def param_count(cfg: LlamaConfig) -> int:
    """Trainable parameters: matmul weights + embedding + (2 per block + 1 final) RMSNorm weights."""
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    return _matmul_params(cfg) + cfg.vocab_size * cfg.dim + norms


def flops_per_token(cfg: LlamaConfig, seq_len: int, causal: bool = False) -> int:
    """Training (forward + backward) FLOPs per token: 6 * matmul weights + 12 * L * H * hd * seq_len.

    The first term counts every linear layer including the LM head (2 FLOPs per multiply-add, x3 for
    forward + two backward matmuls); the embedding gather, norms, RoPE, softmax and SwiGLU element-wise
    work are left out. The second term is the two attention matmuls (QK^T and PV) over the full square,
    the convention of PaLM/Megatron/torchtitan MFU figures; `causal=True` halves it to count only the lower
    triangle that a causal flash kernel actually computes.
    """
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    if causal:
        attention //= 2
    return 6 * _matmul_params(cfg) + attention


# --- HF transformers `LlamaForCausalLM` interchange -------------------------------------------------------


def hf_config_kwargs(cfg: LlamaConfig) -> dict:
    """Keyword arguments for `transformers.LlamaConfig` describing the same model."""
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
    )
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    return kwargs


_HF_SAME = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.fc2.weight": "mlp.down_proj.weight",
}


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> HF `LlamaForCausalLM` state dict (fused QKV / fc1 split into HF's projections)."""
    hd, g, kv = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, cfg.n_kv_heads
    out = {
        "model.embed_tokens.weight": state_dict["embed.weight"],
        "model.norm.weight": state_dict["norm.weight"],
        "lm_head.weight": state_dict["head.weight"],
    }
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _HF_SAME.items():
            out[hf + b] = state_dict[ours + a]
        qkv = state_dict[ours + "attn.qkv.weight"].view(kv, g + 2, hd, cfg.dim)
        out[hf + "self_attn.q_proj.weight"] = qkv[:, :g].reshape(cfg.n_heads * hd, cfg.dim)
        out[hf + "self_attn.k_proj.weight"] = qkv[:, g].reshape(kv * hd, cfg.dim)
        out[hf + "self_attn.v_proj.weight"] = qkv[:, g + 1].reshape(kv * hd, cfg.dim)
        gate, up = state_dict[ours + "ffn.fc1.weight"].chunk(2, dim=0)
        out[hf + "mlp.gate_proj.weight"] = gate.contiguous()
        out[hf + "mlp.up_proj.weight"] = up.contiguous()
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF `LlamaForCausalLM` state dict -> ours (inverse of `to_hf_state_dict`)."""
    hd, g, kv = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, cfg.n_kv_heads
    out = {
        "embed.weight": state_dict["model.embed_tokens.weight"],
        "norm.weight": state_dict["model.norm.weight"],
        # Checkpoints saved with tied embeddings carry no lm_head; Llama 3.1 8B is untied, so require it.
        "head.weight": state_dict["lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _HF_SAME.items():
            out[ours + a] = state_dict[hf + b]
        q = state_dict[hf + "self_attn.q_proj.weight"].view(kv, g, hd, cfg.dim)
        k = state_dict[hf + "self_attn.k_proj.weight"].view(kv, 1, hd, cfg.dim)
        v = state_dict[hf + "self_attn.v_proj.weight"].view(kv, 1, hd, cfg.dim)
        out[ours + "attn.qkv.weight"] = torch.cat((q, k, v), dim=1).reshape(-1, cfg.dim)
        out[ours + "ffn.fc1.weight"] = torch.cat(
            (state_dict[hf + "mlp.gate_proj.weight"], state_dict[hf + "mlp.up_proj.weight"]), dim=0
        )
    return out
