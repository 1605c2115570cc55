"""gpt_oss_20b: a GPT-OSS-20B-shaped mixture-of-experts model pretrained from scratch on C4 (spec §7).

Not the Hugging Face GPT-OSS model: see models/moe.py for the architecture and every reading of an
"unconfirmed" item of the spec.
"""

from __future__ import annotations

import statistics

from timetotrain.models.moe import GPT_OSS_20B, GptOss, MoEConfig, flops_per_token, init_weights
from timetotrain.suite.base import Benchmark, DataSpec, Tier
from timetotrain.suite.llama31_8b import C4_DATA, synthetic_batch

# GBS -> (base LR, warmup steps) of the 6.0 RCPs (spec §5.1).
RCP_HPARAMS = {16: (4e-4, 128), 32: (8e-4, 128), 64: (1e-3, 192)}

REFERENCE = Tier(
    name="reference",
    model=GPT_OSS_20B,
    seq_len=8192,
    global_batch_size=16,
    micro_batch_size=2,  # the RCP runs' micro-batch
    lr=4e-4,
    # 6.0 exception: every RCP used 4e-5 (a reference bug); the rules allow it besides 0.1 x base.
    end_lr=4e-5,
    warmup_steps=128,
    max_steps=1_200_000,
    eval_every_samples=12_288,
    eval_samples=1024,
    target=3.34,
    runs=10,
    division="closed",
    data=C4_DATA,
    description="MLPerf Training 6.0 closed configuration",
)

# Tiny: the same family (all-MoE layers, top-k softmax-after-selection router, dropless SwiGLU experts,
# QK-norm, alternating sliding-window/full attention with a 128-token window, plain RoPE 150k, Megatron init
# and warmup, EOD loss mask) at d=128 over 256-token windows, 8 experts top-2; vocabulary narrowed as in
# llama31_8b's tiny tier (4,095 most frequent training ids + "other").
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

TINY = Tier(
    name="tiny",
    model=TINY_MODEL,
    seq_len=256,
    global_batch_size=16,
    micro_batch_size=16,
    lr=3e-3,
    end_lr=3e-4,
    warmup_steps=20,
    max_steps=2000,
    eval_every_samples=320,
    eval_samples=64,
    target=4.8,
    runs=10,
    division="open",
    data=DataSpec(C4_DATA.train_prefixes, C4_DATA.val_prefixes, vocab_keep=4095),
    description="2 CPU cores, minutes; shared C4 sample",
)


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
    fixed_hparams={
        "opt_name": "adamw",
        "opt_adamw_beta_1": 0.9,
        "opt_adamw_beta_2": 0.95,
        "opt_adamw_epsilon": 1e-05,
        "opt_adamw_weight_decay": 0.1,
        "opt_gradient_clip_norm": 1.0,
        "opt_learning_rate_decay_schedule": "cosine with linear warmup",
    },
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
