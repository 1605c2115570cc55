"""What a benchmark and its tiers are, as data. One module per benchmark fills these in
(docs/adding-a-benchmark.md)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from timetotrain.errors import UserError
from timetotrain.models.family import ModelFamily
from timetotrain.tasks.base import Task


@dataclass(frozen=True)
class Tier:
    """One size of a benchmark: model shape, data, batch, schedule lengths, eval cadence, target, runs."""

    name: str
    model: Any  # the family's config dataclass
    data: Any  # the task's data spec (e.g. tasks.causal_lm.LMData)
    global_batch_size: int
    micro_batch_size: int
    lr: float
    end_lr: float
    warmup_steps: int
    max_steps: int
    eval_every_samples: int
    eval_samples: int
    target: float
    runs: int
    division: str
    description: str = ""

    @property
    def grad_accum(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def eval_every_steps(self) -> int:
        """Eval points are in samples; rounded up to whole steps (MLPerf training rules, "Evaluation")."""
        return math.ceil(self.eval_every_samples / self.global_batch_size)

    @property
    def decay_steps(self) -> int:
        return self.max_steps - self.warmup_steps


# Fields a user may change with --set (plus the task's `settable` data fields); the model shape is part of
# the tier, not a knob.
SETTABLE = (
    "global_batch_size",
    "micro_batch_size",
    "lr",
    "end_lr",
    "warmup_steps",
    "max_steps",
    "eval_every_samples",
    "eval_samples",
    "target",
    "division",
)


@dataclass(frozen=True)
class Optimizer:
    """The optimizer a benchmark's rules fix, and how its constants are logged."""

    name: str = "adamw"  # "adamw" | "adam" (the log's `opt_name`)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float | None = None  # global-norm gradient clipping, None for none
    # Which parameters decay: "megatron" (not biases and other 1-D tensors such as norm weights) or "all".
    decay_mask: str = "megatron"
    schedule_name: str | None = None  # logged as opt_learning_rate_decay_schedule when given

    def log_keys(self) -> list[tuple[str, object]]:
        p = f"opt_{self.name}_"
        keys = [
            ("opt_name", self.name),
            (p + "beta_1", self.betas[0]),
            (p + "beta_2", self.betas[1]),
            (p + "epsilon", self.eps),
            (p + "weight_decay", self.weight_decay),
        ]
        if self.clip is not None:
            keys.append(("opt_gradient_clip_norm", self.clip))
        if self.schedule_name is not None:
            keys.append(("opt_learning_rate_decay_schedule", self.schedule_name))
        return keys


@dataclass(frozen=True)
class Benchmark:
    """A benchmark as data: its task, model family, tiers, optimizer and schedule rules, and closed rules."""

    name: str
    area: str
    task: Task
    family: ModelFamily
    tiers: dict[str, Tier]
    optimizer: Optimizer
    schedule: str  # the reference framework's schedule, see train/schedule.py (nemo, megatron, ...)
    closed_rules: tuple[str, ...] = ()  # official yaml files under mlperf_logging/compliance_checker
    # GBS -> (lr, warmup_steps) of the reference convergence points, used when --set changes the GBS.
    rcp_hparams: dict[int, tuple[float, int]] = field(default_factory=dict)
    listed: bool = True  # False: a test-only benchmark, not shown by `ttt list`
    # Where the rule files of our (non-reference) tiers live, as `<name>_<tier>.yaml`; the official engine
    # checks the logs of those tiers against them.
    rules_dir: Path = Path(__file__).parent / "rules"

    @property
    def metric(self) -> str:
        return self.task.metric.describe()

    def tier(self, name: str) -> Tier:
        if name not in self.tiers:
            raise UserError(
                f"--tier {name!r} is unknown for {self.name}: choose one of {', '.join(self.tiers)}"
            )
        return self.tiers[name]

    def hyperparameters(self, tier: Tier, accum: int | None = None) -> list[tuple[str, object]]:
        return self.task.hyperparameters(self, tier, accum or tier.grad_accum)

    def flops_per_sample(self, tier: Tier) -> float:
        return self.task.flops_per_sample(self.family, tier)


def apply_overrides(bench: Benchmark, tier: Tier, sets: list[str]) -> Tier:
    """`--set key=value` with type conversion; a new GBS takes the RCP's LR and warmup unless also set."""
    changes: dict[str, Any] = {}
    data_changes: dict[str, Any] = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not raw:
            raise UserError(f"--set {item!r} is not key=value (e.g. --set lr=2e-3)")
        if key in bench.task.settable:
            data_changes[key] = _parse(key, raw, type(getattr(tier.data, key)))
            continue
        if key not in SETTABLE:
            choices = ", ".join((*SETTABLE, *bench.task.settable))
            raise UserError(f"--set {key!r} is not a setting: choose from {choices}")
        changes[key] = _parse(key, raw, type(getattr(tier, key)))
    if data_changes:
        changes["data"] = dataclasses.replace(tier.data, **data_changes)
    gbs = changes.get("global_batch_size")
    if gbs is not None and gbs in bench.rcp_hparams:
        lr, warmup = bench.rcp_hparams[gbs]
        changes.setdefault("lr", lr)
        changes.setdefault("warmup_steps", warmup)
        if "end_lr" not in changes:
            changes["end_lr"] = changes["lr"] * tier.end_lr / tier.lr
    if "micro_batch_size" not in changes and gbs is not None and tier.micro_batch_size > gbs:
        changes["micro_batch_size"] = gbs
    new = dataclasses.replace(tier, **changes)
    validate(bench, new)
    return new


def _parse(key: str, raw: str, kind: type):
    try:
        if kind is int:
            value = float(raw)  # accepts 1e6 as well as 1000000
            if not value.is_integer():
                raise ValueError
            return int(value)
        value = kind(raw)
        if kind is float and not math.isfinite(value):
            # float() accepts nan and inf; a non-finite rate or target would only show as a NaN loss later.
            raise UserError(f"--set {key}={raw}: must be a finite number")
        return value
    except ValueError as e:
        raise UserError(
            f"--set {key}={raw}: expected {'an integer' if kind is int else 'a ' + kind.__name__}"
        ) from e


def setting(tier: Tier, name: str):
    """The value of a `--set` name: a Tier field or a field of the task's data spec."""
    return getattr(tier, name) if name in SETTABLE else getattr(tier.data, name)


def validate(bench: Benchmark, t: Tier) -> None:
    for key in ("global_batch_size", "micro_batch_size", "max_steps", "eval_samples", "eval_every_samples"):
        if getattr(t, key) <= 0:
            raise UserError(f"--set {key}={getattr(t, key)}: must be positive")
    if t.global_batch_size % t.micro_batch_size:
        raise UserError(
            f"--set micro_batch_size={t.micro_batch_size} must divide global_batch_size={t.global_batch_size}"
        )
    if not 0 <= t.warmup_steps < t.max_steps:
        raise UserError(f"--set warmup_steps={t.warmup_steps} must be in [0, max_steps={t.max_steps})")
    if t.lr <= 0 or t.end_lr < 0 or t.end_lr > t.lr:
        raise UserError(f"--set lr={t.lr} end_lr={t.end_lr}: need 0 <= end_lr <= lr and lr > 0")
    if t.division not in ("closed", "open"):
        raise UserError(f"--set division={t.division!r}: choose closed or open")
    bench.task.validate(t)
