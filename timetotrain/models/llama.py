"""Llama 3.x decoder (the model of the MLPerf `llama31_8b` and `llama31_405b` benchmarks).

Architecture (docs/benchmarks/llama31_8b.md): pre-norm decoder blocks of RMSNorm -> grouped-query causal
attention with RoPE -> residual, RMSNorm -> SwiGLU FFN -> residual; a final RMSNorm and an untied LM head.
No biases, no dropout. The layers and the stack are the shared ones (`layers.py`, `decoder.py`, where the
fused weight layouts are documented).

Shape facts that set the FLOPs (per token, `L` layers, model width `d`, `H` query / `Hkv` KV heads of
size `hd`, FFN width `f`, vocabulary `V`, sequence `T`):

- matmul weights per layer: `d*(H + 2*Hkv)*hd` (QKV) + `H*hd*d` (output) + `3*d*f` (SwiGLU); plus the LM head
  `d*V`. The embedding is a gather and the norms are element-wise, so neither counts as matmul work.
- attention scores and the weighted sum: `2 * H * hd * T` multiply-adds per token per layer if the full
  `T x T` square is computed; a causal kernel needs only about half of it.
- training FLOPs per token = 6 * (matmul weights) + 12 * L * H * hd * T (see `flops_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from timetotrain.models.decoder import Decoder, check_attention_shape
from timetotrain.models.family import ModelFamily
from timetotrain.models.layers import (
    RMSNORM_SAVED,
    FeedForward,
    RopeScaling,
    attention_matmul_params,
    attention_saved_elements,
)
from timetotrain.models.llama_hf import hf_export, hf_mapping


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
        check_attention_shape(self.n_heads, self.n_kv_heads, self.head_dim)

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


# MLPerf `llama31_405b` (NeMo Llama31Config405B): Meta's Llama 3.1 405B with its embedding and LM head cut to
# the first 32,768 rows, the Mixtral 8x22B vocabulary the benchmark's C4 is tokenized with (docs/benchmarks/
# llama31_405b.md, "Vocabulary").
LLAMA31_405B = LlamaConfig(
    dim=16_384,
    n_layers=126,
    n_heads=128,
    n_kv_heads=8,
    ffn_dim=53_248,
    vocab_size=32_768,
    max_seq_len=8192,
    norm_eps=1e-5,
    rope_theta=500_000.0,
    rope_scaling=LLAMA31_8B.rope_scaling,
)


# The frozen base of the MLPerf `llama2_70b_lora` benchmark: HF `Llama-2-70b-hf`, loaded with
# max_position_embeddings 8192; plain RoPE at theta 10,000, the Llama 2 SentencePiece vocabulary.
LLAMA2_70B = LlamaConfig(
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    ffn_dim=28672,
    vocab_size=32_000,
    max_seq_len=8192,
    norm_eps=1e-5,
    rope_theta=10_000.0,
    rope_scaling=None,
)


class Llama(Decoder):
    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg, lambda layer: FeedForward(cfg.dim, cfg.ffn_dim))


def init_weights(model: Llama, generator: torch.Generator | None = None) -> None:
    """Megatron-Core initialisation (σ = init_std, σ/√(2L) on the residual-output projections)."""
    model.init_weights(generator)


def _layer_matmul_params(cfg: LlamaConfig) -> int:
    attention = attention_matmul_params(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    return attention + 3 * cfg.dim * cfg.ffn_dim


def _matmul_params(cfg: LlamaConfig) -> int:
    return cfg.n_layers * _layer_matmul_params(cfg) + cfg.dim * cfg.vocab_size


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


def activation_elements(cfg: LlamaConfig) -> float:
    """Elements autograd keeps per token for one block (train/memory.py explains the count): RMSNorm keeps
    its input, the normalised values and the weighted output (3h, twice); SDPA keeps rotated q, k, v and its
    output; the output projection its input (h); SwiGLU keeps fc1's output (2f) and fc2 its input (f)."""
    attention = attention_saved_elements(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    return 2 * RMSNORM_SAVED * cfg.dim + attention + 3 * cfg.ffn_dim


FAMILY = ModelFamily(
    name="llama",
    build=Llama,
    init=init_weights,
    param_count=param_count,
    active_param_count=param_count,
    flops_per_token=flops_per_token,
    block_params=lambda cfg: _layer_matmul_params(cfg) + 2 * cfg.dim,
    activation_elements=activation_elements,
    hf_mapping=hf_mapping,
    hf_export=hf_export,
)
