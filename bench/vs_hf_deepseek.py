"""Our DeepSeek-V3 training step vs HF transformers' `DeepseekV3ForCausalLM`, side by side in one process.

    python bench/vs_hf_deepseek.py [--reps 5] [--steps 3]

The deepseekv3_671b tiny tier's model family at d 128, 2 layers (1 dense, 1 MoE), 16 experts top-4 in 4
groups, one shared expert, MLA with a query bottleneck, YaRN; 16 sequences of 256 tokens. Same weights (ours
loaded from HF's `save_pretrained` output), same batch, same optimizer (AdamW, Megatron decay mask), loss
and clipping. HF has no MTP and no sequence aux loss, so "ours" runs the same work (no MTP, aux coefficient
0: the step HF computes); "ours, tier" is the tiny tier's own step on top (MTP module + aux loss + the
router bias update), for what the benchmark really pays. Ours runs `train_step` as `ttt run` does; HF runs
as its users run it (logits, fp32 upcast, `F.cross_entropy`). The loops alternate within each repetition so
drift in machine load hits all alike; medians and ratios are printed.

Both run in one process, so they share the allocator: set `MALLOC_TRIM_THRESHOLD_` / `MALLOC_MMAP_THRESHOLD_`
in the environment to see how much of a difference is the cost of page faults on large fresh allocations.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

import torch
from side_by_side import add_common_args, figures, hf_causal_lm_step, peak_for, timed

from timetotrain.models.deepseek_v3 import DeepSeekV3, flops_per_token
from timetotrain.models.deepseek_v3.hf import hf_config_kwargs, hf_mapping
from timetotrain.suite.deepseekv3_671b import TINY
from timetotrain.tasks.causal_lm import lm_loss
from timetotrain.train.checkpoint import load_hf_checkpoint
from timetotrain.train.optim import build_adamw
from timetotrain.train.step import train_step

BATCH, SEQ = 16, 256


def make_step(model, hf: bool, autocast=None):
    opt = build_adamw(model, 1e-4, (0.9, 0.95), 1e-8, 0.1)
    params = list(model.parameters())
    if not hf:

        def loss(m, batch):
            return lm_loss(m, batch["tokens"], None)

        def ours(tokens):
            train_step(model, opt, {"tokens": tokens}, 1, loss, 1.0, params, autocast)
            model.update_router_bias()  # what Training.step does after the optimizer step

        return ours

    return hf_causal_lm_step(model, opt, params, autocast)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "tiny")
    args = ap.parse_args()
    import transformers

    device = torch.device(args.device)
    autocast = torch.bfloat16 if args.bf16 else None
    peak, source = peak_for(device)
    tier_cfg = TINY.model
    same = dataclasses.replace(tier_cfg, mtp_layers=0, aux_loss_coeff=0.0)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**hf_config_kwargs(same), attn_implementation="sdpa")
    )
    ours = DeepSeekV3(same)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        load_hf_checkpoint(ours, tmp, hf_mapping(same))
    tier = DeepSeekV3(tier_cfg)  # the tier's step: its own init, same shapes plus the MTP module
    hf, ours, tier = hf.to(device).train(), ours.to(device).train(), tier.to(device).train()
    tokens = torch.randint(0, same.vocab_size, (BATCH, SEQ + 1)).to(device)
    steps = {"ours": make_step(ours, False, autocast), "tier": make_step(tier, False, autocast)}
    steps["hf"] = make_step(hf, True, autocast)
    for s in steps.values():  # warm-up: allocator, threads, kernels
        s(tokens)
    tps = {k: [] for k in steps}
    tok = BATCH * SEQ * args.steps
    for _ in range(args.reps):
        for k, s in steps.items():
            tps[k].append(tok / timed(s, tokens, args.steps, device))
    med = {k: statistics.median(v) for k, v in tps.items()}
    fig = figures(med["ours"], med["tier"], med["hf"], "hf", flops_per_token(same, SEQ, causal=True), peak)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"{device}, peak {peak / 1e12:.3f} TFLOP/s ({source}); d {same.dim}, L {same.n_layers}, "
        f"{same.n_experts} experts top-{same.top_k}, batch {BATCH} x seq {SEQ}"
    )
    print(f"{'':<34}{'tokens/s':>10}{'vs HF':>8}")
    print(f"{'HF DeepseekV3ForCausalLM':<34}{med['hf']:>10,.0f}{1.0:>7.2f}x")
    print(
        f"{'ours, same work as HF':<34}{med['ours']:>10,.0f}{fig['ratio']:>7.2f}x   MFU {fig['ours_mfu']:.1%}"
    )
    print(f"{'ours, tier step (MTP + aux + bias)':<34}{med['tier']:>10,.0f}{fig['compiled_ratio']:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
