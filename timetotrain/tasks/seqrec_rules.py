"""The rules side of sequential recommendation (MLPerf Training 6.1 dlrmv4): the eval grid, the first eval, the
LR band and the hyperparameter block, as the closed and open rule files compute and check them.

Everything here needs neither the model nor the data, so it stands alone: `SeqRecRules` is the part of the
task that the rules fix, and the task that trains HSTU on Yambda subclasses it with the hooks that read data
and build batches (`resolve`, `open`, `synthetic`, `flops_per_sample`, `sample_items`).
docs/benchmarks/dlrmv4.md gives the source of every number (file:line).

The eval grid and the first eval are computed with the rule file's own float expressions
(closed_dlrmv4.yaml:33-35, :42-45), not with the reference trainer's (train/utils.py:2243 rounds where the
rule file takes the ceiling: they differ at 56 of the 128 multiples of 1,024 up to 131,072), so that a log
of ours lands on the grid the checker recomputes at every GBS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from timetotrain.errors import UserError
from timetotrain.spec.task import Metric, Task

DENSE_OPTIMIZER = "Adam"  # closed_dlrmv4.yaml:70 (the log's spelling, not spec.benchmark.Optimizer's "adam")
SPARSE_OPTIMIZER = "RowWiseAdagrad"  # closed_dlrmv4.yaml:112: the embedding tables', at the dense LR


@dataclass(frozen=True)
class FirstEval:
    """Where evaluation starts, as a line in the GBS: floor((slope x GBS + intercept) / denominator) samples,
    resolved up onto the eval grid (closed_dlrmv4.yaml:42-45; the reference's fit through the earliest
    convergence of its 20-seed sweep less two eval blocks, README.MD:742-781)."""

    slope: int
    intercept: int
    denominator: int

    def samples(self, gbs: int) -> int:
        """The threshold before it resolves onto the grid: the reference's `start_eval_samples`."""
        return math.floor((self.slope * gbs + self.intercept) / self.denominator)


@dataclass(frozen=True)
class LRBand:
    """The base LRs the rules allow at a GBS: `low` to `high` x GBS / `per_gbs`, with the rule files'
    relative slack of 1e-9 (closed_dlrmv4.yaml:47-48, :78; open_dlrmv4.yaml:10-11, :43)."""

    low: float
    high: float
    per_gbs: int

    def bounds(self, gbs: int) -> tuple[float, float]:
        return self.low * gbs / self.per_gbs, self.high * gbs / self.per_gbs

    def allows(self, lr: float, gbs: int) -> bool:
        lo, hi = self.bounds(gbs)
        return lo * (1 - 1e-9) <= lr <= hi * (1 + 1e-9)

    def describe(self) -> str:
        mid = (self.low + self.high) / 2
        return f"{self.low / mid:g}-{self.high / mid:g} x {mid:g} x GBS/{self.per_gbs}"


@dataclass(frozen=True)
class SeqRecData:
    """The data spec's fields the rules read. The task that reads Yambda adds where its files are and how
    its samples are built."""

    train_samples: int  # one pass over the training windows: the epoch, logged as train_samples
    max_seq_len: int  # UIH history + contextual entries + candidate, logged as max_sequence_length
    eval_every_data_pct: float  # the eval grid: one point every this fraction of train_samples
    first_eval: FirstEval | None = None  # None: the first grid point
    lr_band: LRBand | None = None  # None: no band (a tier of ours, checked by its own rule file)
    warmup_start_lr: float = 0.0  # where the warmup ramp starts, logged as opt_learning_rate_warmup_start_lr


def eval_interval_steps(d: SeqRecData, gbs: int) -> int:
    """Steps between eval points: the fraction of the data divided once by the GBS, rounded up
    (closed_dlrmv4.yaml:33-35)."""
    return max(1, int(math.ceil(d.eval_every_data_pct * d.train_samples / gbs)))


def first_eval_samples(d: SeqRecData, gbs: int) -> int:
    """The samples_count of the first eval_accuracy: the first grid point at or after the FirstEval line
    (closed_dlrmv4.yaml:42-45, the FIRST_CHECK of :145); the first grid point without one."""
    interval = eval_interval_steps(d, gbs) * gbs
    if d.first_eval is None:
        return interval
    return int(math.ceil(d.first_eval.samples(gbs) / interval)) * interval


class SeqRecRules(Task):
    """The hooks of the sequential-recommendation task that the rules decide. Abstract: the data and model
    hooks are the subclass's."""

    # AUC of the listen_plus task on the held-out window, counted in samples (rcp_checker.py:116 reads
    # samples_count for dlrmv4); met at >= the target (closed_dlrmv4.yaml:146).
    metric = Metric("AUC of listen_plus on the held-out window", higher_is_better=True, unit="samples")

    def validate(self, tier) -> None:
        d, gbs = tier.data, tier.global_batch_size
        if d.lr_band is not None and not d.lr_band.allows(tier.lr, gbs):
            lo, hi = d.lr_band.bounds(gbs)
            raise UserError(
                f"--set lr={tier.lr:g}: the dlrmv4 rules (closed and open) keep the LR within "
                f"[{lo:g}, {hi:g}] at global_batch_size={gbs} ({d.lr_band.describe()})"
            )
        if tier.end_lr != tier.lr:
            raise UserError(
                f"--set end_lr={tier.end_lr:g}: the LR is constant after the warmup (end LR = base LR {tier.lr:g})"
            )

    def steps_at_gbs(self, tier, gbs: int) -> int:
        """One pass over the training samples in whole batches: the reference streams every window once."""
        return tier.data.train_samples // gbs

    def eval_every_steps(self, tier) -> int:
        """The grid of the rules at the tier's GBS, unless --set eval_every_samples chose another (open)."""
        if "eval_every_samples" in tier.user_set:
            return tier.eval_every_steps
        return eval_interval_steps(tier.data, tier.global_batch_size)

    def first_eval_step(self, tier) -> int:
        """The step of the first eval: earlier grid points are not evaluated at all, as in the reference
        (SKIP_EVAL_EPOCH_PCT, yambda_5b.gin:693-776); a multiple of `eval_every_steps`, so the default
        `eval_due` keeps the grid after it."""
        if "eval_every_samples" in tier.user_set:
            return self.eval_every_steps(tier)
        return first_eval_samples(tier.data, tier.global_batch_size) // tier.global_batch_size

    def hyperparameters(self, bench, tier, accum: int) -> list[tuple[str, object]]:
        """In the reference's order (mlperf_logging_utils.py:178-253, then its dataset sizes, :323-325), which
        the closed rules need in part: global_batch_size's POST sets the LR band and the grid that
        opt_base_learning_rate and eval_accuracy are checked against (closed_dlrmv4.yaml:24-48, :75-78)."""
        d, opt, gbs = tier.data, bench.optimizer, tier.global_batch_size
        start = d.first_eval.samples(gbs) if d.first_eval is not None else 0
        return [
            ("global_batch_size", gbs),
            ("gradient_accumulation_steps", accum),
            ("opt_name", DENSE_OPTIMIZER),
            ("opt_base_learning_rate", tier.lr),
            ("opt_adam_beta_1", opt.betas[0]),
            ("opt_adam_beta_2", opt.betas[1]),
            ("opt_adam_epsilon", opt.eps),
            ("opt_weight_decay", opt.weight_decay),
            ("opt_gradient_clip_norm", bench.clip(tier)),
            ("opt_learning_rate_warmup_steps", tier.warmup_steps),
            ("opt_learning_rate_warmup_start_lr", d.warmup_start_lr),
            ("opt_sparse_name", SPARSE_OPTIMIZER),
            ("opt_sparse_base_learning_rate", tier.lr),  # one LR for both (closed_dlrmv4.yaml:106-117)
            ("max_sequence_length", d.max_seq_len),
            ("eval_every_data_pct", d.eval_every_data_pct),
            # What the reference logs for where evaluation starts, unrounded (README.MD:779-780; no rule
            # checks it: the rules recompute the first eval from the GBS); 0: from the first grid point.
            ("skip_eval_epoch_pct", start / d.train_samples),
            ("train_samples", d.train_samples),
            ("eval_samples", tier.eval_samples),
        ]
