"""Llama 3.x decoder (the model of the MLPerf `llama31_8b` and `llama31_405b` benchmarks).

Architecture (docs/benchmarks/llama31_8b.md): pre-norm decoder blocks of RMSNorm -> grouped-query causal
attention with RoPE -> residual, RMSNorm -> SwiGLU FFN -> residual; a final RMSNorm and an untied LM head.
No biases, no dropout. The layers and the stack are the shared ones (`common/layers.py`, `common/decoder.py`, where the
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

import torch

from timetotrain.models.common.decoder import Decoder
from timetotrain.models.common.layers import (
    RMSNORM_SAVED,
    FeedForward,
    attention_matmul_params,
    attention_saved_elements,
)
from timetotrain.models.family import ModelFamily
from timetotrain.models.llama.config import LlamaConfig
from timetotrain.models.llama.hf import hf_export, hf_mapping
from timetotrain.models.llama.parallelize import check_shape, tensor_parallel


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
    tensor_parallel=tensor_parallel,
    tensor_parallel_check=check_shape,
)
