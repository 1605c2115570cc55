"""Pipeline parallelism (`--parallel pp=P[,vpp=V]`) on torch.distributed.pipelining.

The split. A decoder's `model.layers` are cut into S = P x V consecutive stages, the embedding on the first
and the final norm with the head and its fused loss (models/common/head_loss.py) on the last. Each stage
has at least one block; the cut minimises the largest stage's matmul parameters (a stage's FLOPs per token
are proportional to them, attention aside), the head counting as `dim x vocab`, so a large vocabulary
takes blocks off the last stage. Stage s lives on pipeline rank s mod P (with V > 1 each rank holds V
stages, round-robin: the interleaved schedule's layout). rank 0 prints the split as one line.

The stage modules (`Stage`) are built here, outside the model: each holds the family model's own block,
embedding, norm and head modules (so parameter names, initialisation and the optimizer's masks are the
model's) and runs them through `Decoder.blocks`, the stack's one definition. The other stages' modules
stay on the meta device: a rank allocates only its stages. Initialisation draws every parameter's full
tensor in the model's order, keeping only this rank's (`_drawn_elsewhere`, beside FSDP2's `full_init`),
so every rank's weights equal the same parameters of a one-process model for the same seed.

Meshes. One (pp, dp_replicate, data, tp) DeviceMesh in the rank layout of `parallel.Plan.coords`
(pipeline outermost); a stage's FSDP2 and TP meshes are its slices, so the ranks of one stage shard and
cut its parameters among themselves, and the pipeline group links the ranks that hold the same data and
TP coordinates on consecutive stages. Under TP a stage boundary carries each rank's sequence shard of
the residual stream as a plain tensor (the next stage wraps it back into its DTensor), so the schedule
sees plain tensors only.

One step. The micro-batches are the run's gradient accumulation (local batch / micro_batch_size): 1F1B
(V = 1, `Schedule1F1B`) needs at least P of them, interleaved 1F1B (`ScheduleInterleaved1F1B`) a multiple
of P. The task's loss function is called with a stand-in for the model (`_Capture`) to learn the model's
inputs (tokens, labels), then the schedule runs them; the last stage's output is each micro-batch's mean
loss, and the schedule divides the accumulated gradients by the micro-batch count: the step's loss and
gradients are those of the unpipelined step (the mean over micro-batches of each one's mean loss). Under
FSDP2 the schedule reduces a stage's gradients once, after the last micro-batch, save for the wraps
`--set pp_reduce=` reduces after every micro-batch (the sharded expert slices by default:
train/pipeline_reduce.py).
Only the last stage has the loss: `Pipeline.forward_backward` returns it times P there and 0 elsewhere,
so that `Training.step`'s sum over all ranks of loss / world is the mean. The gradient norm for clipping
sums each stage's squares over all ranks (`Training.tp_world` is the ranks of one stage). Evaluation
(`Pipeline.forward`) runs the stages forward-only, one eval micro-batch at a time, and hands the last
stage's result to every rank of the pipeline.

Checkpoints: `owned` is this rank's share under the model's names, so `--save-checkpoint` writes one
folder (each stage its own entries, DCP) that any layout reads, and `--init-checkpoint` loads into the stages
only what they hold (a ttt or a Hugging Face checkpoint).

Context parallelism (`pp=P,cp=C[,tp=T]`): the mesh gains a cp dimension between data and tp; every stage
holds a `context_parallel.SequenceGroup`, the first embeds its CP rank's head-tail part of the whole tokens,
the boundaries carry `[micro, T / (cp x tp), dim]`, the last stage returns the loss shares summed over the
CP group (the micro-batch's one-process mean on every CP rank), and FSDP2 shards a stage over the
flattened (data, cp) ranks, which averages the CP ranks' gradients.

Mixture of experts (`pp=P[,tp=T],ep=E[,fsdp=N]`, deepseek_v3 with its MTP on the last stage, and gpt_oss):
train/pipeline_moe.py. Under TP the boundaries carry DeepSeek's MTP inputs as each rank's sequence shard too.

LoRA (llama2_70b_lora). The task adapts the meta model before anything else (`Task.adapt_model`: adapters in
the blocks, the base frozen), so a stage carries its blocks' adapters and FSDP2 groups them with the block;
only they have gradients and optimizer state. The base is initialised, then loaded (`--init-checkpoint`,
through `Task.checkpoint_names`), and the adapters drawn from `seed + 2` in the whole model's order
(`_init_adapters`), the values of a one-process build. The answer-only loss needs nothing of its own: the
last stage returns each micro-batch's mean over its answer tokens and the schedule averages the micro-batches'
gradients, which is how the one-process step normalises (train/step.py). Dropout masks are drawn by each
stage in the schedule's order, so they differ from one process's (equal runs need dropout 0). Under TP a
boundary carries this rank's `torch.chunk` share of the sequence (`_stream_length`): LoRA trains on blocks
of 8,192 tokens, 8,191 positions, which do not divide.

fp8 (`--precision fp8`): the block linears of the meta model are converted (`float8.convert`) before TP,
checkpointing, compile and FSDP2 see them, as `parallel.apply` does; each rank's stages then hold theirs.

Not built: pp with dp / dp_replicate, ep with vpp or cp, MoE families other than `MOE_FAMILIES` or without
ep, families whose stack is not the plain `Decoder` (Qwen3.5's DeltaNet state), tasks that roll out on the
model (GRPO) or adapt it without `Task.init_adapters`.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from timetotrain import fakes
from timetotrain.errors import UserError
from timetotrain.fakes import real_host
from timetotrain.models.common.decoder import Decoder
from timetotrain.models.common.sequence_shard import head_loss, labelled
from timetotrain.spec.task import Task
from timetotrain.train import float8, parallel
from timetotrain.train.checkpoint import _clean_name, check_init_source, load_checkpoint, load_hf_checkpoint
from timetotrain.train.context_parallel import SequenceGroup
from timetotrain.train.expert_parallel import apply_expert_parallel, is_expert_sharded, shard_expert_replicas
from timetotrain.train.pipeline_moe import Owned, aux_into_backward, aux_losses, expert_mesh
from timetotrain.train.pipeline_reduce import ReducingStage, per_micro_batch
from timetotrain.train.shards import draw_dropped, fill_target, full_init

_MODULES = ("embed", "layers", "norm", "head")  # a plain Decoder's parameters live under these
# MoE families with a stage build (train/pipeline_moe.py: expert parallelism within a stage, router state and
# aux losses across stages, DeepSeek's MTP on the last stage).
MOE_FAMILIES = ("deepseek_v3", "gpt_oss")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a stage boundary may carry (eval header)


def check(bench, tier, plan: parallel.Plan, local: int, micro: int, explicit: bool, flag: str) -> int:
    """Preflight for `pp`: what is not built says so, the stages fit the model's layers, and the micro-batch
    count suits the schedule. Returns the micro-batch size: the one asked for (`explicit`), else the
    largest that divides the per-rank batch `local` into enough micro-batches, at most `micro`."""
    spec = ",".join(
        f"{k}={getattr(plan, k)}" for k in parallel.KINDS + parallel.STAGE_KEYS if getattr(plan, k) > 1
    )
    for what, bad in (
        ("dp (use fsdp)", plan.dp > 1),
        ("dp_replicate", plan.dp_replicate > 1),
    ):
        if bad:
            raise UserError(f"--parallel {spec}: pipeline parallelism with {what} is not built yet")
    stages = plan.pp * plan.vpp
    layers = getattr(tier.model, "n_layers", None)
    # Tasks that roll out on the model (GRPO) have no stage build yet; a task that adapts the model builds
    # its stages only where it also says how to draw its new parameters alone (LoRA's `init_adapters`).
    task = type(bench.task)
    adapts = task.adapt_model is not Task.adapt_model and task.init_adapters is Task.init_adapters
    if layers is None or bench.task.on_policy or adapts:
        raise UserError(
            f"--parallel {spec}: {bench.name} has no pipeline split yet (causal LM pretraining and LoRA "
            "fine-tuning only)"
        )
    if hasattr(tier.model, "n_experts") and (bench.family.name not in MOE_FAMILIES or plan.ep == 1):
        # A stage's router state, aux losses and MTP: train/pipeline_moe.py, built for these families.
        built = " or ".join(MOE_FAMILIES)
        what = f"the {bench.family.name} family" if plan.ep > 1 else f"{bench.name} without ep"
        raise UserError(
            f"--parallel {spec}: pipeline parallelism for mixture-of-experts models is built for {built} "
            f"with expert parallelism (pp=P[,tp=T],ep=E[,fsdp=N]) only, not for {what}"
        )
    if plan.ep > 1 and not hasattr(tier.model, "n_experts"):
        raise UserError(
            f"--parallel {spec}: ep splits the experts of a mixture-of-experts model; {bench.name} has none"
        )
    if layers < stages:
        raise UserError(
            f"--parallel {spec}: {stages} stages but the model has {layers} layers; use fewer stages"
        )

    def fits(m: int) -> bool:
        n = local // m
        return local % m == 0 and (n >= plan.pp if plan.vpp == 1 else n % plan.pp == 0)

    need = f"{plan.pp} or more" if plan.vpp == 1 else f"a multiple of {plan.pp}"
    if explicit:
        if not fits(micro):
            raise UserError(
                f"{flag}={micro}: pipeline parallelism needs {need} micro-batches per step (the per-rank batch "
                f"is {local})"
            )
        return micro
    for m in range(min(micro, local), 0, -1):
        if fits(m):
            return m
    raise UserError(f"--parallel {spec}: the per-rank batch {local} does not split into {need} micro-batches")


def split_layers(costs: list[float], head: float, stages: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) layer ranges, one per stage, at least one layer each, minimising the largest
    stage cost (the last stage also pays `head`). An exact search over cut points (L x S states)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest max-cost of the first i layers in s stages; cut[s][i]: where stage s starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                c = prefix[i] - prefix[j] + (head if s == stages and i == n else 0.0)
                v = max(best[s - 1][j], c)
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    out, i = [], n
    for s in range(stages, 0, -1):
        out.append((cut[s][i], i))
        i = cut[s][i]
    return out[::-1]


def stage_costs(bench, cfg) -> tuple[list[float], float]:
    """`split_layers`' costs of the model `cfg`: each block's matmul parameters, and the head's."""
    if bench.family.stage_costs is not None:
        return bench.family.stage_costs(cfg)
    return [float(bench.family.block_params(cfg))] * cfg.n_layers, float(cfg.dim * cfg.vocab_size)


def describe_split(ranges: list[tuple[int, int]], pp: int) -> str:
    parts = []
    for s, (lo, hi) in enumerate(ranges):
        extra = ["embed"] if s == 0 else []
        extra += ["norm", "head"] if s == len(ranges) - 1 else []
        where = f" on rank {s % pp}" if len(ranges) > pp else ""
        layers = f"layer {lo}" if hi - lo == 1 else f"layers {lo}-{hi - 1}"
        parts.append(f"stage {s}{where} {layers}" + (f" (+{', '.join(extra)})" if extra else ""))
    return "pipeline: " + ", ".join(parts)


class Stage(nn.Module):
    """Stage blocks [lo, hi) of a `Decoder`: its embedding first on the first stage, its final norm and
    head (the fused loss when labels are given) last on the last one. Inputs: tokens on the first stage,
    else the previous stage's residual stream (under TP this rank's sequence shard of it). Under cp
    (`sequence`) every stage computes its CP rank's head-tail part of each sequence: the first embeds only
    those positions of the whole tokens, the blocks attend through the shard's K/V exchange, and the last
    returns its share of the loss summed over the CP group, the micro-batch's one-process mean."""

    def __init__(
        self, model: Decoder, lo: int, hi: int, first: bool, last: bool, tp_mesh=None, sequence=None
    ):  # fmt: skip
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        # DeepSeek's MTP depths: on the last stage; the boundaries carry their inputs (train/pipeline_moe.py).
        self.carry = len(getattr(model, "mtp", ()))
        self.mtp = model.mtp if last and self.carry else None
        self.moe = hasattr(model.cfg, "n_experts")
        self.aux_total = 0.0  # this step's aux losses of a stage before the last (their values, no gradient)
        # The model's helpers (RoPE tables, masks), outside the module tree: its parameters are not all ours.
        self.__dict__["decoder"] = model
        self.tp_mesh = tp_mesh
        self.sequence: SequenceGroup | None = sequence
        self.autocast: torch.dtype | None = None  # the forward's autocast dtype (the backward runs outside)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean"):
        if self.autocast is None:
            return self._forward(x, labels, reduction)
        with torch.autocast(x.device.type, dtype=self.autocast):
            return self._forward(x, labels, reduction)

    def _forward(self, x, labels, reduction):
        shard = None
        if self.sequence is not None:  # the whole labels reach every stage (the schedule's kwargs)
            if labels is None:
                raise ValueError("a context-parallel stage computes losses only: pass labels")
            shard = self.sequence.shard(labels.shape[1], labels.device)
        carry = self.carry if self.training else 0  # MTP trains only; evaluation carries the stream alone
        ahead: list[torch.Tensor] = []
        if self.embed is not None:
            if carry:
                ahead = self.decoder.mtp_inputs(x)
            x = self.embed(x if shard is None else shard.local(x))
        else:
            if carry:
                x, *ahead = x.chunk(1 + carry, dim=-1)
            if self.tp_mesh is not None:  # this rank's sequence shard of the residual stream (and MTP's)
                x, *ahead = [self._sequence_shard(t, labels) for t in (x, *ahead)]
        x = self.decoder.blocks(x, self.layers.values(), shard)
        aux = aux_losses(self.layers.values()) if self.moe and self.training else None
        if self.norm is None:
            if aux is not None:
                self.aux_total = self.aux_total + aux.detach().float()
            # The boundary carries plain tensors: under TP each rank's sequence shard of each.
            x, *ahead = [t.to_local() if isinstance(t, DTensor) else t for t in (x, *ahead)]
            x = aux_into_backward(x, aux)
            return torch.cat([x, *ahead], dim=-1) if carry else x
        h = self.norm(x)
        loss = head_loss(h, self.head, labels, reduction, shard)  # (a share of it under cp)
        if shard is not None:
            return self.sequence.total(loss)
        extra = []  # as DeepSeekV3.forward: LM + (MTP + this stage's aux losses, the MTP block's too)
        if carry:
            T = h.shape[1]
            cos, sin = self.decoder.rope_cos[:T], self.decoder.rope_sin[:T]
            extra.append(self.decoder.mtp_loss(None, labels, h, cos, sin, reduction, None, inputs=ahead))
            aux = aux_losses([*self.layers.values(), self.mtp])
        if aux is not None:  # a per-token mean already; a summed loss scales it by the labelled tokens
            extra.append(aux if reduction == "mean" else aux * labelled(labels))
        return loss + sum(extra[1:], extra[0]) if extra else loss

    def _sequence_shard(self, x: torch.Tensor, labels: torch.Tensor | None) -> DTensor:
        """`x`, this rank's sequence shard off a boundary, as the TP plan's `Shard(1)` DTensor; the whole
        length from the labels: where the sequence does not divide, the shards differ."""
        whole = None
        if labels is not None:
            length = labels.shape[1] // (self.sequence.cp if self.sequence is not None else 1)
            whole = dict(shape=(x.shape[0], length, x.shape[2]), stride=(length * x.shape[2], x.shape[2], 1))
        return DTensor.from_local(x.contiguous(), self.tp_mesh, [Shard(1)], run_check=False, **(whole or {}))


class _Capture:
    """Stands for the model in a task's loss function: records the model's inputs instead of computing."""

    call = None

    def __call__(self, tokens, labels=None, reduction="mean"):
        self.call = (tokens, labels, reduction)
        return self


def _own_output(output, target):
    """The schedule's loss function: the last stage's output is already its micro-batch's mean loss."""
    return output


class Pipeline(nn.Module):
    """This rank's stages and the schedule that runs them. Called like the model (`model(tokens, labels=,
    reduction=)`) it evaluates: forward only, the result on every rank of the pipeline."""

    def __init__(
        self, stages: list[Stage], indices: list[int], count: int, group, device, accum: int, boundary: tuple,
        reduce: str = "experts",
    ):  # fmt: skip
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.indices, self.count, self.accum = indices, count, accum
        self.group, self.device = group, device
        self.pp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.last = count - 1 in indices
        # `reduce`: the wraps that reduce and reshard per micro-batch (train/pipeline_reduce.py)
        pipes = [
            ReducingStage(
                s,
                i,
                count,
                device,
                *_examples(i, count, *boundary),
                group=group,
                per_micro=per_micro_batch(s, reduce),
            )
            for s, i in zip(stages, indices, strict=True)
        ]
        if len(pipes) == 1:
            self.schedule = Schedule1F1B(pipes[0], accum, loss_fn=_own_output, scale_grads=True)
        else:
            self.schedule = ScheduleInterleaved1F1B(pipes, accum, loss_fn=_own_output, scale_grads=True)
        fakes.pipeline_schedule(self.schedule)

    def forward_backward(self, batch: dict, accum: int, loss_fn) -> torch.Tensor:
        """One step's forward and backward over `accum` micro-batches; the gradients (each stage's own) are
        the mean over micro-batches. Returns this rank's share of the loss (module docstring)."""
        if accum != self.accum:
            raise ValueError(f"the pipeline schedule has {self.accum} micro-batches, the step {accum}")
        capture = _Capture()
        if loss_fn(capture, batch) is not capture or capture.call[1] is None or capture.call[2] != "mean":
            raise UserError(
                "--parallel pp: this task's loss is not the model's own mean loss; no pipeline split"
            )
        tokens, labels, _ = capture.call
        losses: list[torch.Tensor] = []
        for stage in self.stages:
            stage.aux_total = 0.0
        self.schedule.step(tokens, target=labels, losses=losses, return_outputs=False, labels=labels)
        # The aux losses of the MoE layers before the last stage: in the gradients already, and in the
        # reported loss from the stage that holds them (train/pipeline_moe.py).
        total = sum((stage.aux_total for stage in self.stages), torch.zeros((), device=tokens.device))
        if self.last:
            total = total + torch.stack([loss.detach().float() for loss in losses]).sum()
        return total * (self.pp / accum)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean"):
        """Forward only through the stages in order, one activation handed from rank to rank; the last
        stage's result (a loss; logits are not passed back) broadcast to the pipeline."""
        if labels is None:
            raise ValueError("a pipeline computes losses only: pass labels")
        local = dict(zip(self.indices, self.stages, strict=True))
        out = None
        for s in range(self.count):
            stage = local.get(s)
            if stage is None:
                continue
            x = tokens if s == 0 else self._recv((s - 1) % self.pp)
            out = stage(x, labels=labels, reduction=reduction)
            if s < self.count - 1:
                self._send(out, (s + 1) % self.pp)
        result = out.float() if self.last else torch.zeros((), device=tokens.device)
        dist.broadcast(result, group_src=(self.count - 1) % self.pp, group=self.group)
        return result

    def _send(self, x: torch.Tensor, peer: int) -> None:
        head = torch.tensor([_DTYPES.index(x.dtype), *x.shape], dtype=torch.int64, device=x.device)
        dist.send(head, group_dst=peer, group=self.group)
        dist.send(x.contiguous(), group_dst=peer, group=self.group)

    def _recv(self, peer: int) -> torch.Tensor:
        head = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.recv(head, group_src=peer, group=self.group)
        code, *shape = head.tolist()
        x = torch.empty(shape, dtype=_DTYPES[code], device=self.device)
        dist.recv(x, group_src=peer, group=self.group)
        return x


def _examples(index: int, count: int, tokens: torch.Size, dim: int, dtype: torch.dtype, length: int) -> tuple:
    """A stage's input and output as the schedule sees them, on the meta device, from one micro-batch's
    tokens `[B, T]`: the whole tokens into the first stage, this rank's part of the residual stream
    `[B, length, dim]` across each boundary (`_stream_length`: its CP rank's head-tail part, cut again
    along the sequence by TP's sequence parallelism), the micro-batch's loss out of the last. Given to
    `PipelineStage`, they spare the schedule its shape inference (a forward and a backward through the
    stage and the metadata sent between ranks in its first step) and are what a simulation's fake process
    group cannot send (timetotrain/fakes.py)."""
    meta = torch.device("meta")
    stream = torch.empty(tokens[0], length, dim, dtype=dtype, device=meta, requires_grad=True)
    x = torch.empty(tokens, dtype=torch.int64, device=meta) if index == 0 else stream
    out = (
        torch.empty((), dtype=torch.float32, device=meta, requires_grad=True)
        if index == count - 1
        else stream
    )
    return x, out


def _stream_length(tokens: int, plan: parallel.Plan) -> int:
    """The positions of the residual stream this rank carries across a stage boundary: its CP rank's part
    (`context_parallel.check` makes the sequence divide), then its chunk of TP's sequence-parallel `Shard(1)`,
    cut as `torch.chunk` cuts: the last TP ranks shorter where the sequence does not divide (LoRA's blocks
    of 8,192 tokens train on 8,191 positions)."""
    length = tokens // plan.cp
    chunk = -(-length // plan.tp)
    return max(0, min(chunk, length - plan.coords(dist.get_rank())["tp"] * chunk))


class _DrawnElsewhere(TorchFunctionMode):
    """An initialiser on a parameter of another rank's stage (still on the meta device) draws the full
    tensor on `device` and drops it, so the generator advances as in a one-process build."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = fill_target(func, args, kwargs)
        if target is None or target.device.type != "meta":
            return func(*args, **kwargs)
        draw_dropped(func, args, kwargs, target, self.device)
        return target


def _init(family, model, device, seed: int) -> None:
    with full_init(), _DrawnElsewhere(device):
        family.init(model, torch.Generator(device=device).manual_seed(seed))


def _init_adapters(task, model, tier, device, seed: int) -> None:
    """The task's new parameters (LoRA's A and B) drawn in the whole model's order from `seed`, each rank
    keeping its stages' (the other stages' draws made and dropped): a one-process build's values."""
    with full_init(), _DrawnElsewhere(device):
        task.init_adapters(model, tier, torch.Generator(device=device).manual_seed(seed))


def build(
    bench,
    tier,
    device: torch.device,
    seed: int,
    plan: parallel.Plan,
    init_checkpoint,
    timer: dict,
    init_kind=None,
):
    """The model on the meta device -> TP over the whole (meta) model -> this rank's stages cut out,
    activation-checkpointed, compiled and sharded (FSDP2 per block and per stage) -> only they are
    allocated -> initialised from `seed + 1` -> one warm-up step through the schedule -> initialised from
    `seed`, or loaded from `init_checkpoint` (this rank's parameters of it; the seconds in `timer["load"]`).
    Returns (this rank's stages as one module under the model's names, `owned`; the `Pipeline`; the
    expert-parallel group or None)."""
    family, task = bench.family, bench.task
    with real_host():
        with torch.device("meta"):
            model = family.build(tier.model)
        task.adapt_model(model, tier, None, plan.compute)  # LoRA: the adapters, the base frozen
        if plan.precision == "fp8":  # as `parallel.apply`: first, so TP, AC, compile and FSDP2 see float8
            float8.convert(model, plan.fp8_recipe, plan.fsdp > 1, device)
    plain = type(model).hidden is Decoder.hidden and type(model).forward is Decoder.forward
    moe = family.name in MOE_FAMILIES  # its own forward (MTP, aux losses): the stages mirror it
    outside = (
        {n.split(".")[0] for n, _ in model.named_parameters()} - set(_MODULES) - ({"mtp"} if moe else set())
    )
    if not isinstance(model, Decoder) or not (plain or moe) or outside:
        raise UserError(f"--parallel pp: the {family.name} family's model has no pipeline split yet")
    names = ("pp", "dp_replicate", "data", "cp", "tp")
    mesh = parallel.device_mesh(
        device.type, (plan.pp, plan.dp_replicate, plan.dp * plan.fsdp, plan.cp, plan.tp), names
    )  # fmt: skip
    with real_host():  # slicing a mesh finds this rank's coordinates in a tensor of rank ids (fakes.py)
        tp_mesh = mesh["tp"] if plan.tp > 1 else None
        pp_group = mesh["pp"].get_group()
        # FSDP2 shards a stage over its data-parallel and CP ranks together (`Plan.shard_ranks`).
        data_mesh = mesh["data", "cp"]._flatten("data_cp") if plan.cp > 1 else mesh["data"]
        sequence = SequenceGroup(plan, dist.get_rank(), mesh["cp"].get_group()) if plan.cp > 1 else None
    if tp_mesh is not None:
        _tensor_parallel(model, family, plan, tp_mesh, device)
    ep_group = None
    if plan.ep > 1:  # each stage's experts over its data-parallel ranks (train/pipeline_moe.py)
        ep_group, replicas, experts_mesh = expert_mesh(device.type, plan, parallel.device_mesh)
        bf16_experts = plan.compute == "bf16" and plan.shard_ranks > 1  # FSDP2 casts only what it manages
        with real_host():
            dtype = torch.bfloat16 if bf16_experts else None
            apply_expert_parallel(model, ep_group, dtype, replicas, experts_mesh)

    count = plan.pp * plan.vpp
    cfg = tier.model
    ranges = split_layers(*stage_costs(bench, cfg), count)
    if dist.get_rank() == 0:
        print(describe_split(ranges, plan.pp), file=sys.stderr, flush=True)
    me = plan.coords(dist.get_rank())["pp"]
    indices = list(range(me, count, plan.pp))
    # `--ac-every K` counts blocks over the whole model, as without stages: global block i is wrapped when
    # i % K == 0, whichever stage holds it.
    every = parallel.check_ac_every(plan.activation_checkpointing, cfg.n_layers)
    for s in indices:
        for i in range(*ranges[s]):
            if every and i % every == 0:
                model.layers[i] = checkpoint_wrapper(model.layers[i])
            if plan.compile:
                model.layers[i].compile()
    stages = [Stage(model, *ranges[s], s == 0, s == count - 1, tp_mesh, sequence) for s in indices]
    if plan.shard_ranks > 1:
        _shard_stages(model, stages, data_mesh, plan)
    elif plan.compute == "bf16":  # FSDP2 casts the parameters itself; else autocast in each stage
        for stage in stages:
            stage.autocast = torch.bfloat16
    for stage in stages:
        stage.to_empty(device=device)
    model.to_empty(device=device, recurse=False)  # the root's own buffers (RoPE tables)
    parallel.remark(model, plan)

    local = tier.global_batch_size // plan.data_parallel
    accum = local // tier.micro_batch_size
    data = task.synthetic(tier, local, torch.Generator(device=device).manual_seed(0), device)
    capture = _Capture()
    data.loss(capture, data.batch(0))
    tokens = capture.call[0].shape
    # The residual stream's dtype: FSDP2's compute dtype where it casts the parameters; under autocast (or
    # none) the stream stays fp32 (autocast lowers matmuls, not the residual additions).
    stream = torch.bfloat16 if plan.shard_ranks > 1 and plan.compute == "bf16" else torch.float32
    # DeepSeek's MTP inputs ride beside the residual stream (train/pipeline_moe.py).
    width = cfg.dim * (1 + len(getattr(model, "mtp", ())))
    length = _stream_length(tokens[1], plan)
    boundary = (torch.Size([tokens[0] // accum, tokens[1]]), width, stream, length)
    pipe = Pipeline(stages, indices, count, pp_group, device, accum, boundary, tier.pp_reduce)
    _init(family, model, device, seed + 1)
    _init_adapters(task, model, tier, device, seed + 2)
    # One step through the schedule before the clock (kernels, allocator), from the `seed + 1` weights;
    # its gradients are dropped.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        pipe.forward_backward(data.batch(0), accum, data.loss)
    pipe.zero_grad(set_to_none=True)
    _init(family, model, device, seed)
    mine = owned(stages)
    if moe:
        with real_host():
            stage_group = data_mesh.get_group()
        mine = Owned.of(model, stages, mine, cfg.n_experts, device, stage_group, pp_group)
    if init_checkpoint is not None:
        t0 = time.monotonic()
        names = task.checkpoint_names(mine)
        _load(init_checkpoint, mine, family, cfg, task.checkpoint_rows(tier), init_kind, names)
        timer["load"] = time.monotonic() - t0
    # The adapters from `seed + 2` after the base's weights, as the one-process build draws them.
    _init_adapters(task, model, tier, device, seed + 2)
    pipe.train()
    return mine, pipe, ep_group


def _tensor_parallel(model: nn.Module, family, plan: parallel.Plan, tp_mesh, device: torch.device) -> None:
    """The family's TP plan over the whole (meta) model, before the stages are cut out: every block, so the
    other stages' blocks stay consistent."""
    if family.tensor_parallel is None:
        raise UserError(f"--parallel tp={plan.tp}: the {family.name} family has no tensor-parallel plan")
    styles = {}
    if plan.precision == "fp8" and plan.fp8_recipe == "tensorwise":
        styles = float8.tensor_parallel_styles(device)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    with real_host():
        family.tensor_parallel(model, tp_mesh, **styles)
    for n, p in model.named_parameters():  # SequenceParallel's new norm Parameters: frozen stay frozen
        if n in frozen:
            p.requires_grad_(False)
    parallel.remark(model, plan)


def _shard_stages(model: nn.Module, stages: list, data_mesh, plan: parallel.Plan) -> None:
    """FSDP2 per block and per stage over the stage's data-parallel (and CP) ranks, on the meta device."""
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if plan.compute == "bf16" else None, reduce_dtype=torch.float32
    )
    with real_host():  # as `step._build_sharded` (TP's meshes: fakes.py)
        # The stages' expert slices sharded over their replicas get an FSDP2 wrap of their own first (the
        # other stages' MoE layers, on the meta device, are never allocated: no collective, their wrap is
        # dropped with them); whole slices differ per rank: FSDP2 neither shards nor reduces them.
        for stage in stages:
            shard_expert_replicas(stage, mp.param_dtype)
        plain = {p for p in model.parameters() if is_expert_sharded(p) and not isinstance(p, DTensor)}
        ignored = plain or None
        for stage in stages:
            for block in stage.layers.values():
                fully_shard(block, mesh=data_mesh, mp_policy=mp, ignored_params=ignored)
            fully_shard(stage, mesh=data_mesh, mp_policy=mp, ignored_params=ignored)


def owned(stages: list[Stage]) -> nn.Module:
    """This rank's stages as one module under the model's own parameter names (`embed.weight`,
    `layers.2.attn.qkv.weight`, ...): what its optimizer steps and what its checkpoints hold. A checkpoint
    is then one folder every stage writes its own entries into, and any layout reads."""
    mine = nn.Module()
    for name in ("embed", "norm", "head"):
        for stage in stages:
            if getattr(stage, name) is not None:
                setattr(mine, name, getattr(stage, name))
    mine.layers = nn.ModuleDict({i: block for stage in stages for i, block in stage.layers.items()})
    for stage in stages:
        if stage.mtp is not None:
            mine.mtp = stage.mtp
    return mine


def _load(path, mine: nn.Module, family, cfg, truncate_rows, kind: str | None = None, names=None) -> None:
    """A Hugging Face or ttt checkpoint into this rank's stages: the entries of its own parameters only.
    `kind`: as `checkpoint.init_from`'s; `names`: the task's renaming of an adapted model's parameters to the
    checkpoint's (`Task.checkpoint_names`: LoRA's `base` levels; None for the adapters it draws itself)."""
    names = names or {}
    if (kind or check_init_source(path, family, cfg)) == "hf":
        held = {_clean_name(n) for n, _ in mine.named_parameters()}
        held = {names.get(n, n) for n in held} - {None}
        mapping = {n: src for n, src in family.hf_mapping(cfg).items() if n in held}
        rows = {n: r for n, r in (truncate_rows or {}).items() if n in held}
        load_hf_checkpoint(mine, path, mapping, truncate_rows=rows, names=names or None)
    else:
        load_checkpoint(path, mine, None, names=names or None)
