"""llama2_70b_lora: LoRA fine-tuning of Llama 2 70B on SCROLLS GovReport (MLPerf Training 6.0).

The frozen base is loaded with `ttt run --init-checkpoint` (MLCommons' fused-qkv layout or the stock
Hugging Face one, models/llama_hf.py); rank-16 adapters on the fused QKV and the output projection of every
layer train (train/lora.py); data from `ttt data prepare govreport` (data/govreport.py).

Only the reference tier exists so far: the tiny tier (a small Llama-2-vocabulary base pretrained on the
shared C4 sample, LoRA-tuned on the shared GovReport rows) is still to come, and with it the rule file and
RCP of our own. `ttt synth llama2_70b_lora --tier reference --layers N` measures fine-tuning throughput
without data or checkpoint.
"""

from __future__ import annotations

from timetotrain.models.llama import FAMILY, LLAMA2_70B
from timetotrain.suite.base import Benchmark, EndLRRule, Optimizer, RcpHparams, Tier
from timetotrain.tasks.lora_sft import LoRAData, LoRAFineTune

# GBS -> base LR and warmup steps of the 6.0 RCPs: warmup ratio 0 everywhere.
RCP_HPARAMS = {
    8: RcpHparams(4e-4, 0),
    16: RcpHparams(4e-4, 0),
    32: RcpHparams(4e-4, 0),
    128: RcpHparams(1e-3, 0),
}

# HF `adamw_torch` defaults for betas/eps; weight decay 1e-4 and clipping 0.3 are fixed by the rules. Only
# the 2-D adapters train, so the Megatron mask (no decay on 1-D tensors) decays exactly what HF decays.
ADAMW = Optimizer(
    name="adamw", betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4, clip=0.3, decay_mask="megatron"
)

REFERENCE = Tier(
    name="reference",
    model=LLAMA2_70B,
    # 3,901 training rows is the commonly cited size of MLCommons' preprocessed train split (unconfirmed;
    # the log reports rows, as the reference does); 173 validation rows are evaluated whole.
    data=LoRAData(block=8192, train_samples=3901),
    global_batch_size=8,
    micro_batch_size=1,
    lr=4e-4,
    end_lr=0.0,  # HF cosine decays to 0
    warmup_steps=0,
    max_steps=1024,
    eval_every_samples=384,
    eval_samples=173,
    target=0.925,
    runs=10,
    division="closed",
    description="MLPerf Training 6.0 closed configuration",
)

BENCHMARK = Benchmark(
    name="llama2_70b_lora",
    area="LLM fine-tuning",
    task=LoRAFineTune(),
    family=FAMILY,
    tiers={"reference": REFERENCE},
    optimizer=ADAMW,
    schedule="hf_cosine",
    closed_rules=("training_6.0.0/closed_common.yaml", "training_6.0.0/closed_llama2_70b_lora.yaml"),
    rcp_hparams=RCP_HPARAMS,
    end_lr_rule=EndLRRule(0.0),  # the HF cosine decays to 0
)
