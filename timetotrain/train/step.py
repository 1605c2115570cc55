"""What one training step is, shared by timed runs and synthetic throughput runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from timetotrain.suite.base import Benchmark, Tier
from timetotrain.train import parallel
from timetotrain.train.optim import build_adamw, set_lr
from timetotrain.train.schedule import WarmupCosine


def targets(tokens: torch.Tensor, eod_id: int | None) -> torch.Tensor:
    """Next-token labels; with `eod_id`, positions whose *input* is end-of-document are ignored (Megatron's
    `eod_mask_loss`: the token after an EOD starts an unrelated document and cannot be predicted)."""
    labels = tokens[:, 1:]
    if eod_id is None:
        return labels
    return labels.masked_fill(tokens[:, :-1] == eod_id, -100)


def train_step(
    model,
    opt,
    tokens: torch.Tensor,
    accum: int,
    clip: float,
    params,
    autocast=None,
    eod_id: int | None = None,
    ep_group=None,
) -> torch.Tensor:
    """One optimizer step over a local batch split into `accum` equal micro-batches; each micro-batch's
    loss is its mean token cross-entropy, and the step's loss their mean. Returns the local loss as a device
    tensor: no host sync here. `autocast` (e.g. torch.bfloat16) runs the forward in that precision; weights
    and optimizer stay fp32. Under DDP/FSDP gradients are reduced once, on the last micro-batch."""
    total = torch.zeros((), device=tokens.device)
    for i, mb in enumerate(tokens.chunk(accum)):
        with parallel.grad_sync(model, i == accum - 1):
            with torch.autocast(
                tokens.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
            ):
                # The model applies its head and the loss together (models/head_loss.py).
                loss = model(mb[:, :-1], labels=targets(mb, eod_id)) / accum
            loss.backward()
        total += loss.detach()
    if ep_group is None:
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    else:  # expert slices differ per rank: the global norm sums them across the group
        from timetotrain.train.expert_parallel import clip_grad_norm_ep

        clip_grad_norm_ep(params, clip, ep_group)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


@dataclass
class Training:
    model: torch.nn.Module  # what to call: possibly a DDP wrapper
    opt: torch.optim.Optimizer
    sched: WarmupCosine
    params: list
    clip: float
    autocast: torch.dtype | None = None
    world: int = 1
    eod_id: int | None = None  # set by the caller when the benchmark masks the loss after EOD
    ep_group: object = None  # expert-parallel process group, when experts are sharded
    _votes: torch.Tensor | None = None

    def step(self, step: int, tokens: torch.Tensor, accum: int, stop_vote: bool = False) -> torch.Tensor:
        """Returns [global mean loss, number of ranks voting to stop] as one device tensor, reduced in a
        single collective so every rank sees the same values and takes the same decision."""
        set_lr(self.opt, self.sched(step))
        loss = train_step(
            self.model,
            self.opt,
            tokens,
            accum,
            self.clip,
            self.params,
            self.autocast,
            self.eod_id,
            self.ep_group,
        )
        if self._votes is None:  # made once: a fresh device scalar every step would be a host-to-device copy
            self._votes = torch.tensor([0.0, 1.0], device=loss.device)
        out = torch.stack([loss / self.world, self._votes[int(stop_vote)]])
        if self.world > 1:
            dist.all_reduce(out)  # SUM (gloo has no AVG): the loss was pre-divided
        return out


def build_training(
    bench: Benchmark, tier: Tier, device: torch.device, seed: int, plan: parallel.Plan | None = None
) -> Training:
    """Model on the meta device, materialised on `device`, warmed up once, initialised by the benchmark's
    own rule from `seed` (the same on every rank), then parallelised per `plan`, then a fresh optimizer
    over the (possibly sharded) parameters. Nothing from the warm-up survives."""
    plan = plan or parallel.Plan()
    with torch.device("meta"):
        model = bench.build_model(tier)
    model.to_empty(device=device)
    bench.init_model(model, torch.Generator(device=device).manual_seed(seed + 1))
    _warmup(model, tier, device)
    bench.init_model(model, torch.Generator(device=device).manual_seed(seed))
    model.train()
    wrapped, ep_group = parallel.apply(model, plan, device)
    fx = bench.fixed_hparams
    betas = (fx["opt_adamw_beta_1"], fx["opt_adamw_beta_2"])
    # Sharded (DTensor) parameters take the foreach implementation; fused kernels expect plain tensors.
    fused = None if plan.fsdp == 1 else False
    opt = build_adamw(model, tier.lr, betas, fx["opt_adamw_epsilon"], fx["opt_adamw_weight_decay"], fused)
    sched = WarmupCosine(tier.lr, tier.end_lr, tier.warmup_steps, tier.max_steps, bench.schedule_rule)
    params = [p for p in model.parameters() if p.requires_grad]
    return Training(
        wrapped, opt, sched, params, fx["opt_gradient_clip_norm"], parallel.autocast_dtype(plan), plan.world,
        ep_group=ep_group,
    )  # fmt: skip


def _warmup(model, tier: Tier, device) -> None:
    """Touch every kernel once before the clock (allocator, kernel selection)."""
    mb = min(tier.micro_batch_size, 2)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, tier.model.vocab_size, (mb, tier.seq_len + 1), generator=g, device=device)
    model(x[:, :-1], labels=x[:, 1:]).backward()
    model.zero_grad(set_to_none=True)
