"""What the C4-pretraining LLM benchmarks (llama31_8b, gpt_oss_20b) share: data, closed optimizer
constants, the shape of their tiers, and the synthetic batch."""

from __future__ import annotations

from timetotrain.spec.benchmark import Optimizer, Tier
from timetotrain.tasks.causal_lm import LMData

# Ours (`ttt data prepare c4`) first, then the names of MLCommons' preprocessed dataset, of which the
# references train on group en_6 only (docs/benchmarks/llama31_8b.md, "Data").
TRAIN_PREFIXES = ("c4-train_text_document", "c4-train.en_6_text_document")
VAL_PREFIXES = ("c4-validation_text_document", "c4-validation-91205-samples.en_text_document")

# The closed rules fix these for both benchmarks (closed_llama31_8b.yaml, closed_gpt_oss_20b.yaml); Megatron's
# weight-decay mask (no decay on biases and 1-D tensors).
CLOSED_ADAMW = Optimizer(
    name="adamw",
    betas=(0.9, 0.95),
    eps=1e-05,
    weight_decay=0.1,
    clip=1.0,
    decay_mask="megatron",
    schedule_name="cosine with linear warmup",
)


def reference_tier(model, micro_batch_size: int, lr: float, end_lr: float, warmup_steps: int, target: float):
    """The closed 6.0 configuration: 8,192-token windows, 1.2 M schedule steps, 1,024 eval windows every
    12,288 training samples, 10 runs."""
    return Tier(
        name="reference", model=model, data=LMData(8192, TRAIN_PREFIXES, VAL_PREFIXES), global_batch_size=16,
        micro_batch_size=micro_batch_size, lr=lr, end_lr=end_lr, warmup_steps=warmup_steps, max_steps=1_200_000, eval_every_samples=12_288,
        eval_samples=1024, target=target, runs=10, division="closed",
        description="MLPerf Training 6.0 closed configuration",
    )  # fmt: skip


def tiny_tier(model, target: float):
    """2 CPU cores, minutes: 256-token windows, GBS 16, LR 3e-3 with 20 warm-up steps over a 2,000-step
    schedule, 64 eval windows every 320 samples (20 steps). The vocabulary is narrowed to the 4,095 most
    frequent ids of the prepared training split plus one "other" id (81% of tokens keep their own id):
    with all 128,256 ids the embedding and head would be >90% of the compute and a 2-core run could not
    reach a meaningful loss in minutes. Tokenization still uses the real tokenizer."""
    return Tier(
        name="tiny", model=model, data=LMData(256, TRAIN_PREFIXES, VAL_PREFIXES, vocab_keep=4095),
        global_batch_size=16, micro_batch_size=16, lr=3e-3,
        end_lr=3e-4, warmup_steps=20, max_steps=2000, eval_every_samples=320, eval_samples=64, target=target,
        runs=10, division="open",
        description="2 CPU cores, minutes; shared C4 sample",
    )  # fmt: skip
