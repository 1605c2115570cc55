"""llama31_405b: continued pretraining of Llama 3.1 405B on C4 tokenized with the Mixtral 8x22B tokenizer
(MLPerf Training 6.0; docs/benchmarks/llama31_405b.md).

The run starts from Meta's checkpoint (`ttt run --init-checkpoint`, Hugging Face safetensors layout) with the
embedding and LM head cut to the first 32,768 rows; the optimizer starts fresh (`init_checkpoint_step` 0).
Training draws from `c4-train.en_6` and `c4-train.en_7` blended 50/50 as megatron-core's BlendedDataset does;
evaluation is the first ceil(5,760 / GBS) global batches of validation windows in document order (5,760 at
GBS 1,152, 6,912 at 2,304, 9,216 at 4,608; `eval_samples` logs 5,760), every 18,432 samples, after skipping
the first floor(0.0026 GBS + 12) evaluations.

The rules fix every hyperparameter as a function of the GBS (no borrowing): base LR 8e-5 * GBS / 1152 (the
closed rule file compares `lr * 1152 == GBS * 8e-5` with exact float equality, `closed_lr`), warmup
ceil(8000 * 1152 / GBS) steps, schedule length ceil(1.2 M * 1152 / GBS) steps, end LR 8e-7.
"""

from __future__ import annotations

import math

from timetotrain.models.llama import FAMILY, LLAMA31_405B, LlamaConfig
from timetotrain.spec.benchmark import Benchmark, EndLRRule, ShippedBase, Tier, base_recipe
from timetotrain.suite.c4_llm import CLOSED_ADAMW
from timetotrain.suite.c4_llm import TRAIN_PREFIXES as OUR_TRAIN
from timetotrain.suite.c4_llm import VAL_PREFIXES as OUR_VAL
from timetotrain.tasks.causal_lm import CausalLM, LMData

REFERENCE_GBS = 1152
BASE_LR = 8e-5  # at REFERENCE_GBS
END_LR = 8e-7
WARMUP_STEPS = 8000  # warmup steps at REFERENCE_GBS
SCHEDULE_STEPS = 1_200_000  # schedule steps at REFERENCE_GBS
EVAL_EVERY = 18_432
EVAL_SAMPLES = 5760  # logged; evaluated as ceil(5760 / GBS) global batches (pretrain_llama31.py line 359)
SKIP_EVALS = (0.0026, 12.0)  # skip floor(0.0026 * GBS + 12) evaluations

# MLCommons' preprocessed Mixtral C4 (mixtral-8x22b-preprocessed-c4-dataset) names; ours
# (`ttt data prepare c4 --tokenizer mixtral`) writes one training file, which stands for neither shard.
TRAIN_BLEND = (
    (("c4-train.en_6_text_document",), 50.0),
    (("c4-train.en_7_text_document",), 50.0),
)
VAL_PREFIXES = ("c4-validation-91205-samples.en_text_document", "c4-validation_text_document")


def closed_lr(gbs: int) -> float | None:
    """The base LR whose product with 1152 equals GBS * 8e-5 in float arithmetic, as the closed rule file
    checks it. The reference's table rounds 8e-5 * GBS / 1152 to 8 decimals; that value is taken when it
    passes, else the quotient itself, else its nearest neighbours. None: no float passes (about 9% of the
    GBS in [1152, 9216], e.g. 1160), so that GBS cannot run in the closed division."""
    want = gbs * 8e-5
    exact = BASE_LR * gbs / REFERENCE_GBS
    candidates = [round(exact, 8), exact]
    up = down = exact
    for _ in range(4):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
        candidates += [up, down]
    for lr in candidates:
        if lr * REFERENCE_GBS == want:
            return lr
    return None


def gbs_hparams(gbs: int) -> dict[str, object]:
    """The Tier fields the rules fix for a GBS: base and end LR, warmup, schedule length. Where no float
    LR passes the closed check, the quotient (the closed rule check then refuses the run, naming the
    LR; the open division takes it)."""
    lr = closed_lr(gbs)
    return {
        "lr": BASE_LR * gbs / REFERENCE_GBS if lr is None else lr,
        "end_lr": END_LR,
        "warmup_steps": math.ceil(WARMUP_STEPS * REFERENCE_GBS / gbs),
        "max_steps": math.ceil(SCHEDULE_STEPS * REFERENCE_GBS / gbs),
    }


REFERENCE = Tier(
    name="reference",
    model=LLAMA31_405B,
    data=LMData(8192, TRAIN_BLEND[0][0], VAL_PREFIXES, tokenizer="mixtral", train_blend=TRAIN_BLEND,
                skip_evals=SKIP_EVALS, eval_whole_batches=True),
    global_batch_size=REFERENCE_GBS,
    micro_batch_size=1,
    **gbs_hparams(REFERENCE_GBS),
    eval_every_samples=EVAL_EVERY,
    eval_samples=EVAL_SAMPLES,
    target=5.6,
    runs=3,
    division="closed",
    description="MLPerf Training 6.0 closed configuration (continued pretraining from the 405B checkpoint)",
)  # fmt: skip

# --- tiny: the same situation scaled down -----------------------------------------------------------------
# A Llama 3.1-architecture base (GQA, RoPE 500k with the 3.1 scaling, SwiGLU, RMSNorm, untied) at width 128,
# 2 layers, pretrained off the clock with the Llama 3 tokenizer (`ttt base llama31_405b --tier tiny`) on the
# shared C4 sample; its vocabulary is the 4,095 most frequent Llama 3 ids plus "other" (as llama31_8b tiny).
TINY_BASE_MODEL = LlamaConfig(
    dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=4096, max_seq_len=256,
    rope_scaling=LLAMA31_405B.rope_scaling,
)  # fmt: skip

TINY_BASE = base_recipe(
    "llama31_405b", task=CausalLM(), family=FAMILY, optimizer=CLOSED_ADAMW, schedule="nemo", seed=0,
    data_hint="C4 tokenized with Llama 3: `ttt data prepare c4`, both splits",
    model=TINY_BASE_MODEL,
    data=LMData(256, OUR_TRAIN, OUR_VAL, tokenizer="llama3", vocab_keep=4095),
    global_batch_size=16, micro_batch_size=16, lr=3e-3, end_lr=3e-4, warmup_steps=20, max_steps=300,
    eval_every_samples=4800, eval_samples=32,
    # Made once by this recipe (2-core Xeon, AVX-512 kernels, 2 threads, torch 2.13.0+cpu) and shipped:
    # runs load these bits on every host (another CPU rounds the recipe into other weights).
    shipped=ShippedBase("llama31_405b-tiny-v1", (
        ("model-00001-of-00002.safetensors", "d3c5aa12359ebd166af0a4cc55110ec7f987e93a15a3cd579efd432efd67c1ca"),
        ("model-00002-of-00002.safetensors", "7633ece7fe8121f627f4fe167d5770af133bb4a0d8be13cce08ea6fe59a8bb3f"),
        ("model.safetensors.index.json", "56edade0167b81645204bf2d9c63030fcb3707ed822808ff15fab62ecbe6572f"),
        ("config.json", "09c1d2bcc3dd5c399c2a5372f587c4ec4d6fae29c5a314bd282a0536793816bb"),
        ("base.json", "dacb26602951b0e06aac3fceb51b50b08354c88779ac2dcbde753c3aa61af2ec"),
        ("vocab_table.npy", "c50d2370311415fdaabc5d645e858df6b5280f4ed9f07c8a3244e9efc433fe35"),
    ), weights="386a0aaec815d55fbc22212e143699a1c975041116a1d5f8dc4ef53f546daaa2"),
)  # fmt: skip

# Continued on C4 tokenized with the Mixtral 8x22B tokenizer, narrowed to its 2,047 most frequent ids plus
# "other": the model keeps the base's first 2,048 embedding and head rows (as the real run keeps Llama 3's
# first 32,768 rows for Mixtral's ids), the skip-first-evals rule (floor(0.0026 * 16 + 12) = 12 intervals of
# 64 samples: the first evaluation at step 48) and unshuffled validation windows.
TINY = Tier(
    name="tiny",
    model=LlamaConfig(**{**TINY_BASE_MODEL.__dict__, "vocab_size": 2048}),
    data=LMData(
        256,
        OUR_TRAIN,
        OUR_VAL,
        tokenizer="mixtral",
        vocab_keep=2047,
        skip_evals=SKIP_EVALS,
        eval_whole_batches=True,
    ),
    global_batch_size=16,
    micro_batch_size=16,
    lr=2e-3,
    end_lr=2e-4,
    warmup_steps=10,
    max_steps=1000,
    eval_every_samples=64,
    eval_samples=64,
    target=4.5,
    runs=10,
    division="open",
    description="2 CPU cores, about 30 s; base pretrained with Llama 3 ids, continued on Mixtral ids",
    base=TINY_BASE,
)

BENCHMARK = Benchmark(
    name="llama31_405b",
    area="LLM pretraining (continued)",
    init_from="Meta's Llama 3.1 405B checkpoint (Hugging Face safetensors; embedding and head cut to 32,768 rows)",
    task=CausalLM(init_checkpoint_step=0, truncate_vocab=True),
    family=FAMILY,
    tiers={"reference": REFERENCE, "tiny": TINY},
    optimizer=CLOSED_ADAMW,
    schedule="nemo",
    closed_rules=("training_6.0.0/closed_common.yaml", "training_6.0.0/closed_llama31_405b.yaml"),
    gbs_hparams=gbs_hparams,
    # 8e-7 is the reference's min LR at every GBS; 0.01 x base is the same value at GBS 1152.
    end_lr_rule=EndLRRule(0.01, also=(END_LR,)),
    # One block of 16,384 width (3.2 B parameters) plus the 32,768-row embedding and head: about 70 GB of
    # fp32 weights, gradients and AdamW moments, which one 80-141 GB GPU holds with an 8k-token micro-batch
    # (estimate, train/memory.py; not measured on a GPU).
    synth_layers={"reference": 1},
)
