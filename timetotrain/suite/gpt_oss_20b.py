"""gpt_oss_20b: a GPT-OSS-20B-shaped mixture-of-experts model pretrained from scratch on C4 (spec §7).

Not the Hugging Face GPT-OSS model: see models/moe.py for the architecture and every reading of an
"unconfirmed" item of the spec.
"""

from __future__ import annotations

import statistics

from timetotrain.models.moe import GPT_OSS_20B, GptOss, MoEConfig, flops_per_token, init_weights
from timetotrain.suite.base import Benchmark, Tier
from timetotrain.suite.c4_llm import CLOSED_ADAMW, reference_tier, synthetic_batch, tiny_tier

# GBS -> (base LR, warmup steps) of the 6.0 RCPs (spec §5.1).
RCP_HPARAMS = {16: (4e-4, 128), 32: (8e-4, 128), 64: (1e-3, 192)}

# 6.0 exception for the end LR: every RCP used 4e-5 (a reference bug); the rules allow it besides 0.1 x base.
# Micro-batch 2 as in the RCP runs.
REFERENCE = reference_tier(
    GPT_OSS_20B, micro_batch_size=2, lr=4e-4, end_lr=4e-5, warmup_steps=128, target=3.34
)

# Tiny: the same family (all-MoE layers, top-k softmax-after-selection router, dropless SwiGLU experts,
# QK-norm, alternating sliding-window/full attention with a 128-token window, plain RoPE 150k, Megatron init
# and warmup, EOD loss mask) at d=128, 2 layers, 8 experts top-2.
TINY_MODEL = MoEConfig(
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    n_experts=8,
    top_k=2,
    expert_ffn_dim=192,
    vocab_size=4096,
    max_seq_len=256,
)

TINY = tiny_tier(TINY_MODEL, target=4.8)


def build_model(tier: Tier) -> GptOss:
    return GptOss(tier.model)


def flops_per_sample(tier: Tier) -> float:
    # Active parameters only (top-k experts); windowed layers count only their band of attention.
    return tier.seq_len * flops_per_token(tier.model, tier.seq_len, causal=True)


def telemetry(model: GptOss) -> tuple[dict, str]:
    """Tokens routed to each expert in the last training forward: per layer, and the load spread."""
    per_layer = model.tokens_per_expert().tolist()
    totals = [sum(col) for col in zip(*per_layer, strict=True)]
    mean = statistics.fmean(totals)
    cv = statistics.pstdev(totals) / mean if mean else 0.0
    figures = {
        "ttt_tokens_per_expert": per_layer,
        "ttt_expert_load": {"min": min(totals), "max": max(totals), "cv": cv},
    }
    return figures, f"  experts min {min(totals)} max {max(totals)} CV {cv:.2f}"


BENCHMARK = Benchmark(
    name="gpt_oss_20b",
    area="Small LLM MoE pretraining",
    metric="validation log-perplexity (mean cross-entropy), lower is better",
    tiers={"reference": REFERENCE, "tiny": TINY},
    fixed_hparams=CLOSED_ADAMW,
    schedule_rule="megatron",
    build_model=build_model,
    init_model=init_weights,
    synthetic_batch=synthetic_batch,
    flops_per_sample=flops_per_sample,
    rcp_hparams=RCP_HPARAMS,
    closed_rules=("training_6.0.0/closed_common.yaml", "training_6.0.0/closed_gpt_oss_20b.yaml"),
    eod_mask_loss=True,
    telemetry=telemetry,
)
