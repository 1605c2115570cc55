"""The deepseek_v3 family's configuration: `DeepSeekV3Config` and DeepSeek-V3's own sizes."""

from __future__ import annotations

from dataclasses import dataclass

from timetotrain.models.common.layers import YarnScaling


@dataclass
class DeepSeekV3Config:
    dim: int
    n_layers: int
    n_heads: int
    q_lora_rank: int | None  # None: a plain `dim -> H x (nope + rope)` query projection
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    ffn_dim: int  # the dense layers' SwiGLU
    n_experts: int
    top_k: int
    expert_ffn_dim: int
    n_groups: int
    topk_groups: int
    first_dense: int
    vocab_size: int
    max_seq_len: int
    n_shared_experts: int = 1
    routed_scaling: float = 2.5
    bias_rate: float = 1e-3
    aux_loss_coeff: float = 0.01
    mtp_layers: int = 1
    mtp_loss_weight: float = 0.1
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: YarnScaling | None = None
    init_std: float = 0.006

    def __post_init__(self) -> None:
        if self.qk_rope_dim % 2:
            raise ValueError(f"RoPE needs an even qk_rope_dim, got {self.qk_rope_dim}")
        if not 0 <= self.first_dense <= self.n_layers:
            raise ValueError(f"first_dense {self.first_dense} must be in [0, n_layers={self.n_layers}]")
        if self.n_experts % self.n_groups:
            raise ValueError(f"n_experts {self.n_experts} is not a multiple of n_groups {self.n_groups}")
        if not 1 <= self.top_k <= self.topk_groups * (self.n_experts // self.n_groups):
            raise ValueError(f"top_k {self.top_k} does not fit in {self.topk_groups} expert groups")

    @property
    def head_dim(self) -> int:
        # What the shared decoder sizes its RoPE tables by: only the rope part of a head rotates.
        return self.qk_rope_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    def softmax_scale(self) -> float:
        if self.rope_scaling is None:
            return self.qk_head_dim**-0.5
        return self.rope_scaling.softmax_scale(self.qk_head_dim)

    def is_moe(self, layer: int) -> bool:
        """Whether 0-indexed `layer` has experts; MTP blocks count as layers `n_layers`, `n_layers + 1`, ..."""
        return layer >= self.first_dense


# HF `deepseek-ai/DeepSeek-V3` config.json, as Megatron-Bridge maps it; the vocabulary is the
# Llama 3.1 tokenizer's padded to 129,280 rows.
DEEPSEEK_V3 = DeepSeekV3Config(
    dim=7168,
    n_layers=61,
    n_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_head_dim=128,
    ffn_dim=18432,
    n_experts=256,
    top_k=8,
    expert_ffn_dim=2048,
    n_groups=8,
    topk_groups=4,
    first_dense=3,
    vocab_size=129_280,
    max_seq_len=4096,
    n_shared_experts=1,
    routed_scaling=2.5,
    bias_rate=1e-3,
    aux_loss_coeff=0.01,
    mtp_layers=1,
    mtp_loss_weight=0.1,
    norm_eps=1e-6,
    rope_theta=10_000.0,
    rope_scaling=YarnScaling(
        factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
    init_std=0.006,
)
