"""llama31_8b: Llama 3.1 8B pretrained from scratch on C4 (docs/benchmarks/llama31_8b.md)."""

from __future__ import annotations

import dataclasses

from timetotrain.models.llama import FAMILY, LLAMA31_8B, LlamaConfig
from timetotrain.spec.benchmark import Benchmark, EndLRRule, RcpHparams
from timetotrain.suite.c4_llm import CLOSED_ADAMW, reference_tier, tiny_tier
from timetotrain.tasks.causal_lm import CausalLM

# GBS -> base LR and warmup steps of the 6.0 RCPs; their end LR followed the base (NeMo min_lr = 0.1 x
# max_lr). GBS 96's warmup is recorded as "16348" samples (a typo of 16,384 = 170.7 steps); we round up
# to 171 steps.
RCP_HPARAMS = {
    16: RcpHparams(4e-4, 16),
    32: RcpHparams(8e-4, 128),
    64: RcpHparams(8e-4, 96),
    96: RcpHparams(1e-3, 171),
    128: RcpHparams(2e-3, 256),
}

# NeMo min_lr = 0.1 x max_lr. An evaluation reads ceil(1024 / GBS) whole global batches
# (small_llm_pretraining/nemo/pretrain_llama31.py lines 369 and 181, limit_val_batches): 1,056 windows at GBS
# 96, 1,024 at the other RCP sizes; eval_samples logs 1,024. The first evaluation comes where the reference's
# trainer first puts it, before its callback sets the cadence (CausalLM.early_eval_step: step 48 at GBS 16).
_REF = reference_tier(LLAMA31_8B, micro_batch_size=1, lr=4e-4, end_lr=4e-5, warmup_steps=16, target=3.3)
REFERENCE = dataclasses.replace(
    _REF, data=dataclasses.replace(_REF.data, eval_whole_batches=True, nemo_first_val_check=True)
)

# Tiny: the same family (GQA, RoPE 500k with 3.1 scaling, SwiGLU, RMSNorm, untied, Megatron init, AdamW with
# the closed betas/eps/wd/clip, NeMo warmup+cosine) at d=128, 2 layers.
TINY = tiny_tier(
    LlamaConfig(
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        vocab_size=4096,
        max_seq_len=256,
        rope_scaling=LLAMA31_8B.rope_scaling,
    ),
    target=4.8,
)

BENCHMARK = Benchmark(
    name="llama31_8b",
    area="Small LLM pretraining",
    task=CausalLM(init_checkpoint_step=0),
    family=FAMILY,
    tiers={"reference": REFERENCE, "tiny": TINY},
    optimizer=CLOSED_ADAMW,
    schedule="nemo",
    closed_rules=("training_6.0.0/closed_common.yaml", "training_6.0.0/closed_llama31_8b.yaml"),
    rcp_hparams=RCP_HPARAMS,
    end_lr_rule=EndLRRule(0.1),  # training rules: end LR 0.1 x base
)
