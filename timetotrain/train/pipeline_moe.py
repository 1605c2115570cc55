"""Mixture-of-experts under pipeline parallelism (`--parallel pp=P[,tp=T],ep=E[,fsdp=N]`, train/pipeline.py):
what a stage of an MoE model needs beyond a dense decoder's. Built for deepseek_v3 and gpt_oss (whose plain
decoder forward, routers without aux loss or bias, need only the expert parallelism and the telemetry below).

Expert parallelism within a stage. The ranks are laid out pipeline outermost (`parallel.Plan.coords`): rank
p x N + d is data-parallel rank d of stage p. The experts of every MoE layer are split over groups of E
consecutive data-parallel ranks of the same stage, a (pp, N / E, E) mesh; where N > E FSDP2 shards each
slice over the N / E ranks of the stage that hold it (`expert_parallel.shard_expert_replicas`), as in the
`ep=E,fsdp=N` hybrid, and everything else of a stage over its N ranks. torch's schedule turns FSDP2's
resharding and gradient reduction off until the step's last micro-batch; the slices' wraps are turned back
on for every micro-batch (`--set pp_reduce=experts`, the default: train/pipeline_reduce.py), so a rank holds
one layer's slice gathered at a time and the slices' gradients as shards, not every slice gathered (compute
precision) with its fp32 gradient whole through the step (`ttt plan`'s pp rows).

With tensor parallelism (`pp=P,tp=T,ep=E[,fsdp=N]`): the family's TP plan cuts each stage's attention (and
DeepSeek's shared expert) and leaves the router and routed experts whole on each TP rank's whole tokens
(models/gpt_oss/parallelize.py), as `tp=T,ep=E,fsdp=N` does without a pipeline; the experts split over the stage's data-parallel ranks, one expert-parallel group
per TP index: a (pp, N / E, E, T) mesh in `parallel.Plan.coords` order, TP innermost. The N / E holders of a
slice keep it whole and average its gradient (`expert_parallel.average_expert_replicas`; not sharded under
tp, `Plan.expert_shards`). A boundary carries each rank's sequence shard of the stream and of MTP's inputs.

The loss. One process's training loss is LM + MTP + the sum of every MoE layer's sequence aux loss. The
routers live on different stages; only the last stage's output reaches the schedule's loss. An earlier
stage's aux losses enter the backward through `_AuxIntoBackward` (Megatron's `MoEAuxLossAutoScaler` does the
same): its output is the stage's activation unchanged, its backward hands each aux loss a gradient of 1, as
if it had been added to the micro-batch's loss, which the schedule then scales by 1 / micro-batches with
the rest. Their values (no gradient) are summed per stage over the step (`Stage.aux_total`) and added to the
reported loss by `Pipeline.forward_backward`, so the logged train_loss is one process's.

Multi-token prediction sits on the last stage with the norm and head: its depths need the embedding of
the tokens k positions ahead, and the embedding is the first stage's. The first stage embeds them
(`DeepSeekV3.mtp_inputs`) and the stage boundaries carry them beside the residual stream, `[micro, T,
(1 + D) x dim]`, so their gradient returns to the one embedding through the pipeline's own backward: no
copy of the embedding, no extra collective. Evaluation (the LM loss only) carries the stream alone.

Router state. The auxiliary-loss-free balancing bias moves once per step from the loads summed over the
global batch: each stage sums its routers' loads over its own data-parallel ranks (`Owned.update_router_
bias`). The telemetry (tokens per expert, biases) is gathered from all stages into one process's layer order,
main layers then the MTP blocks, on every rank (`Owned.tokens_per_expert`, `Owned.router_biases`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from timetotrain.fakes import real_host
from timetotrain.models.common.moe import MoE


class _AuxIntoBackward(torch.autograd.Function):
    """`x` unchanged forward; backward passes x's gradient on and gives `aux` a gradient of 1."""

    @staticmethod
    def forward(ctx, x, aux):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


def aux_into_backward(x: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    return x if aux is None else _AuxIntoBackward.apply(x, aux)


def aux_losses(modules) -> torch.Tensor | None:
    """The sum of the aux losses the MoE layers under `modules` computed in their last forward (None: none)."""
    found = [
        m.router.aux_loss
        for module in modules
        for m in module.modules()
        if isinstance(m, MoE) and getattr(m.router, "aux_loss", None) is not None
    ]
    return torch.stack(found).sum() if found else None


def expert_mesh(device_type: str, plan, device_mesh):
    """(expert-parallel group, replica group or None, this stage's ("replica", "ep") mesh where FSDP2 shards
    the slices over their replicas, else None) of this rank: the (pp, N / E, E[, T]) mesh (module
    docstring)."""
    data = plan.dp * plan.fsdp
    shape, names = (plan.pp, data // plan.ep, plan.ep), ("pp", "replica", "ep")
    if plan.tp > 1:  # one expert-parallel group per TP index, TP innermost (`Plan.coords`)
        shape, names = (*shape, plan.tp), (*names, "tp")
    mesh = device_mesh(device_type, shape, names)
    with real_host():
        stage = mesh["replica", "ep"] if plan.expert_shards > 1 else None
        return mesh["ep"].get_group(), mesh["replica"].get_group() if data > plan.ep else None, stage


class Owned(nn.Module):
    """This rank's stages of an MoE model under the model's own names, with the router state and telemetry
    a whole model offers (`update_router_bias`, `tokens_per_expert`, `router_biases`) across stages."""

    def __init__(self, moes: list[MoE | None], n_experts: int, device, stage_group, pipe_group):
        super().__init__()
        self.n_experts, self.device = n_experts, device
        # Every MoE layer of the model in its order (main layers, then MTP blocks); None where another
        # stage holds it. Outside the module tree: the stages hold them already.
        self.__dict__["moes"] = moes
        self.__dict__["stage_group"] = stage_group  # this stage's data-parallel ranks
        self.__dict__["pipe_group"] = pipe_group  # the ranks of one pipeline (one per stage)

    @classmethod
    def of(cls, model: nn.Module, stages, plain: nn.Module, n_experts: int, device, stage_group, pipe_group):
        """`plain` (`pipeline.owned(stages)`) as an `Owned`: the same children under the same names."""
        held = {id(m) for stage in stages for m in stage.modules()}
        # The model's MoE layers in its module order: main layers, then DeepSeek's MTP blocks (`moe_layers`).
        moes = [m if id(m) in held else None for m in model.modules() if isinstance(m, MoE)]
        out = cls(moes, n_experts, device, stage_group, pipe_group)
        for name, child in plain.named_children():
            setattr(out, name, child)
        return out

    def _mine(self) -> list[MoE]:
        return [m for m in self.moes if m is not None]

    def update_router_bias(self, reduce=None) -> None:
        """As `DeepSeekV3.update_router_bias`, the loads summed over this stage's data-parallel ranks (the
        harness's whole-world `reduce` would mix the stages' layers)."""
        mine = [m for m in self._mine() if hasattr(m.router, "update_bias")]  # (gpt-oss: no bias)
        if not mine:
            return
        loads = torch.stack([m.router.load for m in mine])
        if dist.get_world_size(self.stage_group) > 1:
            dist.all_reduce(loads, group=self.stage_group)
        for m, load in zip(mine, loads, strict=True):
            m.router.update_bias(load)

    def _gathered(self, read) -> torch.Tensor:
        rows = torch.zeros(len(self.moes), self.n_experts, dtype=torch.float64, device=self.device)
        for i, m in enumerate(self.moes):
            if m is not None:
                rows[i] = read(m).to(torch.float64)
        dist.all_reduce(rows, group=self.pipe_group)  # each row from the one stage that holds it
        return rows

    def tokens_per_expert(self) -> torch.Tensor:
        """`[MoE layers, n_experts]` of the last training forward, every stage's layers (module docstring)."""
        return self._gathered(lambda m: m.tokens_per_expert).round().long()

    def router_biases(self) -> torch.Tensor:
        return self._gathered(lambda m: m.router.bias).float()
