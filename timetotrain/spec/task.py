"""The interface between a kind of training (a task) and the harness.

The timed loop (`train/loop.py`), `ttt synth` (`train/synth.py`) and `ttt plan` (`train/memory.py`) know a
benchmark only through this interface and `spec.benchmark.Benchmark`; they never learn a benchmark's name.
docs/adding-a-benchmark.md walks through it.

A task answers, for a tier of a benchmark:
- what its quality metric is (`Metric`: direction, and whether eval points count samples or epochs);
- where its data is (`resolve`, the preflight: present and checksummed, before any log line) and how to
  open it after `run_start` (`open` -> `RunData`: this rank's batches, the loss, the evaluation) for the
  rank's `Share` of every batch, which the harness computes;
- what a random batch is (`synthetic`, for `ttt synth` and the warm-up before the clock);
- how many FLOPs one training sample costs, and what one sample holds ("tokens" x seq_len, "images" x 1);
- which hyperparameter keys the log carries;
- how its tier's data is made from a folder of raw sources (`data_name`, `data_recipe`: what `ttt suite
  --data SRC` and `ttt data prepare --for` run), so no code outside the task names its data spec.

Batches are dicts of tensors whose first dimension is the sample; the harness splits them into
micro-batches along that dimension and never looks inside.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Share:
    """One data-parallel rank's part of the data: of every global batch, the `local` samples from `offset`
    on, as rank `rank` of `world`. The harness makes it once, after checking the split (`Share.of` from
    `train/parallel.batch_share`), and hands it to `Task.open`; a task reads it and derives no share of its
    own. Its methods are the ways the references split an eval set over the ranks, each written once here."""

    rank: int
    world: int
    local: int  # samples of each global batch this rank trains on
    offset: int  # where they start in the global batch

    @classmethod
    def of(cls, global_batch: int, rank: int = 0, world: int = 1) -> Share:
        """Rank `rank`'s contiguous part of a `global_batch` that `world` divides (checked first by the
        caller: `train/parallel.batch_share`, which says so in one line); the defaults: one process, the
        whole batch."""
        if global_batch % world or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of {world} has no equal share of a batch of {global_batch}")
        local = global_batch // world
        return cls(rank, world, local, rank * local)

    def part(self, n: int) -> slice:
        """This rank's contiguous part of `n` items cut as evenly as they go (sizes differ by one at most)."""
        return slice(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def equal_part(self, n: int) -> slice:
        """This rank's `n // world` contiguous items: equal parts, the last `n % world` items in none."""
        size = n // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def padded_part(self, n: int) -> range:
        """This rank's `ceil(n / world)` contiguous positions: equal parts that cover all `n` items, the
        last part running past `n` by what the caller pads."""
        size = -(-n // self.world)
        return range(self.rank * size, (self.rank + 1) * size)

    def strided(self, n: int, padded: bool = False) -> range:
        """Items rank, rank + world, ... of `n` (round robin); `padded`: as many for every rank,
        `ceil(n / world)`, positions past `n` included for the caller to count as nothing."""
        stop = -(-n // self.world) * self.world if padded else n
        return range(self.rank, stop, self.world)


@dataclass(frozen=True)
class Metric:
    name: str  # e.g. "validation log-perplexity (mean cross-entropy)"
    higher_is_better: bool = False
    # How the log counts eval points: "samples" (`samples_count`) or "epochs" (`epoch_num`, fractional).
    unit: str = "samples"
    # Decimals `epoch_num` is rounded to, where the reference rounds it (rgat: 2); None: unrounded.
    epoch_decimals: int | None = None
    # The target must be passed, not only reached (closed_qwen35_397b_grpo.yaml: `value > target`).
    strict: bool = False

    def met(self, value: float, target: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.strict:
            return value > target if self.higher_is_better else value < target
        return value >= target if self.higher_is_better else value <= target

    def describe(self) -> str:
        return f"{self.name}, {'higher' if self.higher_is_better else 'lower'} is better"

    @property
    def comparison(self) -> str:
        return (">" if self.higher_is_better else "<") + ("" if self.strict else "=")


class RunData(ABC):
    """A tier's data opened for one rank of one run (after `run_start`), or synthetic data for `ttt synth`."""

    # Training samples in one epoch, for tasks whose eval points are counted in epochs; else None.
    samples_per_epoch: int | None = None

    @abstractmethod
    def batch(self, step: int) -> Batch:
        """This rank's share of global batch `step` (on the host for real data; on the device if synthetic)."""

    @abstractmethod
    def loss(self, model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        """The training loss of `model` on (a micro-batch of) `batch`, a device scalar."""

    def evaluate(self, model, autocast: torch.dtype | None = None) -> float:
        """The quality metric on the eval set, reduced across ranks; every rank returns the same value."""
        raise NotImplementedError(f"{type(self).__name__} has no eval set")

    def prepare(self, model, batch: Batch) -> Batch:
        """Complete a batch with what needs the current model, right before its step (`Task.on_policy`):
        GRPO samples the rollouts, scores them and computes advantages here. Default: unchanged."""
        return batch

    # The MLPerf log key of the figures `step_figures` makes once per step (GRPO: `ttt_rollout_stats`), or None.
    step_key: str | None = None

    def step_sums(self) -> torch.Tensor | None:
        """This rank's sums over the batch just prepared (a 1-d device tensor), summed over ranks in the step's
        one collective with its loss (`Training.step`), so that logging them costs no host sync of its own;
        None when the task logs no per-step figures."""
        return None

    def step_figures(self, sums: list[float]) -> dict[str, float]:
        """The value logged under `step_key` from the global sums (`step_sums` added over every rank)."""
        raise NotImplementedError(f"{type(self).__name__} logs no per-step figures")

    def figures(self) -> dict[str, float]:
        """Figures of the data pipeline itself for `ttt synth` (e.g. a graph sampler's subgraphs/s), by
        name; most data has none."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional: most data holds nothing to release
        """Release files and threads."""


@dataclass(frozen=True)
class DataRecipe:
    """How a tier's data is made from a folder of raw sources (as ../shared/data): in-process (`call`), then
    `ttt data prepare` steps, each run into the folder being made."""

    name: str  # the cache folder's name: what the data is, not which benchmark reads it (`Task.data_name`)
    describe: str  # one phrase for the progress line, e.g. "C4 tokenized with llama3"
    steps: tuple[tuple[str, ...], ...] = ()  # `ttt` argument lists; the argument "{out}" is the folder made
    sources: tuple[Path, ...] = ()  # the files the recipe reads: a changed one makes a cached copy stale
    call: Callable[[Path], None] | None = None  # writes the data into the folder it is given, before `steps`


class Task(ABC):
    metric: Metric
    # Fields of the tier's `data` spec that `--set` may change, besides the Tier's own, each with the log key
    # that records it (e.g. {"seq_len": "max_sequence_length"}).
    settable: dict[str, str] = {}
    # True for a task whose batch cannot be cut into micro-batches (a sampled subgraph): its micro-batch
    # is the whole per-rank batch, whatever the tier's micro_batch_size (`Benchmark.micro_batch`).
    whole_batches: bool = False
    # The `run_stop` status of a run that reaches max_steps without meeting the target (signals and errors
    # are always "aborted"): the word the task's reference logs.
    exhausted_status: str = "aborted"
    # True for a task whose batches need the current weights before each step (GRPO's rollouts): the loop
    # and `ttt synth` pass every batch through `RunData.prepare(model, batch)` first.
    on_policy: bool = False

    def validate(self, tier) -> None:  # noqa: B027 - optional: most tasks accept any tier
        """Raise UserError for a tier this task cannot run (called after `--set` overrides)."""

    def check_share(self, tier, local: int, ranks: int) -> None:  # noqa: B027 - optional: any share splits
        """Raise UserError where `local` samples per data-parallel rank (of `ranks`) is a share this task
        cannot train on. Called by `ttt run`'s preflight and by `ttt plan` for every layout it counts, so the
        plan never suggests a split the run would refuse."""

    @abstractmethod
    def resolve(self, tier, data_dir: Path, verify: bool = True, init_checkpoint: Path | None = None) -> Any:
        """Preflight: locate and check the tier's data; returns a handle whose `files()` lists what is read.
        `init_checkpoint` is the `--init-checkpoint` folder, for a task whose data depends on its base (a
        base's narrowed vocabulary); most tasks ignore it."""

    @abstractmethod
    def open(self, tier, resolved, seed: int, share: Share, device: torch.device) -> RunData:
        """The data of one run for one data-parallel rank, whose part of every global batch (and place among
        the ranks) is `share`; called after `run_start`."""

    @abstractmethod
    def synthetic(self, tier, local_batch: int, generator: torch.Generator, device: torch.device) -> RunData:
        """Random batches made on the device, for throughput runs and the warm-up."""

    @abstractmethod
    def flops_per_sample(self, family, tier) -> float:
        """Model FLOPs of one training sample, forward and backward, counting only what the model computes."""

    @abstractmethod
    def sample_items(self, tier) -> tuple[str, int]:
        """What one sample holds, for throughput figures: e.g. ("tokens", seq_len) or ("images", 1)."""

    @abstractmethod
    def hyperparameters(self, bench, tier, accum: int) -> list[tuple[str, object]]:
        """The hyperparameter block of the log, in log order (the rules' POST/CHECK order depends on it)."""

    def adapt_model(  # noqa: B027 - optional
        self, model, tier, generator: torch.Generator | None, precision: str = "fp32"
    ) -> None:
        """Change the model before parallelism, e.g. add LoRA adapters and freeze the base: the initialised
        (or loaded) model, or, for a sharded build, the model still on the meta device (then the new
        parameters are drawn later by `init_adapters`). Runs on every rank with the same generator state.
        `precision` is the run's compute precision (`fp32` or `bf16`; under fp8 that of what float8 does not
        cover), e.g. to store a frozen base in bf16."""

    def init_adapters(self, model, tier, generator: torch.Generator) -> None:  # noqa: B027 - optional
        """Draw the parameters `adapt_model` added, after the sharded build's `to_empty`: the values
        `adapt_model` would draw on a materialised model from the same generator state."""

    def checkpoint_names(self, model) -> dict | None:
        """For loading a checkpoint of the unadapted model into the adapted one: our parameter name -> the
        checkpoint's name, None where the task added the parameter (`checkpoint.load_hf_checkpoint`'s
        `names`). None: the names are unchanged."""
        return None

    def checkpoint_rows(self, tier) -> dict[str, int] | None:
        """Our parameter name -> how many leading rows to keep of the checkpoint's tensor, for a task that
        continues from a checkpoint with a smaller vocabulary (`load_hf_checkpoint`'s `truncate_rows`)."""
        return None

    def steps_at_gbs(self, tier, gbs: int) -> int | None:
        """The step cap a `--set global_batch_size=gbs` gives `tier` where the task's reference caps the run
        in epochs, not steps (rgat: 2 epochs at any GBS); None keeps `max_steps`."""
        return None

    def eval_every_steps(self, tier) -> int:
        """Steps between evaluations: the tier's eval interval in samples rounded up to whole steps by
        default (`Tier.eval_every_steps`); a task whose reference rounds otherwise says so here."""
        return tier.eval_every_steps

    def first_eval_step(self, tier) -> int:
        """The first step with an evaluation (then every `eval_every_steps`): the first eval point by
        default; tasks whose reference delays evaluation say so here."""
        return self.eval_every_steps(tier)

    def eval_due(self, tier, step: int) -> bool:
        """Whether the loop evaluates after `step` (counted from 1): every `eval_every_steps` from
        `first_eval_step` by default; a task whose reference counts eval points within each epoch says so
        here."""
        return step >= self.first_eval_step(tier) and step % self.eval_every_steps(tier) == 0

    def first_logged_eval_step(self, tier) -> int:
        """The first evaluation whose result the log reports. Evaluations before it still run on the cadence
        (and take their time) and can still end the run: the one that meets the target is logged, so the
        log stays valid. Default: every evaluation is logged (whatever `eval_due` decides)."""
        return 0

    def param_counts(self, family, tier) -> tuple[int, int]:
        """(trainable, frozen) parameters of the model as the task trains it, for `ttt plan`: all of the
        family's trainable unless the task freezes some (and perhaps adds its own, e.g. LoRA adapters)."""
        return family.param_count(tier.model), 0

    def frozen_bytes(self, tier, bf16: bool) -> int:
        """Bytes each frozen parameter is stored in (`ttt plan`), under bf16 compute or not: fp32 (4)."""
        return 4

    def plan_note(self, tier) -> str | None:
        """A line `ttt plan` adds about what its memory estimate leaves out and why, or None."""
        return None

    def plan_phases(self, family, tier, rows: int, act_bytes: int, cp: int = 1) -> dict[str, float]:
        """`ttt plan`: the bytes per GPU of the task's own phases beside the training step's activations (GRPO:
        the rollouts' decode, the log-probability check), by name, for the `rows` samples' tokens of one GPU
        (under context parallelism `cp`, 1/cp of cp x rows samples); the plan takes the largest of these and
        the step. Default: none."""
        return {}

    def data_name(self, tier) -> str | None:
        """The name of the tier's prepared data (its cache folder), known without a source folder: the
        `DataRecipe.name` that `data_recipe` returns. None: no recipe here makes this tier's data (the user
        prepares it and passes `--data BENCH=DIR`)."""
        return None

    def data_recipe(self, tier, source: Path) -> DataRecipe | None:
        """How the tier's data is made from `source`, a folder of raw sources laid out as ../shared/data;
        None where `data_name` is None. Finding the files in `source` is the task's: a missing one is a
        UserError naming `--data SOURCE` and what to put there (read by `ttt suite` and `ttt data prepare
        --for`, which run the recipe)."""
        return None

    def baseline_loss(self, tier) -> float | None:
        """The loss of an uninformed model (e.g. ln V for a uniform guess over V tokens), for `ttt synth`."""
        return None


@torch.no_grad()
def evaluate_ratio(model, items, fn, device, world: int, autocast: torch.dtype | None = None) -> float:
    """sum(numerators) / sum(denominators) of `fn(model, item)` over `items`, in eval mode, summed in fp64 and
    reduced across the `world` ranks (every rank returns the same value). Token-weighted means return
    (loss sum, token count); means of per-sample means return (sample mean, 1)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for item in items:
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            num, den = fn(model, item)
        sums[0] += num
        sums[1] += den
    if world > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    total, count = sums.tolist()
    return total / count


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """`parts` equal micro-batches along the sample dimension (views, no copies)."""
    if parts == 1:
        return [batch]
    chunks = {k: v.chunk(parts) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(parts)]
