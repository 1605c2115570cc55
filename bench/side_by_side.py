"""What the side-by-side step benchmarks (`vs_hf.py`, `vs_peft.py`) share: the timing loop, the flags, the
peak a MFU is measured against, and the figures of one config, so the two report alike."""

from __future__ import annotations

import statistics
import time

import torch

from timetotrain.train.peak import measure_cpu_peak


def timed(step, batch, n: int, device: torch.device) -> float:
    """Seconds for `n` calls of `step(batch)`, the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def alternate(first, second, batch, samples: int, reps: int, steps: int, device: torch.device):
    """Median samples/s of `first(batch)` and `second(batch)` (each a step of `samples` samples): both warmed
    up twice (allocator, optimizer state), then timed in turn `reps` times, `steps` steps each, so drifting
    load and allocator state hit both."""
    for s in (first, second, first, second):
        s(batch)
    a, b = [], []
    for _ in range(reps):
        a.append(samples * steps / timed(first, batch, steps, device))
        b.append(samples * steps / timed(second, batch, steps, device))
    return statistics.median(a), statistics.median(b)


def add_common_args(ap, gpu_config: str) -> None:
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed repetition")
    ap.add_argument(
        "--device", default="cpu", help=f"cpu, or cuda (then also try --configs {gpu_config} --bf16)"
    )
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for both, fp32 weights and optimizer")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variant (saves its warm-up)")


def peak_for(device: torch.device) -> tuple[float, str]:
    """The datasheet peak of a known GPU; on a CPU an fp32 matmul peak measured now, in the same run."""
    if device.type == "cuda":
        from timetotrain.train.peak import accelerator_peak

        return accelerator_peak(torch.cuda.get_device_name(device)) or (float("nan"), "unknown GPU")
    return measure_cpu_peak(seconds=1.0), "measured fp32 matmul peak"


def figures(ours: float, compiled: float, peer: float, peer_name: str, flops: float, peak: float) -> dict:
    """Tokens/s of ours (eager, compiled) and of the peer, their ratios and MFUs."""
    return {
        "ours_tokens_per_s": ours,
        "compiled_tokens_per_s": compiled,
        f"{peer_name}_tokens_per_s": peer,
        "ratio": ours / peer,
        "compiled_ratio": compiled / peer,
        "ours_mfu": ours * flops / peak,
        "compiled_mfu": compiled * flops / peak,
        f"{peer_name}_mfu": peer * flops / peak,
    }


def hf_causal_lm_step(model, opt, params, autocast=None):
    """A Hugging Face causal LM's training step written the way HF computes its loss (logits upcast to fp32,
    then `F.cross_entropy`), with the optimizer, clipping (1.0) and zeroing our step uses."""
    import torch.nn.functional as F

    def step(tokens):
        with torch.autocast(
            tokens.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
        ):
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
