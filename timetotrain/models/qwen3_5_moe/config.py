"""The qwen3_5_moe family's configuration: `Qwen35MoeConfig` and Qwen3.5-397B-A17B's sizes."""

from __future__ import annotations

from dataclasses import dataclass

from timetotrain.models.common.decoder import check_attention_shape


@dataclass
class Qwen35MoeConfig:
    dim: int
    n_layers: int
    # Gated full attention (every `full_attention_interval`-th layer).
    n_heads: int
    n_kv_heads: int
    head_dim: int
    # Gated DeltaNet linear attention (the other layers): key heads serve `lin_v_heads // lin_k_heads` value heads.
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    # MoE in every layer: `n_experts` routed SwiGLU experts (top_k used) plus one gated shared expert.
    n_experts: int
    top_k: int
    expert_ffn_dim: int
    shared_ffn_dim: int
    vocab_size: int
    max_seq_len: int
    conv_kernel: int = 4
    full_attention_interval: int = 4
    partial_rotary: float = 0.25
    norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        check_attention_shape(self.n_heads, self.n_kv_heads, self.head_dim)
        if self.rope_dim < 2 or self.rope_dim % 2:
            raise ValueError(
                f"partial RoPE needs an even rotary width, got {self.rope_dim} of {self.head_dim}"
            )
        if self.lin_v_heads % self.lin_k_heads:
            raise ValueError(
                f"lin_v_heads {self.lin_v_heads} is not a multiple of lin_k_heads {self.lin_k_heads}"
            )
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.full_attention_interval < 1 or self.conv_kernel < 1:
            raise ValueError("full_attention_interval and conv_kernel must be at least 1")

    @property
    def rope_dim(self) -> int:
        """The rotated leading dimensions of each query/key head (HF: `int(head_dim * partial_rotary_factor)`)."""
        return int(self.head_dim * self.partial_rotary)

    @property
    def conv_dim(self) -> int:
        """Channels of the short causal convolution: the linear layer's q, k and v side by side."""
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def is_full_attention(self, layer: int) -> bool:
        """HF `layer_types`: layer i (0-indexed) is full attention iff (i + 1) is a multiple of the interval."""
        return (layer + 1) % self.full_attention_interval == 0

    def n_full_layers(self) -> int:
        return sum(self.is_full_attention(i) for i in range(self.n_layers))


# Qwen3.5-397B-A17B's text model. Sources (the HF hub config.json is not reachable here):
# - dim 4096, 60 layers, 32 heads / 2 KV heads of 256, vocab 248,320, 512 experts top-10, expert and shared-expert
#   FFN 1024, RoPE base 1e7 over 25% of each head, 1-centred RMSNorm eps 1e-6, untied head: THUDM/slime
#   `scripts/models/qwen3.5-397B-A17B.sh` (Megatron arguments for this checkpoint);
# - Gated DeltaNet 16 key heads / 64 value heads of 128, conv kernel 4, full attention every 4th layer, context
#   262,144: the config fixtures of Megatron-Bridge's Qwen3.5-397B-A17B bridge test and two independent ports
#   quoting the hub config; conv kernel 4, interval 4 and partial 0.25 are also transformers 5.24's defaults.
# - init_std 0.02: HF `initializer_range` (only used for a from-scratch build; the benchmark loads the checkpoint).
QWEN35_397B = Qwen35MoeConfig(
    dim=4096,
    n_layers=60,
    n_heads=32,
    n_kv_heads=2,
    head_dim=256,
    lin_k_heads=16,
    lin_v_heads=64,
    lin_k_dim=128,
    lin_v_dim=128,
    n_experts=512,
    top_k=10,
    expert_ffn_dim=1024,
    shared_ffn_dim=1024,
    vocab_size=248_320,
    max_seq_len=262_144,
    conv_kernel=4,
    full_attention_interval=4,
    partial_rotary=0.25,
    norm_eps=1e-6,
    rope_theta=10_000_000.0,
    init_std=0.02,
)
