"""Our qwen3_5_moe decoding (`models/qwen3_5_moe/generate.py`) vs HF transformers' `Qwen3_5MoeForCausalLM.generate`,
side by side in one process.

    python bench/vs_hf_qwen_decode.py [--reps 5] [--configs small,medium] [--threads 2]

Same weights (ours loaded from HF's `save_pretrained` output), the same left-padded batch of prompts of
different lengths (a GRPO step's shape: prompts x generations), greedy decoding of `new` tokens with no EOS,
so both generate the same number of tokens. The rows whose tokens are identical are counted: a row can part
where a token's top-k router logits are tied to within fp32 noise (seen once at "medium": a gap of 2.6e-6 between
the 4th and 5th expert, where cached decoding and a full forward, ours and HF's alike, sum in other orders); it
is the same amount of work either way. HF runs as its users run it:
`generate(input_ids, attention_mask, do_sample=False)` with its default cache (a KV cache for the attention
layers, the conv and recurrent states for the DeltaNet layers) and its pure-PyTorch fallbacks (no fla /
causal-conv1d kernels installed, as ours uses none). The two alternate within each repetition so drift in
machine load hits both; medians and their ratio are printed. Tokens/s counts generated tokens only (the
prefill is inside the timing for both).

Both run in one process, so they share the allocator: set `MALLOC_TRIM_THRESHOLD_` / `MALLOC_MMAP_THRESHOLD_`
in the environment to see how much of a difference is the cost of page faults on large fresh allocations.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from timetotrain.models.qwen3_5_moe import Qwen35Moe, Qwen35MoeConfig
from timetotrain.models.qwen3_5_moe.generate import generate
from timetotrain.models.qwen3_5_moe.hf import hf_config_kwargs, hf_mapping
from timetotrain.train.checkpoint import load_hf_checkpoint

CONFIGS = {
    # A tiny-tier-sized Qwen3.5 shape: d 128, 4 layers (3 DeltaNet + 1 attention), 16 experts top-4.
    "small": (
        Qwen35MoeConfig(
            dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, lin_k_heads=2, lin_v_heads=4,
            lin_k_dim=32, lin_v_dim=32, n_experts=16, top_k=4, expert_ffn_dim=64, shared_ffn_dim=128,
            vocab_size=512, max_seq_len=512,
        ),
        16, (8, 40), 64,
    ),
    # d 256, 8 layers, 32 experts top-4; 32 rows (e.g. 4 prompts x 8 generations).
    "medium": (
        Qwen35MoeConfig(
            dim=256, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=32, lin_k_heads=4, lin_v_heads=8,
            lin_k_dim=32, lin_v_dim=32, n_experts=32, top_k=4, expert_ffn_dim=128, shared_ffn_dim=256,
            vocab_size=4096, max_seq_len=1024,
        ),
        32, (16, 96), 128,
    ),
}  # fmt: skip


def bench(name: str, reps: int) -> dict:
    import transformers

    cfg, rows, (lo, hi), new = CONFIGS[name]
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**hf_config_kwargs(cfg)))
    hf = hf.float().eval()
    with torch.no_grad():  # weights large enough that greedy decoding does not settle into one repeated token
        for p in hf.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    ours = Qwen35Moe(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        load_hf_checkpoint(ours, tmp, hf_mapping(cfg))
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(lo, hi + 1, (rows,), generator=g).tolist()
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    P = max(lengths)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = (torch.arange(P).unsqueeze(0) >= torch.tensor([P - n for n in lengths]).unsqueeze(1)).long()

    def run_ours():
        return generate(ours, prompts, max_new_tokens=new, temperature=0.0)[0]

    def run_hf():
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        return out[:, P:].tolist()

    a, b = run_ours(), run_hf()  # warm-up, and the check that both decode the same tokens
    same = f"{sum(x == y for x, y in zip(a, b, strict=True))}/{rows}"
    ours_tps, hf_tps = [], []
    for _ in range(reps):
        for fn, out in ((run_ours, ours_tps), (run_hf, hf_tps)):
            t0 = time.perf_counter()
            fn()
            out.append(rows * new / (time.perf_counter() - t0))
    mo, mh = statistics.median(ours_tps), statistics.median(hf_tps)
    return {
        "config": name,
        "rows": rows,
        "prompt": f"{lo}-{hi}",
        "new": new,
        "ours": mo,
        "hf": mh,
        "same": same,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--configs", default="small,medium")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, cpu"
    )
    print(
        f"{'config':<8}{'rows':>5}{'prompt':>8}{'new':>5}{'ours tok/s':>12}{'HF tok/s':>10}{'ratio':>7}  rows with the same tokens"
    )
    for name in args.configs.split(","):
        r = bench(name, args.reps)
        print(
            f"{r['config']:<8}{r['rows']:>5}{r['prompt']:>8}{r['new']:>5}{r['ours']:>12,.0f}{r['hf']:>10,.0f}"
            f"{r['ours'] / r['hf']:>6.2f}x  {r['same']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
