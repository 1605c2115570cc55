"""The prepared one-GPU probe (issue 26), run by bench/gpu_check.sh: each figure is measured in turn and
appended as one JSON line to OUT/records.jsonl the moment it exists, so a run cut short (a lent machine
goes back after ~15 minutes) still reports everything measured before the cut. The items come in order of
what matters most; `--budget-s` skips the rest once the budget is spent (each skip is a record too).

Figures (all bf16 unless named; `ttt synth` on random tokens at the reference width):
  synth      llama31_8b 4 layers: eager and compiled, bf16; float8 tensorwise and rowwise, compiled;
             compiled with cuDNN attention first (TTT_SDPA_PRIORITY, train/sdpa.py);
             depth sweep 2/4/8 layers compiled, a straight line through step time vs layers extrapolated to
             the full depth (32); gpt_oss_20b 2 layers compiled.
  head_loss  the fused head + loss at the 8B shape, fp32-buffer path vs bf16-logits path (bench/head_loss.py).
  attention  SDPA forward + backward per backend (cuDNN, FlashAttention-2, memory-efficient) at the 8B and
             gpt_oss_20b attention shapes (causal, GQA).
  window     gpt_oss_20b's sliding-window layer, forward + backward: the mask path (band blocks, repeated
             K/V) vs torch's native windowed kernel (`varlen_attn`, window (W, 0)), their largest
             differences, and whether the run-time check (`layers.native_window_works`) takes it. CPU
             smoke: the mask path only (torch 2.13 has no CPU kernel), the native side a record saying so.
  moe_cast   the MoE experts' bf16 cast once per step vs once per micro-batch (bench/moe_cast.py) at
             gpt_oss_20b's expert width, 4 micro-batches.
  mxfp8      `--set fp8_recipe=mxfp8` on this device: on sm90 (H200) the one-line refusal (MXFP8 GEMMs
             need 10.0+); on a CPU (smoke) the emulated recipe's synth run.
  compile_coverage  per model family at its tiny config (bench/compile_coverage.py): graphs and graph
             breaks of each kind of block (`torch._dynamo.explain`, bf16), what stays eager outside the
             blocks, and one micro-batch's forward + backward eager vs with every block compiled as
             `--compile` does (inductor, bf16). CPU smoke: the same counts; the times fp32 with the
             `aot_eager` backend (no C++ compile), which says the record runs, not what compile gains.
MFU in two FLOP conventions, both labelled: `mfu_causal` (ours: attention counts the causal half the
kernels compute) and `mfu_full_square` (torchtitan and NeMo <= 25.07: the full T x T square). Float8 runs
are reported against the dense bf16 peak ("bf16-equivalent MFU"), as torchtitan reports them.

`--cpu-smoke`: the same items at toy sizes on the CPU (the tiny tiers, 2 steps, the math SDPA backend), to
show the script runs end to end where no GPU is lent (tests/test_gpu_probe.py runs a subset).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/head_loss.py, a sibling script

# Imported in `main`, after the first record: on a bare machine a missing wheel is then a record, not a
# traceback before any output.
registry = head_loss_bench = moe_cast_bench = compile_coverage_bench = None


class Records:
    def __init__(self, path: Path, budget_s: float):
        self.path, self.t0, self.budget = path, time.monotonic(), budget_s
        path.parent.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def write(self, kind: str, name: str, **fields) -> dict:
        rec = {"kind": kind, "name": name, "t_s": round(time.monotonic() - self.t0, 1), **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        print(json.dumps(rec), flush=True)
        return rec

    def item(self, kind: str, name: str, fn, min_s: float = 0.0):
        """Run one measurement: its record, or a skip (budget) or failure record; never raises."""
        if self.left() < min_s:
            return self.write(kind, name, status="skipped", reason=f"budget: {self.left():.0f} s left")
        try:
            return self.write(kind, name, status="ok", **fn())
        except Exception as e:  # a failed figure is a result too; the probe goes on
            tail = traceback.format_exc().strip().splitlines()[-3:]
            return self.write(kind, name, status="failed", error=f"{type(e).__name__}: {e}"[:400], tail=tail)
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ synth


def synth(bench: str, tier: str, layers: int, *, compile: bool, precision: str, recipe: str | None,
          device: str, steps: int, warmup: int, gbs: int, out: Path) -> dict:  # fmt: skip
    from timetotrain.train.synth import SynthOptions
    from timetotrain.train.synth import synth as run_synth

    sets = [f"global_batch_size={gbs}"] + ([f"fp8_recipe={recipe}"] if recipe else [])
    s = run_synth(
        SynthOptions(
            benchmark=bench, tier=tier, steps=steps, warmup_steps=warmup, logdir=out, sets=sets,
            device=device, precision=precision, compile=compile, layers=layers, seed=1234,
        )
    )  # fmt: skip
    b = registry.get(bench)
    t = dataclasses.replace(b.tier(tier), model=_layered(b, b.tier(tier), layers).model)
    seq = t.data.seq_len
    causal = b.family.flops_per_token(t.model, seq, causal=True)
    full = b.family.flops_per_token(t.model, seq, causal=False)
    return {
        "benchmark": bench, "layers": layers, "compile": compile, "precision": precision, "fp8_recipe": recipe,
        "tokens_per_s": s["tokens_per_s"], "step_p50_s": s["step_time_s"]["p50"],
        "tokens_per_step": gbs * seq, "mfu_causal": s["mfu"], "mfu_full_square": s["mfu"] * full / causal,
        "flops_per_token_causal": causal, "flops_per_token_full_square": full,
        "peak_tflops": s["peak_tflops_per_device"], "peak_source": s.get("peak_source"),
        "peak_memory_gib": s["peak_memory_bytes"] / 2**30,
        "mfu_note": "float8: bf16-equivalent (against the dense bf16 peak)" if precision == "fp8" else "",
    }  # fmt: skip


def _layered(bench, tier, layers):
    from timetotrain.train.synth import with_layers

    return with_layers(bench, tier, layers)


def extrapolate(sweep: list[dict], bench: str, tier: str, full_layers: int) -> dict:
    """Step time = a + b * layers through the sweep (least squares), at `full_layers`: tokens/s and MFU
    (both conventions) of the full-depth model, whose FLOPs per token are its own."""
    pts = [(r["layers"], r["step_p50_s"]) for r in sweep if r.get("status") == "ok"]
    if len(pts) < 2:
        raise RuntimeError(f"need 2 measured depths, have {len(pts)}")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    icpt = my - slope * mx
    step = icpt + slope * full_layers
    tokens = sweep[0]["tokens_per_step"]
    b = registry.get(bench)
    t = _layered(b, b.tier(tier), full_layers)
    seq = t.data.seq_len
    tok_s = tokens / step
    peak = sweep[0]["peak_tflops"] * 1e12
    return {
        "layers": full_layers, "fit": {"intercept_s": icpt, "s_per_layer": slope, "points": pts},
        "tokens_per_s": tok_s,
        "mfu_causal": tok_s * b.family.flops_per_token(t.model, seq, causal=True) / peak,
        "mfu_full_square": tok_s * b.family.flops_per_token(t.model, seq, causal=False) / peak,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------ attention


def attention(
    heads: int, kv: int, head_dim: int, seq: int, backend: str, device: torch.device, reps: int
) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def t(h):
        return torch.randn(1, h, seq, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()

    q, k, v = t(heads), t(kv), t(kv)
    with sdpa_kernel([getattr(SDPBackend, backend)]):

        def once():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
            out.backward(torch.ones_like(out))

        once()  # selection, workspace
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            once()
        if device.type == "cuda":
            torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / reps
    # Forward + backward = 3x the forward's two matmuls; the causal half of the square.
    flops = 3 * 4 * heads * head_dim * seq * seq / 2
    return {"shape": {"heads": heads, "kv_heads": kv, "head_dim": head_dim, "seq": seq}, "backend": backend,
            "fwd_bwd_ms": dt * 1e3, "tflops_causal": flops / dt / 1e12}  # fmt: skip


def window(heads: int, kv: int, head_dim: int, seq: int, W: int, device: torch.device, reps: int) -> dict:
    """The windowed layer's attention, forward + backward, mask path vs native kernel (module docstring)."""
    from timetotrain.models.common import layers

    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def t(h):  # [B, T, H, D], as the attention layer holds q, k, v before its transpose
        return torch.randn(1, seq, h, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()

    q, k, v = t(heads), t(kv), t(kv)
    grp = heads // kv
    n = seq // W
    blocks = layers.band_blocks_mask(n, W, device) if seq >= 4 * W and seq % W == 0 else None
    square = None if blocks is not None else layers.sliding_window_mask(seq, W, device)

    def mask_path():
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        kt, vt = kt.repeat_interleave(grp, 1), vt.repeat_interleave(grp, 1)
        if blocks is not None:
            out = layers.windowed_attention(qt, kt, vt, blocks)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=square)
        return out.transpose(1, 2)

    def native_path():
        return layers.native_windowed_attention(q, k, v, W)

    def timed(fn):
        out = fn()
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            o = fn()
            torch.autograd.grad(o.float().square().sum(), (q, k, v))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps, out.detach(), grads

    rec = {"shape": {"heads": heads, "kv_heads": kv, "head_dim": head_dim, "seq": seq, "window": W},
           "mask_path": "band blocks" if blocks is not None else "[T, T] mask"}  # fmt: skip
    ms, mo, mg = timed(mask_path)
    rec["mask_fwd_bwd_ms"] = ms * 1e3
    rec["native_window_works"] = layers.native_window_works(device, dtype, heads, kv, head_dim)
    if device.type != "cuda" or layers._varlen_attn() is None:
        rec["native"] = "unavailable: torch's varlen_attn has no kernel on " + device.type
        return rec
    ns, no, ng = timed(native_path)
    rec["native_fwd_bwd_ms"] = ns * 1e3
    rec["speedup"] = ms / ns
    rec["max_abs_diff"] = {"out": (no.float() - mo.float()).abs().max().item(),
                           **{f"d{n}": (a.float() - b.float()).abs().max().item()
                              for n, a, b in zip("qkv", ng, mg, strict=True)}}  # fmt: skip
    return rec


def compile_coverage(family: str, device: torch.device) -> dict:
    """One family's record (module docstring): its blocks' graph counts and breaks, then eager vs compiled."""
    cc = compile_coverage_bench
    bench = cc.FAMILIES[family]
    cov = cc.coverage(bench, torch.bfloat16, device.type)
    if device.type == "cuda":
        times = cc.step_times(bench, device.type, torch.bfloat16, batch=2, steps=5, warmup=3)
    else:  # the smoke: fp32, no inductor (its C++ compile would take minutes on a small CPU)
        times = cc.step_times(
            bench, device.type, torch.float32, batch=1, steps=1, warmup=1, backend="aot_eager"
        )
    graphs = sum(b["graphs"] for b in cov["blocks"].values())
    breaks = sum(b["breaks"] for b in cov["blocks"].values())
    return {**cov, "graphs": graphs, "breaks": breaks, **times}


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check_out")
    p.add_argument(
        "--budget-s", type=float, default=480.0, help="skip what is left after this (default 8 min)"
    )
    p.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU: the script end to end")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated kinds to run (synth, head_loss, attention, window, moe_cast, mxfp8, "
        "compile_coverage)",
    )
    p.add_argument(
        "--families", default="", help="compile_coverage: comma-separated model families (default: all)"
    )
    a = p.parse_args(argv)
    out = Path(a.out)
    rec = Records(out / "records.jsonl", a.budget_s)
    smoke = a.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    only = set(filter(None, a.only.split(",")))

    def wanted(kind):
        return not only or kind in only

    try:
        import torchao

        ao = torchao.__version__
    except ImportError:
        ao = None
    global registry, head_loss_bench, moe_cast_bench, compile_coverage_bench
    try:
        import compile_coverage as compile_coverage_bench
        import head_loss as head_loss_bench
        import moe_cast as moe_cast_bench

        from timetotrain.spec import registry
    except ImportError as e:
        rec.write("env", "imports", status="failed", error=f"{e} (add its wheel to bench/wheels)")
        return 1
    rec.write(
        "env", "machine", torch=torch.__version__, cuda=torch.version.cuda, torchao=ao, python=platform.python_version(),
        device=torch.cuda.get_device_name(0) if not smoke else platform.processor() or "cpu",
        capability=list(torch.cuda.get_device_capability(0)) if not smoke else None, cpu_smoke=smoke,
    )  # fmt: skip

    tier = "tiny" if smoke else "reference"
    steps, warmup, gbs = (2, 1, 2) if smoke else (8, 3, 8)
    depths = (1, 2) if smoke else (2, 4, 8)
    base_layers = 2 if smoke else 4
    full = registry.get("llama31_8b").tier(tier).model.n_layers
    common = dict(device=device.type, steps=steps, warmup=warmup, gbs=gbs, out=out / "synth")
    min_synth = 0 if smoke else 45  # seconds a compiled synth needs at least (compile + steps)

    def s(
        name,
        bench="llama31_8b",
        layers=base_layers,
        compile=True,
        precision="bf16",
        recipe=None,
        want="synth",
    ):
        if wanted(want):
            prec = "fp32" if smoke and precision == "bf16" else precision
            if smoke:  # toy sizes on a CPU: fp32 and eager whatever the GPU item is; the name says so
                name = name.replace("_compiled", "") + "_smoke"
            return rec.item(
                "synth", name,
                lambda: synth(bench, tier, layers, compile=compile and not smoke, precision=prec, recipe=recipe, **common),
                min_synth,
            )  # fmt: skip
        return None

    # Most wanted first: a cut-short run keeps these.
    results = {}
    results[base_layers] = s(f"llama8b_{base_layers}L_compiled")
    s(f"llama8b_{base_layers}L_fp8_tensorwise_compiled", precision="fp8", recipe="tensorwise")
    if not smoke:  # CPU rowwise float8 GEMMs are a reference kernel: minutes at the tiny shape
        s(f"llama8b_{base_layers}L_fp8_rowwise_compiled", precision="fp8", recipe="rowwise")
    s(f"llama8b_{base_layers}L_eager", compile=False)
    if wanted("synth") and not smoke:  # the SDPA order setting (train/sdpa.py): cuDNN first vs torch's order
        os.environ["TTT_SDPA_PRIORITY"] = "cudnn,flash,efficient,math"
        try:
            s(f"llama8b_{base_layers}L_compiled_cudnn_first")
        finally:
            del os.environ["TTT_SDPA_PRIORITY"]
    if wanted("head_loss"):
        shape = (512, 128, 4096) if smoke else (8192, 4096, 128256)
        rec.item(
            "head_loss", "8b_shape", lambda: head_loss_bench.measure(*shape, device, reps=2 if smoke else 5)
        )
    if wanted("attention"):
        backends = ("MATH",) if smoke else ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
        shapes = {"llama31_8b": "llama31_8b", "gpt_oss_20b": "gpt_oss_20b"}
        for label, bench in shapes.items():
            cfg = registry.get(bench).tier(tier).model
            seq = 256 if smoke else registry.get(bench).tier(tier).data.seq_len
            for backend in backends:
                rec.item(
                    "attention", f"{label}_{backend.lower()}",
                    lambda cfg=cfg, seq=seq, backend=backend: attention(
                        cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, seq, backend, device, 2 if smoke else 10
                    ),
                )  # fmt: skip
    if wanted("window"):
        cfg = registry.get("gpt_oss_20b").tier(tier).model
        seq = 256 if smoke else registry.get("gpt_oss_20b").tier(tier).data.seq_len
        W = 32 if smoke else cfg.sliding_window
        rec.item(
            "window", "gptoss20b_window",
            lambda: window(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, seq, W, device, 2 if smoke else 10),
        )  # fmt: skip
    if wanted("moe_cast"):
        shape = (128, 128, 8, 2, 64, 4, 1) if smoke else (2880, 2880, 32, 4, 4096, 4, 1)
        rec.item(
            "moe_cast",
            "gptoss20b_experts",
            lambda: moe_cast_bench.measure(*shape, device, reps=2 if smoke else 3),
        )
    if wanted("mxfp8"):
        if smoke:  # the emulated recipe end to end
            s("llama8b_1L_mxfp8", layers=1, compile=False, precision="fp8", recipe="mxfp8", want="mxfp8")
        else:  # sm90: expected to be the one-line refusal (a failed record holds it)
            s(f"llama8b_{base_layers}L_mxfp8_compiled", precision="fp8", recipe="mxfp8", want="mxfp8")
    for d in depths:
        if d not in results:
            results[d] = s(f"llama8b_{d}L_compiled", layers=d)
    if wanted("synth"):
        sweep = [results[d] for d in depths if results.get(d)]
        rec.item("extrapolated", f"llama8b_{full}L_from_{'_'.join(map(str, depths))}",
                 lambda: extrapolate(sweep, "llama31_8b", tier, full))  # fmt: skip
    if not smoke:  # gpt_oss's MoE on a CPU: float32 grouped GEMM works, but compile/bf16 do not apply here
        s("gptoss20b_2L_compiled", bench="gpt_oss_20b", layers=2)
    else:
        s("gptoss20b_1L_eager", bench="gpt_oss_20b", layers=1, compile=False)
    if wanted("compile_coverage"):
        families = [f for f in a.families.split(",") if f] or list(compile_coverage_bench.FAMILIES)
        for fam in families:
            rec.item(
                "compile_coverage", fam, lambda fam=fam: compile_coverage(fam, device), 0 if smoke else 60
            )
    rec.write("done", "probe", records=str(rec.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
