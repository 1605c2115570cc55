"""The optimizers the benchmarks' rules name (AdamW, Adam with their weight-decay masks; Adagrad), and the
pair of a dense optimizer with row-wise Adagrad on the embedding tables (dlrmv4: `Optimizer.tables`)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from timetotrain.spec.benchmark import Optimizer
from timetotrain.train.adagrad import SparseAdagrad


def param_groups(model: nn.Module | list, weight_decay: float, mask: str = "megatron") -> list[dict]:
    """The parameters of `model` (or a list of them) in decay groups. mask "megatron": no decay on biases and
    other 1-D tensors (norm weights); "all": decay everything (torchtitan's Flux)."""
    if mask not in ("megatron", "all"):
        raise ValueError(f"unknown weight-decay mask {mask!r}")
    decay, no_decay = [], []
    for p in model.parameters() if isinstance(model, nn.Module) else model:
        if not p.requires_grad:
            continue
        (no_decay if mask == "megatron" and p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: nn.Module, spec, lr: float, fused: bool | None = None, foreach: bool = True, tables=None
) -> torch.optim.Optimizer:
    """`spec` is a `spec.benchmark.Optimizer`. `fused=None` picks the fused kernel where the device has one, else
    the foreach implementation (sharded DTensor parameters need foreach: pass fused=False), or with
    `foreach=False` the per-parameter loop (parameters of different meshes or placements in one list, as
    tensor parallelism leaves them, cannot share a foreach kernel). Where `spec.tables` names the embedding
    tables' own optimizer, `tables` are those parameters (the family's `table_parameters`): they get it, the
    rest `spec`'s, stepped together as one `OptimizerPair` at the same LR."""
    if spec.tables is not None:
        if not tables:
            raise ValueError(
                f"optimizer {spec.name!r} with a table optimizer needs the model's table parameters"
            )
        skip = {id(p) for p in tables}
        dense = _build(model, replace(spec, tables=None), lr, fused, foreach, skip=skip)
        return OptimizerPair(dense, _build(model, spec.tables, lr, fused, foreach, keep=skip))
    return _build(model, spec, lr, fused, foreach)


def _build(model, spec, lr, fused, foreach, skip=frozenset(), keep=None) -> torch.optim.Optimizer:
    kinds = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    chosen = [
        p
        for p in model.parameters()
        if p.requires_grad and id(p) not in skip and (keep is None or id(p) in keep)
    ]
    if spec.name == "adagrad":  # row-sparse for embedding tables, torch's update for the rest
        return SparseAdagrad(chosen, lr, spec.eps, spec.rowwise)
    if spec.name not in kinds:
        raise ValueError(f"unknown optimizer {spec.name!r}: choose one of {', '.join(kinds)}")
    params = _apart_by_kind(param_groups(chosen, spec.weight_decay, spec.decay_mask))
    dev = chosen[0].device
    if fused is None:
        fused = dev.type in ("cuda", "cpu")
    kwargs = {"fused": True} if fused else {"foreach": foreach}
    cls = kinds[spec.name]
    try:
        return cls(params, lr=lr, betas=spec.betas, eps=spec.eps, **kwargs)
    except (RuntimeError, TypeError):
        return cls(params, lr=lr, betas=spec.betas, eps=spec.eps)


class OptimizerPair:
    """Two optimizers over disjoint parameters stepped as one: the dense parameters' and the embedding
    tables' (dlrmv4: Adam and row-wise Adagrad, yambda_5b.gin:97-122). `param_groups` is both lists, the
    same group dicts, so `set_lr` and the schedule reach both at one LR."""

    def __init__(self, dense: torch.optim.Optimizer, tables: torch.optim.Optimizer):
        self.dense, self.tables = dense, tables
        self.defaults = dense.defaults

    @property
    def param_groups(self) -> list[dict]:
        # Read each time: `load_state_dict` (a checkpoint's) gives each optimizer new group dicts.
        return self.dense.param_groups + self.tables.param_groups

    @property
    def state(self) -> dict:
        return {**self.dense.state, **self.tables.state}

    def step(self, closure=None):
        loss = self.dense.step(closure)
        self.tables.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none)
        self.tables.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict(), "tables": self.tables.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dense.load_state_dict(state["dense"])
        self.tables.load_state_dict(state["tables"])


def parts(opt) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers `opt` is: both of an `OptimizerPair`, else `opt` itself (checkpoints hand them
    to torch.distributed.checkpoint, which takes optimizers, not a pair)."""
    return (opt.dense, opt.tables) if isinstance(opt, OptimizerPair) else (opt,)


def _apart_by_kind(groups: list[dict]) -> list[dict]:
    """Each group split into its DTensor and its plain parameters, when it holds both (FSDP2 shards next
    to expert-parallel slices, which FSDP2 leaves plain): a foreach kernel takes one kind or the other.
    AdamW's update is elementwise, so the grouping changes no value."""
    out = []
    for g in groups:
        sharded = [p for p in g["params"] if isinstance(p, DTensor)]
        plain = [p for p in g["params"] if not isinstance(p, DTensor)]
        if sharded and plain:
            out += [{**g, "params": sharded}, {**g, "params": plain}]
        else:
            out.append(g)
    return out


def build_adamw(
    model: nn.Module, lr: float, betas, eps: float, weight_decay: float, fused: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW with Megatron's decay mask (kept for callers that have no optimizer spec)."""
    return build_optimizer(model, Optimizer("adamw", tuple(betas), eps, weight_decay), lr, fused)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
