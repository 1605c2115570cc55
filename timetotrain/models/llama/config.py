"""The llama family's configuration: `LlamaConfig` and the sizes of the benchmarks built on it."""

from __future__ import annotations

from dataclasses import dataclass

from timetotrain.models.common.decoder import check_attention_shape
from timetotrain.models.common.layers import RopeScaling


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
