"""The fused LM head + cross-entropy under bf16 autocast, side by side in one run: the fp32-logits-buffer path
(`lowp=False`, the path before issue 26) and the bf16-logits path (`lowp=True`, the default;
models/common/head_loss.py), forward + backward, interleaved repetitions, median time of each and their ratio;
plus the largest difference of loss, dh and dW between the two (0 on a CPU: the same arithmetic).

    PYTHONPATH=. python bench/head_loss.py                     # CPU, a small shape
    PYTHONPATH=. python bench/head_loss.py --device cuda --tokens 8192 --dim 4096 --vocab 128256

bench/gpu_probe.py calls `measure` at the 8B shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from timetotrain.models.common.head_loss import linear_cross_entropy


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(tokens: int, dim: int, vocab: int, device: torch.device, reps: int = 5, warmup: int = 2) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, dim, device=device, generator=g)
    w = torch.randn(vocab, dim, device=device, generator=g) * dim**-0.5
    y = torch.randint(0, vocab, (tokens,), device=device, generator=g)

    def once(lowp: bool):
        hh = h.detach().requires_grad_()
        ww = w.detach().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = linear_cross_entropy(hh, ww, y, lowp=lowp)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(warmup + reps):
        for lowp in (False, True):  # interleaved: load changes hit both alike
            _sync(device)
            t0 = time.perf_counter()
            once(lowp)
            _sync(device)
            if i >= warmup:
                times[lowp].append(time.perf_counter() - t0)
    before, after = once(False), once(True)
    diff = {
        name: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        for name, a, b in zip(("loss", "dh", "dW"), before, after, strict=True)
    }
    t_before, t_after = statistics.median(times[False]), statistics.median(times[True])
    return {
        "shape": {"tokens": tokens, "dim": dim, "vocab": vocab},
        "device": device.type,
        "fp32_buffer_s": t_before,
        "bf16_logits_s": t_after,
        "speedup": t_before / t_after,
        "max_rel_diff": diff,
        "reps": reps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    r = measure(a.tokens, a.dim, a.vocab, torch.device(a.device), a.reps)
    print(json.dumps(r, indent=1))
    print(
        f"head+loss bf16, {a.tokens} tokens x d {a.dim} x V {a.vocab} on {a.device}: fp32-buffer "
        f"{r['fp32_buffer_s'] * 1e3:.1f} ms, bf16-logits {r['bf16_logits_s'] * 1e3:.1f} ms, "
        f"ratio {r['speedup']:.2f}x"
    )


if __name__ == "__main__":
    main()
