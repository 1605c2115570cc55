"""The MoE experts' bf16 weight cast, side by side in one run: one cast per micro-batch (the path before;
`.to(bf16)` of every expert stack in every forward) and one cast per optimizer step
(models/common/weight_cast.py, what `train_step` does now), on a stack of MoE layers trained by
`train.step.train_step` with `accum` micro-batches under bf16 autocast; interleaved repetitions, the median
step time of each and their ratio, the largest gradient difference (0: the same arithmetic), and the time
of the casts alone (what the cache saves, `accum - 1` of `accum` of it).

Also: how many experts a micro-batch activates at each MoE tier of the suite, in closed form for uniform
routing, P(an expert gets no token) = (1 - k/E) ** tokens: casting only the active experts saves nothing
where that is ~0 (every tier: below).

    PYTHONPATH=. python bench/moe_cast.py                     # CPU, a small shape
    PYTHONPATH=. python bench/moe_cast.py --device cuda --dim 2880 --ffn 2880 --experts 32 --top-k 4 \\
        --tokens 16384 --layers 2                             # gpt_oss_20b's reference micro-batch
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from torch import nn

from timetotrain.models.common import weight_cast
from timetotrain.models.common.moe import MoE, TopKRouter
from timetotrain.train.step import train_step


class Stack(nn.Module):
    def __init__(self, layers, dim, ffn, experts, top_k):
        super().__init__()
        self.layers = nn.ModuleList(
            MoE(TopKRouter(dim, experts, top_k), experts, top_k, dim, ffn) for _ in range(layers)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(dim, ffn, experts, top_k, tokens, accum, layers, device, reps=5, warmup=1) -> dict:
    torch.manual_seed(0)
    model = Stack(layers, dim, ffn, experts, top_k).to(device)
    for layer in model.layers:
        layer.init_weights(lambda p, std: nn.init.normal_(p, 0.0, std), dim**-0.5, dim**-0.5)
    params = list(model.parameters())
    x = torch.randn(accum * tokens, dim, device=device)
    batch = {"x": x}
    grads = {}

    class Capture(torch.optim.SGD):
        def __init__(self, key):
            super().__init__(params, lr=0.0)
            self.key = key

        def step(self, closure=None):
            grads[self.key] = [p.grad.clone() for p in params]

    def loss_fn(m, mb):
        return m(mb["x"]).float().pow(2).mean()

    def once(per_step: bool):
        real = weight_cast.cached
        if not per_step:  # the path before: no cache, every forward casts
            weight_cast.cached = contextlib.nullcontext
        try:
            _sync(device)
            t0 = time.perf_counter()
            train_step(model, Capture(per_step), batch, accum, loss_fn, None, params, torch.bfloat16)
            _sync(device)
            return time.perf_counter() - t0
        finally:
            weight_cast.cached = real

    for _ in range(warmup):
        once(False), once(True)
    times = {False: [], True: []}
    for _ in range(reps):  # interleaved: load drift hits both alike
        for k in (False, True):
            times[k].append(once(k))
    w = [m.experts.w1 for m in model.layers] + [m.experts.w2 for m in model.layers]
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        for p in w:
            p.detach().to(torch.bfloat16)
    _sync(device)
    cast_s = (time.perf_counter() - t0) / reps
    before, after = statistics.median(times[False]), statistics.median(times[True])
    diff = max((a - b).abs().max().item() for a, b in zip(grads[False], grads[True], strict=True))
    return {
        "shape": {"dim": dim, "ffn": ffn, "experts": experts, "top_k": top_k, "tokens_per_micro_batch": tokens,
                  "accum": accum, "layers": layers},
        "per_micro_batch_cast_s": before, "per_step_cast_s": after, "speedup": before / after,
        "one_cast_of_all_experts_s": cast_s, "casts_saved_per_step": accum - 1, "max_abs_grad_diff": diff,
    }  # fmt: skip


def active_experts() -> list[dict]:
    """Per MoE tier of the suite: tokens per micro-batch and the expected share of experts with no token."""
    from timetotrain.spec import registry

    rows = []
    for name in registry.names():
        b = registry.get(name)
        for tier in b.tiers:
            t = b.tier(tier)
            m = t.model
            if not getattr(m, "n_experts", 0) or not hasattr(t.data, "seq_len"):
                continue
            n = t.micro_batch_size * t.data.seq_len
            rows.append({"benchmark": name, "tier": tier, "experts": m.n_experts, "top_k": m.top_k,
                         "tokens_per_micro_batch": n, "p_expert_idle": (1 - m.top_k / m.n_experts) ** n})  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128, help="tokens per micro-batch")
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    r = measure(a.dim, a.ffn, a.experts, a.top_k, a.tokens, a.accum, a.layers, torch.device(a.device), a.reps)
    print(json.dumps(r))
    for row in active_experts():
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
