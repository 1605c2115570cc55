"""gpt_oss_20b: a GPT-OSS-20B-shaped mixture-of-experts model pretrained from scratch on C4
(docs/benchmarks/gpt_oss_20b.md).

Not the Hugging Face GPT-OSS model: see models/gpt_oss/ for the architecture and every reading of an
unconfirmed detail of the reference.
"""

from __future__ import annotations

import dataclasses

from timetotrain.models.gpt_oss import FAMILY, GPT_OSS_20B, GptOssConfig
from timetotrain.spec.benchmark import Benchmark, EndLRRule, RcpHparams
from timetotrain.suite.c4_llm import CLOSED_ADAMW, reference_tier, tiny_tier
from timetotrain.tasks.causal_lm import CausalLM

# 6.0 exception for the end LR: every RCP used 4e-5 (the yaml default min_lr, a reference bug); the rules
# allow it besides 0.1 x base.
END_LR = 4e-5

# GBS -> base LR and warmup steps of the 6.0 RCPs, and the end LR they all ran with.
RCP_HPARAMS = {
    16: RcpHparams(4e-4, 128, END_LR),
    32: RcpHparams(8e-4, 128, END_LR),
    64: RcpHparams(1e-3, 192, END_LR),
}

# Micro-batch 2 as in the RCP runs. The schedule's decay argument is the default max_steps - warmup:
# Primus sets Megatron's lr_decay_iters to 1,200,000 - W, where the "megatron" rule ends the cosine.
# Primus's config floors the eval interval and the eval batches (config_MI355X_1x8x1.sh:61, :65): at a GBS
# that does not divide 12,288 or 1,024 the reference evaluates every floor(12,288 / GBS) steps on
# floor(1,024 / GBS) global batches (LMData.floor_to_steps); eval_samples still logs 1,024.
_REF = reference_tier(GPT_OSS_20B, micro_batch_size=2, lr=4e-4, end_lr=END_LR, warmup_steps=128, target=3.34)
REFERENCE = dataclasses.replace(_REF, data=dataclasses.replace(_REF.data, floor_to_steps=True))

# Tiny: the same family (all-MoE layers, top-k softmax-after-selection router, dropless SwiGLU experts,
# QK-norm, alternating sliding-window/full attention with a 128-token window, plain RoPE 150k, Megatron init
# and warmup, EOD loss mask) at d=128, 2 layers, 8 experts top-2.
TINY_MODEL = GptOssConfig(
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

# The tiny tier keeps the schedule it was recorded and calibrated with (tests/golden, its RCP): the cosine
# ends at max_steps, so its Megatron decay argument, and the logged decay steps, are max_steps (2,000),
# not the reference's max_steps - W.
TINY = dataclasses.replace(tiny_tier(TINY_MODEL, target=4.8), decay_steps_exclude_warmup=False)

BENCHMARK = Benchmark(
    name="gpt_oss_20b",
    area="Small LLM MoE pretraining",
    task=CausalLM(eod_mask_loss=True, init_checkpoint_step=0),
    family=FAMILY,
    tiers={"reference": REFERENCE, "tiny": TINY},
    optimizer=CLOSED_ADAMW,
    schedule="megatron",
    closed_rules=("training_6.0.0/closed_common.yaml", "training_6.0.0/closed_gpt_oss_20b.yaml"),
    rcp_hparams=RCP_HPARAMS,
    end_lr_rule=EndLRRule(0.1, also=(END_LR,)),
)
