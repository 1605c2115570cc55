"""Our Llama training step vs HF transformers' `LlamaForCausalLM`, side by side in one process.

    python bench/vs_hf.py [--reps 5] [--steps 3] [--configs tiny,20m]

Same config, same weights, same batch and sequence, same optimizer (AdamW, Megatron decay mask), same loss
(mean token cross-entropy) and clipping. Ours runs `train_step` exactly as `ttt run` and `ttt synth` do:
the model applies the LM head and the loss together in chunks (`models/common/head_loss.py`) and splits QKV and
SwiGLU with hand-written backward passes (`models/common/fused.py`). HF runs as its users run it: logits out of
the model, upcast to fp32, `F.cross_entropy` (what its causal-LM loss does). The step loops alternate
within each repetition so drift in machine load hits both; medians and their ratio are printed, with our
CPU MFU against a matmul peak measured in the same run. Ours is timed twice: eager, and with its blocks
compiled (`--compile` of `ttt run` / `ttt synth`); HF runs eager, as its Trainer does by default.

Both run in one process, so they share the allocator: set `MALLOC_TRIM_THRESHOLD_` / `MALLOC_MMAP_THRESHOLD_`
in the environment to see how much of a difference is the cost of page faults on large fresh allocations.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from side_by_side import add_common_args, figures, hf_causal_lm_step, peak_for, timed

from timetotrain.models.llama import Llama, LlamaConfig, flops_per_token
from timetotrain.models.llama.hf import hf_config_kwargs, to_hf_state_dict
from timetotrain.suite.llama31_8b import TINY
from timetotrain.suite.llama31_405b import TINY as TINY_405B
from timetotrain.tasks.causal_lm import lm_loss
from timetotrain.train.optim import build_adamw
from timetotrain.train.step import train_step

CONFIGS = {
    # The llama31_8b tiny tier's model and batch.
    "tiny": (TINY.model, 16, 256),
    # The llama31_405b tiny tier's model (Llama 3.1 RoPE scaling, 2,048 Mixtral rows) and batch.
    "405b-tiny": (TINY_405B.model, 16, 256),
    # ~20 M non-embedding parameters: d 512, 8 layers, 8 query / 4 KV heads, FFN 1024, 32k vocabulary.
    "20m": (
        LlamaConfig(
            dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=32_000, max_seq_len=512
        ),
        4,
        512,
    ),
    # GPU: the llama31_8b width and vocabulary with 2 of its layers, 2 sequences of 4,096 tokens.
    "8b-2l": (
        LlamaConfig(
            dim=4096,
            n_layers=2,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            vocab_size=128_256,
            max_seq_len=4096,
        ),
        2,
        4096,
    ),
}


def make_step(model, hf: bool, autocast=None):
    """Ours: `train_step` exactly as `ttt run` / `ttt synth` call it (the model applies head and loss together,
    `models/common/head_loss.py`). HF: the same step written the way HF computes its causal-LM loss (logits upcast to
    fp32, then `F.cross_entropy`), with the same optimizer, clipping and zeroing."""
    opt = build_adamw(model, 1e-4, (0.9, 0.95), 1e-5, 0.1)
    params = [p for p in model.parameters()]
    if not hf:

        def loss(m, batch):
            return lm_loss(m, batch["tokens"], None)

        return lambda tokens: train_step(model, opt, {"tokens": tokens}, 1, loss, 1.0, params, autocast)

    return hf_causal_lm_step(model, opt, params, autocast)


def bench(name: str, reps: int, steps: int, peak: float, device, autocast=None, compile=True) -> dict:
    import transformers

    cfg, batch, seq = CONFIGS[name]
    torch.manual_seed(0)
    ours = Llama(cfg).to(device)
    compiled = Llama(cfg).to(device)
    compiled.load_state_dict(ours.state_dict())
    for block in compiled.layers:  # what `ttt run/synth --compile` does
        block.compile()
    hf_cfg = transformers.LlamaConfig(**hf_config_kwargs(cfg), attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(hf_cfg).to(device)
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg), strict=False)
    n_params = sum(p.numel() for p in ours.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1)).to(device)
    step_ours = make_step(ours, False, autocast)
    step_comp = make_step(compiled, False, autocast) if compile else step_ours
    step_hf = make_step(hf, True, autocast)
    for s in (step_ours, step_comp, step_comp, step_hf):  # warm-up: allocator, threads, kernels, compilation
        s(tokens)
    tok = batch * seq * steps
    ours_tps, comp_tps, hf_tps = [], [], []
    for _ in range(reps):
        ours_tps.append(tok / timed(step_ours, tokens, steps, device))
        comp_tps.append(tok / timed(step_comp, tokens, steps, device))
        hf_tps.append(tok / timed(step_hf, tokens, steps, device))
    mo, mc, mh = statistics.median(ours_tps), statistics.median(comp_tps), statistics.median(hf_tps)
    flops = flops_per_token(cfg, seq, causal=True)
    return {
        "config": name,
        "params": n_params,
        "batch": batch,
        "seq": seq,
        **figures(mo, mc, mh, "hf", flops, peak),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "8b-2l")
    ap.add_argument("--configs", default="tiny,20m")
    args = ap.parse_args()
    import transformers

    device = torch.device(args.device)
    peak, source = peak_for(device)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"{device}, peak {peak / 1e12:.3f} TFLOP/s ({source})"
    )
    print(
        f"{'config':<7}{'params':>12}{'batch x seq':>13}{'ours tok/s':>12}{'compiled':>10}{'HF tok/s':>10}"
        f"{'ratio':>7}{'compiled':>9}{'our MFU':>9}{'compiled':>9}"
    )
    for name in args.configs.split(","):
        r = bench(
            name,
            args.reps,
            args.steps,
            peak,
            device,
            torch.bfloat16 if args.bf16 else None,
            not args.no_compile,
        )
        print(
            f"{r['config']:<7}{r['params']:>12,}{r['batch']:>7} x {r['seq']:<4}{r['ours_tokens_per_s']:>12,.0f}"
            f"{r['compiled_tokens_per_s']:>10,.0f}{r['hf_tokens_per_s']:>10,.0f}{r['ratio']:>6.2f}x"
            f"{r['compiled_ratio']:>8.2f}x{r['ours_mfu']:>9.1%}{r['compiled_mfu']:>9.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
