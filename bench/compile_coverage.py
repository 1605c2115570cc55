"""What `--compile` compiles of each model family, and what stays eager (issue 26).

`--compile` compiles each block of `model.layers` (train/parallel.py); the rest of the step runs eager.
For each family at its tiny config this script runs one training micro-batch, captures the inputs of every
distinct kind of block (attention type, dense or MoE FFN, window), and asks `torch._dynamo.explain` how
each compiles: its graphs, graph breaks and their reasons. The eager rest is named from the model's own
children outside `layers` (embedding, final norm, head and its fused loss; DeepSeek's MTP modules; flux's
input and output projections).

    python bench/compile_coverage.py                      # the table, bf16 autocast and fp32, on the CPU
    python bench/compile_coverage.py --device cuda --time # plus eager vs compiled step time per family

Tracing needs no GPU: what breaks a graph is decided by Python and by the ops' meta kernels, which are the
same on every device, except where a kernel's support differs by build (the grouped GEMM, below), which is
why both precisions are listed. bench/gpu_probe.py's `compile_coverage` record runs `coverage` and
`step_times` on the GPU; tests/test_compile_coverage.py pins the counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

from timetotrain.spec import registry  # noqa: E402

# One benchmark per model family (its tiny tier is the config traced).
FAMILIES = {
    "llama": "llama31_8b",
    "gpt_oss": "gpt_oss_20b",
    "deepseek_v3": "deepseekv3_671b",
    "qwen3_5_moe": "qwen35_397b_grpo",
    "flux": "flux1",
}


def kind(block: torch.nn.Module) -> str:
    """A block's kind: its class, its attention class, a MoE FFN, a sliding window."""
    parts = [type(block).__name__]
    for attr in ("attn", "mixer"):
        if hasattr(block, attr):
            parts.append(type(getattr(block, attr)).__name__)
    ffn = getattr(block, "ffn", None)
    if ffn is not None:
        parts.append(type(ffn).__name__)
    if getattr(block, "window", None) is not None:
        parts.append(f"window {block.window}")
    return "/".join(parts)


def setup(bench_name: str, device: torch.device, batch: int, seed: int = 0):
    """(the family's model at the tiny config, `loss(model)`: a training micro-batch's loss on random data).
    GRPO (on-policy) takes the token cross-entropy of its random tokens instead of its policy loss: before
    rollouts that loss has no gradient, and the blocks see the same inputs either way."""
    b = registry.get(bench_name)
    tier = b.tier("tiny")
    torch.manual_seed(seed)
    model = b.family.build(tier.model).to(device)
    data = b.task.synthetic(tier, batch, torch.Generator(device=device).manual_seed(seed + 1), device)
    mb = data.batch(0)
    if b.task.on_policy:
        tokens = mb["tokens"]
        return model, lambda m: m(tokens[:, :-1], labels=tokens[:, 1:])
    return model, lambda m: data.loss(m, mb)


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def coverage(bench_name: str, dtype: torch.dtype = torch.bfloat16, device="cpu", batch: int = 1,
             kinds: set[str] | None = None) -> dict:  # fmt: skip
    """Per kind of block (all, or those in `kinds`): graphs, graph breaks and their reasons under
    `torch._dynamo.explain`, for one training micro-batch under `dtype` autocast (fp32: none); and the
    model's children that stay eager."""
    import torch._dynamo as dynamo

    device = torch.device(device)
    model, loss = setup(bench_name, device, batch)
    calls: dict[str, tuple] = {}

    def hook(block, args, kwargs):
        calls.setdefault(kind(block), (block, args, kwargs))

    handles = [blk.register_forward_pre_hook(hook, with_kwargs=True) for blk in model.layers]
    with _autocast(device, dtype):
        loss(model)
    for h in handles:
        h.remove()
    blocks = {}
    for name, (block, args, kwargs) in calls.items():
        if kinds is not None and name not in kinds:
            continue
        dynamo.reset()
        with _autocast(device, dtype):
            e = dynamo.explain(block)(*args, **kwargs)
        reasons = sorted({_reason(r) for r in e.break_reasons})
        blocks[name] = {"graphs": e.graph_count, "breaks": e.graph_break_count, "reasons": reasons}
    dynamo.reset()
    eager = [n for n, _ in model.named_children() if n != "layers"]
    return {"benchmark": bench_name, "precision": _name(dtype), "blocks": blocks, "eager_outside": eager}


def _reason(r) -> str:
    where = r.user_stack[-1] if r.user_stack else None
    at = f" at {Path(where.filename).name}:{where.lineno} ({where.name})" if where else ""
    return r.reason.strip().splitlines()[0][:160] + at


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def step_times(bench_name: str, device="cuda", dtype=torch.bfloat16, batch: int = 2, steps: int = 5,
               warmup: int = 2, backend: str = "inductor") -> dict:  # fmt: skip
    """Forward + backward time of one micro-batch at the tiny config, eager and with every block compiled
    as `--compile` does (`block.compile()`, here with `backend`), median of `steps` after `warmup`; and the
    largest difference of the loss between the two (bf16: a compiled graph rounds differently)."""
    device = torch.device(device)
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model, loss_of = setup(bench_name, device, batch)
        if compiled:
            for block in model.layers:
                block.compile(backend=backend)
        times, loss = [], None
        for i in range(warmup + steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with _autocast(device, dtype):
                loss = loss_of(model)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out["compiled" if compiled else "eager"] = (statistics.median(times), loss.item())
    (te, le), (tc, lc) = out["eager"], out["compiled"]
    return {"eager_step_s": te, "compiled_step_s": tc, "speedup": te / tc, "backend": backend,
            "loss_abs_diff": abs(le - lc), "batch": batch, "precision": _name(dtype)}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--time", action="store_true", help="also eager vs compiled step time per family")
    a = p.parse_args(argv)
    print(f"{'family':<12} {'precision':<9} {'block':<40} graphs breaks  reasons")
    for fam, bench in FAMILIES.items():
        for dtype in (torch.bfloat16, torch.float32):
            c = coverage(bench, dtype, a.device)
            for blk, r in c["blocks"].items():
                print(f"{fam:<12} {c['precision']:<9} {blk:<40} {r['graphs']:>6} {r['breaks']:>6}  "
                      + "; ".join(r["reasons"]))  # fmt: skip
        print(f"{fam:<12} eager outside the blocks: {', '.join(c['eager_outside'])}")
        if a.time:
            print(f"{fam:<12} {step_times(bench, a.device)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
