"""What a benchmark and its tiers are, as data. One module per benchmark fills these in."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from timetotrain.errors import UserError


@dataclass(frozen=True)
class DataSpec:
    """Where a tier's tokens come from. Prefixes are tried in order (ours first, then MLCommons' names)."""

    train_prefixes: tuple[str, ...]
    val_prefixes: tuple[str, ...]
    tokenizer: str = "llama3"
    # Keep the K most frequent training ids and map every other id to one extra "other" id (tiny tiers):
    # the full 128k-row embedding and head would dominate a 2-core run (spec DESIGN "Tiers").
    vocab_keep: int | None = None


@dataclass(frozen=True)
class Tier:
    name: str
    model: Any  # the family's config dataclass
    seq_len: int
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
    data: DataSpec
    description: str = ""

    @property
    def grad_accum(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def eval_every_steps(self) -> int:
        """Eval points are in samples; rounded up to whole steps (training rules §2.6)."""
        return math.ceil(self.eval_every_samples / self.global_batch_size)

    @property
    def decay_steps(self) -> int:
        return self.max_steps - self.warmup_steps


# Fields a user may change with --set; the model shape is part of the tier, not a knob.
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
    "seq_len",
    "division",
)


@dataclass(frozen=True)
class Benchmark:
    name: str
    area: str
    metric: str
    tiers: dict[str, Tier]
    fixed_hparams: dict[str, Any]  # closed-rule constants logged verbatim (betas, eps, wd, clip, ...)
    schedule_rule: str  # warmup off-by-one of the reference framework, see train/schedule.py
    build_model: Callable[[Tier], Any]  # called under a meta-device context; must not touch weights
    init_model: Callable[[Any, Any], None]  # (model, torch.Generator): the benchmark's own init rule
    # `ttt synth` plug-ins: a random batch drawn on the device, and the model FLOPs of one training sample
    # (forward + backward), counting only what the model computes.
    synthetic_batch: Callable[[Tier, int, Any, Any], Any]  # (tier, batch, generator, device) -> tensor
    flops_per_sample: Callable[[Tier], float]
    # GBS -> (lr, warmup_steps) of the reference convergence points, used when --set changes the GBS.
    rcp_hparams: dict[int, tuple[float, int]] = field(default_factory=dict)
    closed_rules: tuple[str, ...] = ()  # official yaml files under mlperf_logging/compliance_checker
    eod_mask_loss: bool = False  # ignore the loss where the input token is end-of-document (Megatron)
    # (model) -> ({extra log key: value}, short text for the live output), read at each eval point.
    telemetry: Callable[[Any], tuple[dict, str]] | None = None

    def tier(self, name: str) -> Tier:
        if name not in self.tiers:
            raise UserError(
                f"--tier {name!r} is unknown for {self.name}: choose one of {', '.join(self.tiers)}"
            )
        return self.tiers[name]


def apply_overrides(bench: Benchmark, tier: Tier, sets: list[str]) -> Tier:
    """`--set key=value` with type conversion; a new GBS takes the RCP's LR and warmup unless also set."""
    changes: dict[str, Any] = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not raw:
            raise UserError(f"--set {item!r} is not key=value (e.g. --set lr=2e-3)")
        if key not in SETTABLE:
            raise UserError(f"--set {key!r} is not a setting: choose from {', '.join(SETTABLE)}")
        changes[key] = _parse(key, raw, type(getattr(tier, key)))
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
    validate(new)
    return new


def _parse(key: str, raw: str, kind: type):
    try:
        if kind is int:
            value = float(raw)  # accepts 1e6 as well as 1000000
            if not value.is_integer():
                raise ValueError
            return int(value)
        return kind(raw)
    except ValueError as e:
        raise UserError(
            f"--set {key}={raw}: expected {'an integer' if kind is int else 'a ' + kind.__name__}"
        ) from e


def validate(t: Tier) -> None:
    for key in (
        "global_batch_size",
        "micro_batch_size",
        "max_steps",
        "seq_len",
        "eval_samples",
        "eval_every_samples",
    ):
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
    if t.seq_len > t.model.max_seq_len:
        raise UserError(f"--set seq_len={t.seq_len} exceeds the model's context {t.model.max_seq_len}")
