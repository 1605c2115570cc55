"""The gpt_oss family's configuration: `GptOssConfig` and GPT-OSS 20B's sizes."""

from __future__ import annotations

from dataclasses import dataclass

from timetotrain.models.common.decoder import check_attention_shape


@dataclass
class GptOssConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    # Explicit: the reference has 64 heads of 64 on a 2880-wide model (Q projection 2880 -> 4096).
    head_dim: int
    n_experts: int
    top_k: int
    expert_ffn_dim: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float = 1e-6
    rope_theta: float = 150_000.0
    sliding_window: int = 128
    # Megatron `window_attn_skip_freq` list semantics (1 = windowed), applied cyclically from layer 0.
    window_pattern: tuple[int, ...] = (1, 0)
    qk_norm: bool = True
    init_std: float = 0.008

    def __post_init__(self) -> None:
        check_attention_shape(self.n_heads, self.n_kv_heads, self.head_dim)
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, n_experts={self.n_experts}]")
        if not self.window_pattern:
            raise ValueError("window_pattern must not be empty")
        self.window_pattern = tuple(int(bool(w)) for w in self.window_pattern)

    @property
    def rope_scaling(self) -> None:
        # Plain RoPE (no YaRN), read by the shared decoder.
        return None

    def is_window_layer(self, layer: int) -> bool:
        """Whether 0-indexed `layer` uses the sliding window."""
        return bool(self.window_pattern[layer % len(self.window_pattern)])


GPT_OSS_20B = GptOssConfig(
    dim=2880,
    n_layers=24,
    n_heads=64,
    n_kv_heads=8,
    head_dim=64,
    n_experts=32,
    top_k=4,
    expert_ffn_dim=2880,
    vocab_size=128_256,
    max_seq_len=8192,
    norm_eps=1e-6,
    rope_theta=150_000.0,
    sliding_window=128,
    window_pattern=(1, 0),
    qk_norm=True,
    init_std=0.008,
)
