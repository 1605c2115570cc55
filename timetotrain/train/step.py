"""What one training step is, shared by timed runs and synthetic throughput runs, and the one preparation
path of both: model on the meta device -> materialised -> warmed up -> initialised -> parallelised ->
optimizer and schedule; under FSDP2 the order that never holds the whole model on a rank: meta -> adapted
-> sharded -> each rank's shards materialised -> initialised -> warmed up -> initialised or loaded."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from timetotrain.fakes import real_host
from timetotrain.models.common import weight_cast
from timetotrain.spec.task import split_batch
from timetotrain.train import expert_parallel, parallel, pipeline, schedule, sdpa
from timetotrain.train.checkpoint import init_from
from timetotrain.train.float8 import after_optimizer_step
from timetotrain.train.optim import build_optimizer, set_lr
from timetotrain.train.shards import full_init
from timetotrain.train.tensor_parallel import clip_grad_norm_tp, replicate_partial_grads


def train_step(
    model, opt, batch: dict, accum: int, loss_fn, clip: float | None, params, autocast=None, ep_group=None,
    tp_world: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """One optimizer step over a local batch split into `accum` equal micro-batches; each micro-batch's
    loss is `loss_fn(model, micro_batch)` (a mean over its samples or tokens), and the step's loss their mean.
    Returns the local loss as a device tensor: no host sync here. `autocast` (e.g. torch.bfloat16) runs the
    forward in that precision; weights and optimizer stay fp32. Under DDP/FSDP gradients are reduced once,
    on the last micro-batch."""
    if isinstance(model, pipeline.Pipeline):  # the schedule runs the micro-batches (train/pipeline.py)
        total = model.forward_backward(batch, accum, loss_fn)
    else:
        total = _forward_backward(model, batch, accum, loss_fn, autocast)
    if ep_group is not None:  # whole expert slices held by several groups (HSDP, tp or cp with ep)
        expert_parallel.average_expert_replicas(model)
    if tp_world is not None:  # replicated parameters that computed on cut inputs: their grads are partial
        replicate_partial_grads(params)
    if clip is not None:
        if tp_world is not None:  # TP and FSDP shards and whole copies mixed: count each element once
            clip_grad_norm_tp(params, clip, tp_world)
        elif ep_group is None:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        else:  # expert slices differ per rank: the global norm sums them across the group
            expert_parallel.clip_grad_norm_ep(params, clip, ep_group)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def _forward_backward(model, batch: dict, accum: int, loss_fn, autocast) -> torch.Tensor:
    """The micro-batches' forwards and backwards; returns the step's loss (their mean)."""
    total = None
    dev = _device_type(batch)
    # One autocast context for the whole step, not one per micro-batch: autocast caches the bf16 copy of
    # each fp32 weight it casts until its outermost context exits, so every weight is cast once per step
    # instead of once per micro-batch (the cache holds those copies, 2 bytes per parameter, meanwhile).
    # The backward runs with autocast off, as it did outside the per-micro-batch contexts. The weights
    # autocast does not see (the MoE experts' stacks) are cast once per step the same way (weight_cast).
    with (
        torch.autocast(dev, dtype=autocast or torch.float32, enabled=autocast is not None),
        weight_cast.cached(),
    ):
        for i, mb in enumerate(split_batch(batch, accum)):
            with parallel.grad_sync(model, i == accum - 1), sdpa.priority(dev):
                loss = loss_fn(model, mb) / accum
                with torch.autocast(dev, enabled=False):
                    loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
    return total


def _device_type(batch: dict) -> str:
    return next(iter(batch.values())).device.type


@dataclass
class Training:
    model: torch.nn.Module  # what to call: possibly a DDP wrapper
    # The model itself (telemetry, checkpoints); under pp this rank's stages under the model's names.
    bare: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: object  # step -> lr
    params: list
    clip: float | None
    autocast: torch.dtype | None = None
    world: int = 1
    ep_group: object = None  # expert-parallel process group, when experts are sharded
    tp_world: int | None = None  # under tp or pp: the ranks of one stage, for the gradient norm's sum
    load_seconds: float | None = None  # how long reading --init-checkpoint took (logged before run_start)
    after_opt_step: object = None  # called after each optimizer step (float8 scales under FSDP2), or None
    _votes: torch.Tensor | None = None

    def step(
        self,
        step: int,
        batch: dict,
        accum: int,
        loss_fn,
        stop_vote: bool = False,
        sums: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns [global mean loss, number of ranks voting to stop, *sums over ranks] as one device tensor,
        reduced in a single collective so every rank sees the same values and takes the same decision;
        `sums` are the task's per-step figures of this rank (`RunData.step_sums`), carried along for free."""
        set_lr(self.opt, self.sched(step))
        loss = train_step(
            self.model, self.opt, batch, accum, loss_fn, self.clip, self.params, self.autocast, self.ep_group,
            self.tp_world,
        )  # fmt: skip
        if self.after_opt_step is not None:
            self.after_opt_step()
        # Auxiliary-loss-free MoE balancing (DeepSeek-V3): a router bias update outside autograd, once per
        # optimizer step, from the expert loads summed over the whole global batch.
        balance = getattr(self.bare, "update_router_bias", None)
        if balance is not None:
            balance(dist.all_reduce if self.world > 1 else None)
        if self._votes is None:  # made once: a fresh device scalar every step would be a host-to-device copy
            self._votes = torch.tensor([0.0, 1.0], device=loss.device)
        out = torch.stack([loss / self.world, self._votes[int(stop_vote)]])
        if sums is not None:
            out = torch.cat([out, sums.to(out.dtype)])
        if self.world > 1:
            dist.all_reduce(out)  # SUM (gloo has no AVG): the loss was pre-divided
        return out


def build_training(
    bench, tier, device: torch.device, seed: int, plan: parallel.Plan | None = None, init_checkpoint=None,
    init_kind: str | None = None,
) -> Training:  # fmt: skip
    """The model, initialised by the benchmark's own rule from `seed` (the same on every rank) or loaded from
    `init_checkpoint` (a Hugging Face or ttt checkpoint folder; `init_kind`: which, as the preflight's
    `checkpoint.check_init_source` found, else checked at the load), adapted by the task (LoRA), warmed up
    once and parallelised per `plan`, then a fresh optimizer over the (possibly sharded) parameters. Nothing
    from the warm-up survives. Sharded plans (`fsdp > 1` or `tp > 1`) never hold the whole model on a rank
    (`_build_sharded`); both builds give the same weights for the same seed and checkpoint."""
    plan = plan or parallel.Plan()
    timer: dict[str, float] = {}
    if plan.pp > 1:  # each rank builds, initialises and steps its own stages (train/pipeline.py)
        model, wrapped, ep_group = pipeline.build(
            bench, tier, device, seed, plan, init_checkpoint, timer, init_kind
        )
    elif plan.sharded:
        model, wrapped, ep_group = _build_sharded(
            bench, tier, device, seed, plan, init_checkpoint, timer, init_kind
        )
    else:
        model, wrapped, ep_group = _build_whole(
            bench, tier, device, seed, plan, init_checkpoint, timer, init_kind
        )
    # Sharded (DTensor) parameters take the foreach implementation; fused kernels expect plain tensors.
    fused = None if not plan.sharded else False
    tables = _table_parameters(bench, model)
    opt = build_optimizer(model, bench.optimizer, tier.lr, fused, foreach=plan.tp == 1, tables=tables)
    sched = schedule.for_tier(bench.schedule, tier)
    # The clip's parameters: all that train, less tables with an optimizer of their own (dlrmv4 clips only
    # the dense parameters, yambda_5b.gin:117-122).
    skip = {id(p) for p in tables or ()}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in skip]
    after = None
    if plan.precision == "fp8" and plan.fsdp > 1:
        after = after_optimizer_step(model)
    return Training(
        wrapped, model, opt, sched, params, bench.clip(tier), parallel.autocast_dtype(plan), plan.world,
        # The gradient norm sums each element once over the ranks of one stage, and over all stages.
        ep_group=ep_group, tp_world=plan.world // plan.pp if plan.tp > 1 or plan.pp > 1 else None,
        load_seconds=timer.get("load"),
        after_opt_step=after,
    )  # fmt: skip


def _table_parameters(bench, model) -> list | None:
    """The embedding tables that take the optimizer's `tables` optimizer, or None where it has none."""
    if bench.optimizer.tables is None:
        return None
    if bench.family.table_parameters is None:
        raise ValueError(
            f"{bench.name}: its optimizer pairs tables, its family names none (table_parameters)"
        )
    return bench.family.table_parameters(model)


def _timed_init_from(timer: dict, *args, **kwargs) -> None:
    t0 = time.monotonic()
    init_from(*args, **kwargs)
    timer["load"] = time.monotonic() - t0


def _build_whole(bench, tier, device, seed, plan, init_checkpoint, timer, init_kind=None):
    """Model on the meta device (under `dp=N` its unpooled tables cut to this rank's shard first:
    `parallel.shard_tables_before_fill`), materialised on `device`, initialised from `seed + 1`, warmed up,
    initialised from `seed` (or loaded), adapted by the task, then parallelised (DDP, expert parallelism or
    none). The order of the recorded golden runs: it fixes which random numbers each step draws."""
    family = bench.family
    with (
        real_host(),
        torch.device("meta"),
    ):  # (timetotrain/fakes.py: a simulation's meta model, its table shards too, stays real meta)
        model = family.build(tier.model)
        parallel.shard_tables_before_fill(model, plan)
    # Each module once: DLRM lists its MLPs twice (`layers`), and under `ttt plan --simulate` a parameter
    # made fake by the first visit cannot be swapped again by the second.
    for module in model.modules():
        module.to_empty(device=device, recurse=False)
    family.init(model, torch.Generator(device=device).manual_seed(seed + 1))
    _warmup(bench, model, tier, device, torch.bfloat16 if plan.compute == "bf16" else None)
    family.init(model, torch.Generator(device=device).manual_seed(seed))
    if init_checkpoint is not None:
        _timed_init_from(
            timer, init_checkpoint, model, family, tier.model, truncate_rows=bench.task.checkpoint_rows(tier),
            kind=init_kind,
        )  # fmt: skip
    bench.task.adapt_model(model, tier, torch.Generator(device=device).manual_seed(seed + 2), plan.compute)
    model.train()
    wrapped, ep_group = parallel.apply(model, plan, device, family)
    return model, wrapped, ep_group


def _build_sharded(bench, tier, device, seed, plan, init_checkpoint, timer, init_kind=None):
    """FSDP2 without ever materialising the whole model: build on the meta device -> the task's adaptation
    (LoRA) on the meta device, so that its new modules are inside the blocks before `fully_shard` groups
    their parameters -> activation checkpointing / compile / `fully_shard` per block and root
    (`parallel.apply`) -> `to_empty`: each rank allocates only its shards -> fill them.

    Filling gives the weights `_build_whole` gives for the same seed and checkpoint (tests/test_sharded_build):
    the family's init and the adapters' draw full tensors one parameter at a time and keep this rank's
    slice (`shards.full_init`), a checkpoint is read into the shards (`checkpoint.load_hf_checkpoint`).
    With a checkpoint the family's init draws no parameter (`skip_sharded`: the base comes from the
    checkpoint; buffers are still set) and only the adapters are drawn, from `seed + 2` as unsharded.
    The warm-up runs on the model initialised from `seed + 1` (sharded: through the all-gathers, in the
    training precision), inside `fork_rng`: LoRA's dropout exists by then and must not advance the RNG the
    training draws its masks from."""
    family, task = bench.family, bench.task
    # All of it on the meta device: under a simulation's fake mode it stays real meta (timetotrain/fakes.py).
    with real_host():
        with torch.device("meta"):
            model = family.build(tier.model)
        task.adapt_model(model, tier, None, plan.compute)
        wrapped, ep_group = parallel.apply(model, plan, device, family)
    model.to_empty(device=device)
    parallel.remark(model, plan)  # to_empty made new Parameters: mark them (expert slices: scale their grads)
    with full_init():
        family.init(model, torch.Generator(device=device).manual_seed(seed + 1))
        task.init_adapters(model, tier, torch.Generator(device=device).manual_seed(seed + 2))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        _warmup(bench, wrapped, tier, device, parallel.autocast_dtype(plan))
    with full_init(skip_sharded=init_checkpoint is not None):
        family.init(model, torch.Generator(device=device).manual_seed(seed))
    if init_checkpoint is not None:
        parallel.remark(model, plan)  # idempotent; the warm-up ran FSDP2 since the last marks
        _timed_init_from(
            timer, init_checkpoint, model, family, tier.model, truncate_rows=task.checkpoint_rows(tier),
            names=task.checkpoint_names(model), kind=init_kind,
        )  # fmt: skip
    with full_init():
        task.init_adapters(model, tier, torch.Generator(device=device).manual_seed(seed + 2))
    model.train()
    return model, wrapped, ep_group


def _warmup(bench, model, tier, device, autocast: torch.dtype | None) -> None:
    """Touch every kernel once before the clock (allocator, kernel selection), in the training precision:
    an fp32 warm-up of a bf16 run would pick other kernels and size the allocator for fp32 activations."""
    mb = min(tier.micro_batch_size, 2)
    data = bench.task.synthetic(tier, mb, torch.Generator(device=device).manual_seed(0), device)
    # A table model's batch is real under `ttt plan --simulate`: its values steer host bookkeeping (hstu's
    # jagged layout; timetotrain/fakes.py). Without a fake mode this is nothing.
    with real_host() if bench.family.embedding_tables is not None else contextlib.nullcontext():
        batch = data.batch(0)
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        loss = data.loss(model, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
