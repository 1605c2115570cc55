"""Parallelism applied from outside the model: data parallel (DDP) or fully sharded (FSDP2 per block),
with activation checkpointing, torch.compile and mixed precision as switches.

Activation checkpointing (`--ac`, `--ac-every K`: `Plan.activation_checkpointing`) wraps every K-th block of
`model.layers`, blocks 0, K, 2K, ... (torchtitan's "selective" layer AC; K = 1 is every block): a wrapped block
keeps only its input and recomputes its activations in the backward, the others keep theirs. Block 0 is always
among the wrapped ones, so the backward's last block, which overlaps every gradient, is recomputed.

`--parallel` takes comma-separated degrees, e.g. `dp=8`, `fsdp=8`, `dp_replicate=2,fsdp=8`, `ep=8`,
`ep=8,fsdp=8`, `tp=8,fsdp=32` or `tp=2,ep=4,fsdp=32`; dp x dp_replicate x fsdp x tp must equal the world
size. `dp_replicate=R,fsdp=S` is HSDP: FSDP2 on an (R, S) mesh, each group of S consecutive ranks shards the model (parameters, gradients and
optimizer states 1/S each) and the R groups are replicas that average their gradient shards, so the
all-gathers stay within S ranks (one node, say) and only the gradient all-reduce crosses groups; all R x S
ranks read different samples. Tensor parallelism (train/tensor_parallel.py) puts `tp` consecutive
ranks on one sample stream: ranks r = i * tp + j form a (fsdp, tp) DeviceMesh, FSDP2 shards over the first
dimension. HSDP x TP, `dp_replicate=R[,fsdp=S],tp=T`: one (replicate, shard, tp) mesh, FSDP2 over its 2-D
(replicate, shard) sub-mesh (at S = 1 it only replicates: DDP takes no DTensors). HSDP x EP,
`dp_replicate=R,fsdp=S,ep=E` (E dividing S): the `ep=E,fsdp=N` hybrid below, FSDP2 on the (R, S) mesh. Expert parallelism overlaps the data-parallel ranks: `ep=N` shards a MoE model's experts over the
same N ranks that split the batch (so `ep=8` alone means `dp=8, ep=8`, DDP for the rest of the model), and
`ep=N,fsdp=N` does the same with FSDP2 sharding the rest (attention, router, shared experts, embedding,
head) over those N ranks. There the expert slices are `ignored_params` of `fully_shard`: FSDP2 neither
shards, gathers, casts nor reduces them (expert_parallel.py gives them their gradient scale), and under
bf16 the experts compute under autocast instead of FSDP2's parameter cast. `ep=E,fsdp=N` with E < N (E
dividing N) is the expert-data-parallel hybrid: the ranks form an (N/E, E) mesh, consecutive E ranks are an
expert-parallel group that splits the experts, the N/E ranks of one expert slice (r, r + E, ...) share it:
FSDP2 shards each slice over them (`expert_parallel.shard_expert_replicas`, a wrap of its own per MoE
layer's experts: gathered for their forward, the gradient reduce-scattered after their backward; torchtitan's
expert FSDP), and shards the rest over all N. Under HSDP, tp or cp with ep the slices stay whole on their
replicas, which average their gradients once per step (`expert_parallel.average_expert_replicas`;
`Plan.expert_shards`). Under DDP `ep` must equal the data-parallel degree.

Tensor with expert parallelism, `tp=T,ep=E[,fsdp=N]` (an MoE family with a TP plan: gpt_oss,
models/gpt_oss/parallelize.py): rank r = i * T + j is TP rank j of data-parallel rank i (tp innermost, as
above); FSDP2 shards the rest over the N data-parallel ranks (N = world / T: `tp=T,ep=E` alone implies it,
DDP taking no DTensors). TP cuts the attention; the router and the routed experts are not cut by TP: the
MoE's input is gathered whole on each TP rank, so the T ranks of a group route the same tokens the same
way and run the same experts. Expert parallelism splits the experts over the data-parallel index i, one
expert-parallel group per TP index j: the ranks form an (N / E, E, T) mesh ("replica", "ep", "tp"); the
group of rank (i, j) is the ranks (i', j) with i' // E = i // E, it holds slice i % E, and where N > E
the N / E ranks (i + kE, j) holding the same slice hold it whole and average its gradients
(`average_expert_replicas`; not sharded over them under tp yet). The TP
ranks of a group hold equal slices with equal gradients: no collective crosses the TP dimension for them.

Context parallelism (`cp=C`, train/context_parallel.py) splits each sample's sequence over C consecutive ranks:
the model is wrapped last, its gradients averaged over the dp x cp ranks (DDP over all of them, FSDP2 over the
flattened (fsdp, cp) ranks). With tp the ranks form one (fsdp, cp, tp) mesh; FSDP2 shards over its flattened
(fsdp, cp) dimensions even at fsdp=1 (DDP takes no DTensors: `Plan.shard_ranks`). With pp: train/pipeline.py.

Context with expert parallelism, `cp=C,ep=E[,fsdp=N]` (`cp=C,ep=E` alone is `dp=world/C`, DDP, as `ep=E` alone
is `dp=E`): rank r = d * C + c is CP rank c of data-parallel rank d. Expert parallelism splits the experts over
the flattened (data, cp) ranks, E consecutive ranks a group, the mesh (world / E, E) of the hybrid above
(Megatron-Core's MoE "parallel folding" folds EP over its CP x DP ranks the same way): a MoE layer routes the
tokens a rank holds, whichever part of which sequence they are, so any E ranks can share the experts, and
consecutive ones keep the all-to-all within a node beside the CP group's K/V gathers (at E = C a group is
one replica's CP ranks). The world / E ranks holding a slice average its gradients once per step. The rest is
averaged over all dp x cp ranks (DDP, or FSDP2 over the flattened (fsdp, cp) ranks), which divides out the CP
shares (train/context_parallel.py); the expert gradients come out the same: the all-to-all's backward sums
the CP ranks' shares of the ranks of a group, `ep` divides, the replicas average (train/expert_parallel.py).
Model families expose their repeated blocks as `model.layers` (an nn.ModuleList); that is all we need.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from timetotrain.errors import UserError
from timetotrain.fakes import data_parallel, real_host
from timetotrain.spec.task import Share
from timetotrain.train import float8
from timetotrain.train.context_parallel import ContextParallel
from timetotrain.train.embedding_parallel import shard_embeddings
from timetotrain.train.expert_fsdp import expert_placements
from timetotrain.train.expert_parallel import (
    apply_expert_parallel,
    ignore_experts_in_ddp,
    is_expert_sharded,
    mark_expert_slices,
    shard_expert_replicas,
)
from timetotrain.train.tensor_parallel import mark_stacked

KINDS = ("pp", "dp", "dp_replicate", "fsdp", "ep", "cp", "tp")
# Not a degree of the world: pipeline stages per rank (1: one stage, the 1F1B schedule; V > 1: V stages
# per rank, round-robin, the interleaved 1F1B schedule).
STAGE_KEYS = ("vpp",)
PRECISIONS = ("fp32", "bf16", "fp8")


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    dp_replicate: int = 1  # HSDP: FSDP2 over a (dp_replicate, fsdp) mesh, sharded over fsdp only
    fsdp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1  # pipeline stages (outermost mesh dimension: see `coords`)
    vpp: int = 1  # virtual pipeline stages per rank (interleaved 1F1B when > 1)
    cp: int = 1  # context parallel: ranks that split one sample's sequence
    precision: str = "fp32"  # fp32 | bf16 | fp8
    # Checkpoint every K-th block of `model.layers` (blocks 0, K, 2K, ...): 0 none, 1 all (`--ac`), K
    # `--ac-every K`. A bool is read as 0 or 1 (callers from before selective AC).
    activation_checkpointing: int = 0
    compile: bool = False
    # Under fp8 (train/float8.py): torchao's recipe, and the precision of what float8 does not cover
    # (bf16 on GPUs, fp32 on CPUs: preflight chooses by device).
    fp8_recipe: str = "tensorwise"
    high: str = "bf16"

    @property
    def compute(self) -> str:
        """fp32 or bf16: the precision of the non-float8 compute (every op, unless fp8)."""
        return self.high if self.precision == "fp8" else self.precision

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.dp_replicate * self.fsdp * self.cp * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples (all of them, for DDP, FSDP and HSDP; one per TP group)."""
        return self.dp * self.dp_replicate * self.fsdp

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP2 shards each parameter over: fsdp x cp (the CP ranks' gradients are reduced with
        the data-parallel ones, torchtitan's dp_shard_cp) where FSDP2 is in use, else 1. FSDP2 is in use
        under `fsdp`, and under cp with tp or pp even at fsdp=1: DDP takes no DTensors and a pipeline's
        stages have no DDP, so FSDP2 over the CP ranks averages their gradients."""
        if self.fsdp > 1 or (self.cp > 1 and (self.tp > 1 or self.pp > 1)):
            return self.fsdp * self.cp
        return 1

    @property
    def fully_sharded(self) -> bool:
        """FSDP2 wraps the model: it shards over `shard_ranks` > 1, or replicates under HSDP (at
        `dp_replicate=R,tp=T` with fsdp=1 its shard dimension has one rank: pure replication with DTensors)."""
        return self.shard_ranks > 1 or self.dp_replicate > 1

    @property
    def expert_shards(self) -> int:
        """The ranks FSDP2 shards each expert slice over (`expert_parallel.shard_expert_replicas`): the N / E
        ranks holding the same slice under `ep=E,fsdp=N` (E < N), with or without `pp`; 1 where the slices
        stay whole on every holder (E = N, DDP, and not yet with tp, cp or dp_replicate, whose replicas
        average them: `expert_parallel.average_expert_replicas`)."""
        if self.ep == 1 or self.fsdp <= self.ep or self.tp > 1 or self.cp > 1 or self.dp_replicate > 1:
            return 1
        return self.fsdp // self.ep

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors: built on the meta device and filled per shard (step._build_sharded)."""
        return self.fsdp > 1 or self.tp > 1

    def coords(self, rank: int) -> dict[str, int]:
        """Global `rank`'s place on the mesh, pipeline outermost and tensor innermost:
        (pp, dp_replicate, dp | fsdp, cp, tp), so rank = (((p * R + d) * S + f) * C + c) * T + t. TP groups
        are consecutive ranks (one node's fast links carry its all-reduces), then the context-parallel
        ranks of one sample, then the data-parallel ones; pipeline stages are the farthest apart (they
        exchange one activation per micro-batch)."""
        out = {}
        for kind, size in (("tp", self.tp), ("cp", self.cp), ("data", self.data_parallel), ("pp", self.pp)):
            out[kind] = rank % size
            rank //= size
        return out

    def data_rank(self, rank: int) -> int:
        """Which sample stream global `rank` reads: the TP and CP ranks of a group read the same one (CP
        ranks each keep their part of its sequence), and so do a pipeline's stages."""
        return self.coords(rank)["data"]

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in KINDS + STAGE_KEYS if getattr(self, k) > 1]
        parts = parts or ["single process"]
        return (
            ", ".join(parts)
            + (f", {self.precision}" if self.precision != "fp8" else f", fp8 {self.fp8_recipe} + {self.high}")
            + ac_text(self.activation_checkpointing, ", ")
            + (", compiled" if self.compile else "")
        )


def ac_text(every: int, sep: str = "") -> str:
    """How a run or a plan says its activation checkpointing: "" (none), "AC" (every block), "AC every 2nd
    block"."""
    every = int(every)
    if every <= 1:
        return f"{sep}AC" if every == 1 else ""
    nth = {2: "2nd", 3: "3rd"}.get(every, f"{every}th")
    return f"{sep}AC every {nth} block"


def ac_words(every: int) -> str:
    """Activation checkpointing in a sentence ("activation checkpointing ..."): off, on (every block), every
    2nd block."""
    return {0: "off", 1: "on"}.get(int(every)) or ac_text(every).removeprefix("AC ")


def ac_every(ac: bool, every: int | None, blocks: int | None = None) -> int:
    """`--ac` and `--ac-every K` as the one number `Plan.activation_checkpointing` holds: 0 none, 1 every block
    (`--ac`), K (`--ac-every K`, with or without `--ac`). One line for a K below 1 or above `blocks`."""
    if every is None:
        return 1 if ac else 0
    if every < 1:
        raise UserError(_ac_error(every, blocks))
    return check_ac_every(every, blocks)


def check_ac_every(every: int, blocks: int | None) -> int:
    """`every` as an int (0: no checkpointing), or one line when it cannot be applied to `blocks` blocks (None:
    not known here; `apply` checks the built model's)."""
    every = int(every)
    if every < 0 or (blocks is not None and every > blocks):
        raise UserError(_ac_error(every, blocks))
    return every


def _ac_error(every: int, blocks: int | None) -> str:
    top = f" up to the model's {blocks} blocks" if blocks is not None else ""
    return (
        f"--ac-every {every}: checkpoint every K-th block, K from 1 (every block, as --ac){top}; 2 wraps "
        "blocks 0, 2, 4, ..."
    )


def parse(spec: str | None, world: int, world_from: str = "torchrun started", **switches) -> Plan:
    """`None` means plain data parallel over all ranks. `world_from` says where `world` came from in the
    error line (`ttt run`: torchrun; `ttt plan`: its --gpus), so both commands read `--parallel` here."""
    degrees = dict.fromkeys(KINDS + STAGE_KEYS, 1)
    if not spec:
        degrees["dp"] = world
    else:
        for item in spec.split(","):
            key, sep, val = item.strip().partition("=")
            if key not in KINDS + STAGE_KEYS or not sep or not val.isdigit() or int(val) < 1:
                raise UserError(
                    f"--parallel {spec!r}: use comma-separated degrees like dp=8 or fsdp=8 "
                    f"({', '.join(KINDS + STAGE_KEYS)})"
                )
            degrees[key] = int(val)
        if degrees["tp"] > 1 and degrees["dp"] > 1:
            raise UserError(
                f"--parallel {spec!r}: tp does not combine with dp (DDP takes no DTensors); use tp=T,fsdp=F "
                "or tp=T,ep=E"
            )
        if degrees["tp"] > 1 and degrees["ep"] > 1 and degrees["fsdp"] == 1 and degrees["pp"] == 1:
            # The data-parallel ranks of a TP layout are FSDP2's (DDP takes no DTensors): `tp=T,ep=E` is
            # `tp=T,ep=E,fsdp=world/T` (module docstring; with pp: below).
            degrees["fsdp"] = max(1, world // degrees["tp"])
        if degrees["dp"] > 1 and degrees["fsdp"] > 1:
            raise UserError(
                f"--parallel {spec!r}: for dp x fsdp use HSDP, dp_replicate=R,fsdp=S (FSDP2 shards over S and "
                "replicates over R)"
            )
        if degrees["dp_replicate"] > 1:
            _check_hsdp(spec, degrees)
        if degrees["vpp"] > 1 and degrees["pp"] == 1:
            raise UserError(
                f"--parallel {spec!r}: vpp is the number of pipeline stages per rank; use it with pp, e.g. "
                "pp=4,vpp=2"
            )
        if degrees["ep"] > 1 and degrees["cp"] > 1:
            if any(degrees[k] > 1 for k in ("tp", "pp", "vpp", "dp_replicate")):
                raise UserError(
                    f"--parallel {spec!r}: cp with ep is built as cp=C,ep=E with dp or fsdp only (not with tp, "
                    "pp or dp_replicate yet)"
                )
            # `cp=C,ep=E` is `dp=world/C` (DDP, as `ep=E` alone is `dp=E`); the experts split over groups
            # of E consecutive ranks of the flattened (data, cp) ranks (module docstring).
            if degrees["fsdp"] == 1 and degrees["dp"] == 1:
                degrees["dp"] = max(1, world // degrees["cp"])
            ranks = degrees["dp"] * degrees["fsdp"] * degrees["cp"]
            if ranks % degrees["ep"]:
                raise UserError(
                    f"--parallel {spec!r}: ep must divide the {ranks} data- and context-parallel ranks (the "
                    "experts are split over groups of ep of them); use an ep that divides dp x cp or fsdp x cp"
                )
        if degrees["ep"] > 1 and degrees["pp"] > 1:
            if any(degrees[k] > 1 for k in ("dp", "dp_replicate", "vpp")):
                raise UserError(
                    f"--parallel {spec!r}: pipeline with expert parallelism is built as "
                    "pp=P[,tp=T],ep=E[,fsdp=N] only (not with dp, dp_replicate or vpp yet)"
                )
            # A stage's data-parallel ranks are FSDP2's (a pipeline has no DDP): `pp=P[,tp=T],ep=E` is
            # `fsdp=world/(P x T)` (train/pipeline_moe.py); at least E, so a world too small is refused by the
            # process count below.
            if degrees["fsdp"] == 1:
                degrees["fsdp"] = max(degrees["ep"], world // (degrees["pp"] * degrees["tp"]))
        solo = degrees["ep"] > 1 and degrees["cp"] == 1  # (with cp: checked above)
        if solo and (degrees["fsdp"] > 1 or degrees["tp"] > 1):
            if degrees["fsdp"] % degrees["ep"]:
                tp = f"tp={degrees['tp']}," if degrees["tp"] > 1 else ""
                raise UserError(
                    f"--parallel {spec!r}: ep must divide fsdp (the experts are split over groups of ep of "
                    f"the ranks FSDP2 shards the rest over); use {tp}ep=E,fsdp=N with N a multiple of E"
                )
        elif solo:
            degrees["dp"] = degrees["dp"] if degrees["dp"] > 1 else world
            if degrees["ep"] != degrees["dp"]:
                raise UserError(
                    f"--parallel {spec!r}: ep must equal the data-parallel degree ({degrees['dp']})"
                )
    plan = Plan(**degrees, **switches)
    if plan.world != world:
        raise UserError(
            f"--parallel {spec or 'dp'} needs {plan.world} processes but {world_from} {world}: "
            + ("match --nproc_per_node x --nnodes" if world_from == "torchrun started" else "make them equal")
        )
    if plan.precision not in PRECISIONS:
        raise UserError(f"--precision {plan.precision!r}: choose {', '.join(PRECISIONS)}")
    return plan


def _check_hsdp(spec: str, degrees: dict[str, int]) -> None:
    """HSDP's replica count combines with fsdp (`dp_replicate=R,fsdp=S`), with tp (`dp_replicate=R[,fsdp=S],tp=T`:
    FSDP2 over the (replicate, shard) sub-mesh of one 3-D mesh, at S = 1 pure replication) and with ep
    dividing fsdp (`dp_replicate=R,fsdp=S,ep=E`, checked with `ep,fsdp`); not with dp, nor with tp and ep or
    tp and cp together."""
    k = degrees
    if k["dp"] > 1 or (k["fsdp"] == 1 and k["tp"] == 1):
        raise UserError(
            f"--parallel {spec!r}: dp_replicate is HSDP's replica count and combines with fsdp or tp; use "
            "dp_replicate=R,fsdp=S[,tp=T] or dp_replicate=R,fsdp=S,ep=E (or dp=N for plain data parallelism)"
        )
    if k["tp"] > 1 and (k["ep"] > 1 or k["cp"] > 1):
        raise UserError(
            f"--parallel {spec!r}: dp_replicate with tp is built without ep and cp (not yet); use "
            "dp_replicate=R,fsdp=S,tp=T, or tp=T,ep=E,fsdp=N"
        )


def check_tensor_parallel(family, cfg, spec: str | None, tp: int, task=None) -> None:
    """What `apply` would refuse of `tp` for the family (no plan, or heads that do not divide), said before
    building anything (`ttt run`'s preflight, `ttt plan`); with the benchmark's `task`, also a task that
    decodes (GRPO's rollouts), which the plans do not cover: they cut the training forward only."""
    if family.tensor_parallel is None:
        raise UserError(f"--parallel {spec}: the {family.name} family has no tensor-parallel plan")
    if getattr(task, "on_policy", False):
        raise UserError(
            f"--parallel {spec}: this task decodes rollouts, which the {family.name} tensor-parallel plan does "
            "not (it cuts the training forward only): leave tp out"
        )
    if family.tensor_parallel_check is not None:
        family.tensor_parallel_check(cfg, tp)


def batch_share(global_batch_size: int, plan: Plan, rank: int = 0) -> Share:
    """Global `rank`'s part of every global batch (that of its data-parallel rank, `Plan.data_rank`), or one
    line saying the batch does not split: the one place a rank's share is computed (the task receives it)."""
    if global_batch_size % plan.data_parallel:
        raise UserError(
            f"global_batch_size {global_batch_size} is not divisible by {plan.data_parallel} "
            "data-parallel ranks: change --set global_batch_size or the process count"
        )
    return Share.of(global_batch_size, plan.data_rank(rank), plan.data_parallel)


def check_batch_split(global_batch_size: int, plan: Plan) -> int:
    """Samples per data-parallel rank, or one line saying the batch does not split (`ttt run` and `ttt plan`
    both ask here)."""
    return batch_share(global_batch_size, plan).local


def check_eval_split(eval_samples: int, plan: Plan) -> None:
    """Under expert parallelism every rank takes part in every eval forward (its all-to-alls), so the eval
    samples split evenly over the data-parallel ranks or `ttt run` refuses in one line (`ttt plan` asks here
    too, so that it never suggests such a layout)."""
    if plan.ep > 1 and eval_samples % plan.data_parallel:
        raise UserError(
            f"eval_samples {eval_samples} must divide over {plan.data_parallel} expert-parallel ranks: change "
            "--set eval_samples or the layout"
        )


def apply(model: nn.Module, plan: Plan, device: torch.device, family):
    """Wrap `model` per plan. Returns (the module to call: the same object for FSDP2, a DDP wrapper else;
    the expert-parallel process group or None). Tensor parallelism is the family's own plan
    (`family.tensor_parallel`; a family without one refuses `tp`). Expert sharding comes first after it:
    it slices the experts of the initialised model (or of the meta model the sharded build fills later),
    before checkpoint wrappers, compile, DDP or FSDP2 see the parameters."""
    if plan.pp > 1:  # a pipeline's stages are built and wrapped by train/pipeline.build instead
        raise ValueError("parallel.apply does not build pipeline stages: use train/pipeline.build")
    wrapped, ep_group, cp = _apply(model, plan, device, family)
    if plan.cp > 1:  # outermost: it hands the model its part of each sequence (train/context_parallel.py)
        wrapped = ContextParallel(wrapped, plan, dist.get_rank(), cp)
    return wrapped, ep_group


def _apply(model: nn.Module, plan: Plan, device: torch.device, family):
    """`apply` less the CP wrapper; returns (module, expert-parallel group, the mesh's CP group or None)."""
    ep_group = cp = None
    fsdp_mesh = None
    if plan.precision == "fp8":  # first: TP, AC, compile and FSDP2 then see the float8 linears
        float8.convert(model, plan.fp8_recipe, plan.fsdp > 1, device)
    if plan.tp > 1:
        check_tensor_parallel(family, getattr(model, "cfg", None), f"tp={plan.tp}", plan.tp)
        if plan.dp_replicate > 1:
            # HSDP x TP: one (replicate, shard, tp) mesh in `Plan.coords` order, TP innermost; FSDP2 shards over
            # the 2-D (replicate, shard) sub-mesh (gathers within S ranks, gradients all-reduced over R).
            mesh = device_mesh(
                device.type, (plan.dp_replicate, plan.fsdp, plan.tp), ("dp_replicate", "fsdp", "tp")
            )
            fsdp_mesh = mesh["dp_replicate", "fsdp"]
        elif plan.cp > 1:
            # One (fsdp, cp, tp) mesh in `Plan.coords` order: TP cuts within a CP rank's sequence part, the CP
            # group is its cp slice, FSDP2 shards over the flattened (fsdp, cp) ranks.
            mesh = device_mesh(device.type, (plan.fsdp, plan.cp, plan.tp), ("fsdp", "cp", "tp"))
            with real_host():
                cp = mesh["cp"].get_group()
                fsdp_mesh = mesh["fsdp", "cp"]._flatten("fsdp_cp")
        else:
            mesh = device_mesh(device.type, (plan.fsdp, plan.tp), ("fsdp", "tp"))
            fsdp_mesh = mesh["fsdp"]
        styles = {}
        if plan.precision == "fp8" and plan.fp8_recipe == "tensorwise":
            styles = float8.tensor_parallel_styles(device)
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        family.tensor_parallel(model, mesh["tp"], **styles)
        # torch's SequenceParallel makes new Parameters of the norm weights, trainable whatever they were:
        # a LoRA model's frozen norms would train under tp and not in one process.
        for n, p in model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
        remark(model, plan)
    if plan.ep > 1:
        replicas = experts_mesh = None
        if plan.ep == plan.world:
            # A group of its own keeps the all-to-alls apart from DDP's all-reduces and FSDP2's collectives.
            ep_group = dist.new_group(list(range(plan.ep)))
        elif plan.tp == 1:  # ep=E,fsdp=N (module docstring): rank r is expert rank r % E of group r // E
            mesh = device_mesh(device.type, (plan.world // plan.ep, plan.ep), ("replica", "ep"))
            with real_host():
                ep_group, replicas = mesh["ep"].get_group(), mesh["replica"].get_group()
            # FSDP2 shards each slice over its replicas (`Plan.expert_shards`), else they average it.
            experts_mesh = mesh if plan.expert_shards > 1 else None
        else:  # tp=T,ep=E,fsdp=N (module docstring): one expert-parallel group per TP index j
            shape = (plan.data_parallel // plan.ep, plan.ep, plan.tp)
            mesh = device_mesh(device.type, shape, ("replica", "ep", "tp"))
            ep_group = mesh["ep"].get_group()
            replicas = mesh["replica"].get_group() if shape[0] > 1 else None
        # FSDP2 casts only the parameters it manages to bf16; the expert slices it ignores compute under
        # autocast instead (DDP runs the whole forward under autocast already).
        bf16_experts = plan.compute == "bf16" and plan.fsdp > 1
        apply_expert_parallel(
            model, ep_group, torch.bfloat16 if bf16_experts else None, replicas, experts_mesh
        )
    blocks = model.layers
    every = check_ac_every(plan.activation_checkpointing, len(blocks))
    if every:
        for i, block in enumerate(blocks):
            if i % every == 0:
                blocks[i] = checkpoint_wrapper(block)
    if plan.compile:
        for block in blocks:
            block.compile()
    if plan.fully_sharded:
        if fsdp_mesh is None and plan.dp_replicate > 1:
            # HSDP: on a 2-D mesh `fully_shard` shards over the last dimension (fsdp consecutive ranks) and
            # replicates over the first: a gradient reduce-scatter within a shard group, then an all-reduce
            # across the replicas; parameters are gathered within a shard group only.
            # Under cp the shard dimension is the flattened (fsdp, cp) ranks (consecutive: `Plan.coords`), so
            # that the CP ranks' gradients are summed with the data-parallel ones.
            shape = (plan.dp_replicate, plan.fsdp * plan.cp)
            fsdp_mesh = device_mesh(device.type, shape, ("dp_replicate", "fsdp"))
        elif fsdp_mesh is None:  # the mesh `fully_shard` would make itself, made here (see `device_mesh`)
            fsdp_mesh = device_mesh(device.type, (plan.fsdp * plan.cp,), ("fsdp",))

        # bf16 compute with fp32 master weights and an fp32 gradient reduce-scatter.
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if plan.compute == "bf16" else None, reduce_dtype=torch.float32
        )
        # The expert slices sharded over their replicas get an FSDP2 wrap of their own first (the blocks'
        # then leave them to it); whole slices differ per rank: FSDP2 must neither shard nor reduce them.
        shard_expert_replicas(model, mp.param_dtype)
        ignored = placement = None
        if ep_group is not None:
            ignored = {p for p in model.parameters() if is_expert_sharded(p) and not isinstance(p, DTensor)}
            ignored = ignored or None
        else:
            # Without ep FSDP2 shards the whole expert stacks: on a dimension that splits evenly over its
            # ranks, not dim 0 padded to one expert per rank where they outnumber the experts (expert_fsdp.py).
            placement = expert_placements(model, fsdp_mesh.size(fsdp_mesh.ndim - 1))
        wrap = dict(mesh=fsdp_mesh, mp_policy=mp, ignored_params=ignored, shard_placement_fn=placement)
        for block in blocks:
            fully_shard(block, **wrap)
        # The root too: blocks outside `model.layers` (DeepSeek's MTP) hold experts.
        fully_shard(model, **wrap)
        remark(model, plan)
        return model, ep_group, cp
    if plan.dp > 1 or plan.cp > 1:  # cp alone too: its ranks' gradients are averaged like dp's
        if ep_group is not None:
            # Each rank holds different experts: DDP must neither broadcast nor average them.
            ignore_experts_in_ddp(model)
        # A model some of whose parameters cannot reach the loss (R-GAT's last layer into node types other
        # than the target's, as in the reference) says so; DDP then looks for them each step.
        unused = getattr(model, "has_unused_parameters", False)
        if plan.ep == 1:
            # Embedding tables (DLRM) are model-parallel: table-wise and row-wise shards, all-to-all of the
            # pooled rows (train/embedding_parallel.py); DDP averages only the dense part.
            sharded = shard_embeddings(model, dist.get_rank(), plan.dp)
            if sharded:
                DDP._set_params_and_buffers_to_ignore_for_model(model, sharded)
        # (Under `ttt plan --simulate`, whose tensors are fake, a stand-in that holds DDP's buckets.)
        ids = [device.index] if device.type == "cuda" else None
        return data_parallel(model, device_ids=ids, find_unused_parameters=unused), ep_group, cp
    return model, ep_group, cp


def shard_tables_before_fill(model: nn.Module, plan: Plan) -> None:
    """Under `dp=N`, cut the meta model's tables (hstu's FusedEmbedding, DLRM's FusedEmbeddingBag) into this
    rank's shards before `to_empty`, so that the rank allocates, initialises and trains its own rows only
    (hstu's reference tables are 600 GB, DLRM's 97 GiB: more than an 80 GiB GPU holds, which the whole build
    of DLRM's needed until `ttt plan --simulate` showed it); `apply` then finds them sharded."""
    if plan.dp > 1 and plan.ep == 1 and not plan.sharded:
        shard_embeddings(model, dist.get_rank(), plan.dp)


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """`init_device_mesh`, outside any fake-tensor mode. A mesh is host bookkeeping (the rank ids sit in a
    tensor it reads back), so under `ttt plan --simulate`, which builds the model under FakeTensorMode, it
    must still hold real ids (timetotrain/fakes.py); without a fake mode this is `init_device_mesh`."""
    with real_host():
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def remark(model: nn.Module, plan: Plan) -> None:
    """Put back the marks the harness keeps on parameters, tensor parallelism's stacked layouts and expert
    parallelism's slices (with their gradient hooks), after anything that replaced the parameter objects:
    FSDP2's sharding and its lazy initialisation at the first forward, `to_empty`. Idempotent, so it is
    called after each such step."""
    if plan.tp > 1:
        mark_stacked(model)
    if plan.ep > 1:
        mark_expert_slices(model)


def forwards_are_collective(model: nn.Module) -> bool:
    """Whether a forward of `model` calls collectives: FSDP2- or TP-sharded parameters (DTensors) or expert
    slices (all-to-alls). Then every rank must make the same number of forwards: a decode loop may not stop
    early on one rank (rollout.RolloutEngine's `lockstep`)."""
    return any(isinstance(p, DTensor) or is_expert_sharded(p) for p in model.parameters())


def autocast_dtype(plan: Plan) -> torch.dtype | None:
    """FSDP2 casts parameters itself; DDP and single-process runs use autocast for bf16."""
    # (under tp alone too: its DTensors keep their dtype)
    if plan.compute == "bf16" and not plan.fully_sharded:
        return torch.bfloat16
    return None


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation, under DDP.

    FSDP2 reduce-scatters every micro-batch instead: skipping its sync keeps each block's unsharded fp32
    gradient until the last micro-batch, a whole model's gradients on every rank (`ttt plan --simulate`
    found it: +0.81 GiB per llama31_8b layer under fsdp=8, ~27 GiB per GPU; for llama31_405b under tp=8
    it would be 4 B x 50.6 B parameters per TP rank, ~200 GB), which undoes the sharding. The sharded gradients accumulate in fp32 across micro-batches; the price is one
    reduce-scatter per micro-batch (torchtitan makes the same choice)."""
    if enabled or not hasattr(model, "no_sync"):  # not DDP: FSDP2 (above) or a single process
        yield
    else:
        with model.no_sync():
            yield
