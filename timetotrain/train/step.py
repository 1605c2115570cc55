"""What one training step is, shared by timed runs and synthetic throughput runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from timetotrain.suite.base import Benchmark, Tier
from timetotrain.train.optim import build_adamw, set_lr
from timetotrain.train.schedule import WarmupCosine


def train_step(
    model, opt, tokens: torch.Tensor, accum: int, clip: float, params, autocast=None
) -> torch.Tensor:
    """One optimizer step over a local batch split into `accum` equal micro-batches (so the mean of the
    micro-batch means is the batch mean). Returns the loss as a device tensor: no host sync here.
    `autocast` (e.g. torch.bfloat16) runs the forward in that precision; weights and optimizer stay fp32."""
    total = torch.zeros((), device=tokens.device)
    for mb in tokens.chunk(accum):
        with torch.autocast(
            tokens.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
        ):
            logits = model(mb[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten()) / accum
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


@dataclass
class Training:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: WarmupCosine
    params: list
    clip: float
    autocast: torch.dtype | None = None

    def step(self, step: int, tokens: torch.Tensor, accum: int) -> torch.Tensor:
        set_lr(self.opt, self.sched(step))
        return train_step(self.model, self.opt, tokens, accum, self.clip, self.params, self.autocast)


def build_training(bench: Benchmark, tier: Tier, device: torch.device, seed: int) -> Training:
    """Model on the meta device, materialised on `device`, warmed up once, then initialised by the
    benchmark's own rule from `seed`; a fresh optimizer. Nothing from the warm-up survives."""
    with torch.device("meta"):
        model = bench.build_model(tier)
    model.to_empty(device=device)
    bench.init_model(model, torch.Generator(device=device).manual_seed(seed + 1))
    _warmup(model, tier, device)
    bench.init_model(model, torch.Generator(device=device).manual_seed(seed))
    model.train()
    fx = bench.fixed_hparams
    betas = (fx["opt_adamw_beta_1"], fx["opt_adamw_beta_2"])
    opt = build_adamw(model, tier.lr, betas, fx["opt_adamw_epsilon"], fx["opt_adamw_weight_decay"])
    sched = WarmupCosine(tier.lr, tier.end_lr, tier.warmup_steps, tier.max_steps, bench.schedule_rule)
    params = [p for p in model.parameters() if p.requires_grad]
    return Training(model, opt, sched, params, fx["opt_gradient_clip_norm"])


def _warmup(model, tier: Tier, device) -> None:
    """Touch every kernel once before the clock (allocator, kernel selection)."""
    mb = min(tier.micro_batch_size, 2)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, tier.model.vocab_size, (mb, tier.seq_len + 1), generator=g, device=device)
    logits = model(x[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)
