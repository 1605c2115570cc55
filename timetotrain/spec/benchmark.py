"""What a benchmark and its tiers are, as data. One module per benchmark fills these in
(docs/adding-a-benchmark.md)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from timetotrain.errors import UserError
from timetotrain.models.family import ModelFamily
from timetotrain.spec.task import Task


@dataclass(frozen=True)
class Tier:
    """One size of a benchmark: model shape, data, batch, schedule lengths, eval cadence, target, runs."""

    name: str
    model: Any  # the family's config dataclass
    data: Any  # the task's data spec (e.g. tasks.causal_lm.LMData)
    global_batch_size: int
    # An upper bound, declared or --set: the micro-batch a rank runs is settled from it for the rank's batch
    # in one place (`Benchmark.micro_batch`; a run's in `train/prepare.settle_micro_batch`).
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
    # Where the starting weights come from when they are not the family's random init: a pretraining
    # recipe run off the clock by `ttt base` (fine-tuning tiers of our own, e.g. llama2_70b_lora tiny).
    base: BaseRecipe | None = None
    # The schedule's decay argument (logged as opt_learning_rate_decay_steps; train/schedule.py reads it
    # as the benchmark's framework does) is max_steps - warmup_steps, the value every C4 closed rule file
    # requires. False: max_steps, for a tier of ours that says why (gpt_oss_20b tiny).
    decay_steps_exclude_warmup: bool = True
    # The steps the LR schedule is laid out over, where the run stops long before it ends: the decay argument
    # is then schedule_steps (- warmup) while `max_steps` only caps the run (deepseekv3_671b: the reference's
    # 12,000-step cosine, `MAX_STEPS=100`). None: max_steps.
    schedule_steps: int | None = None
    # The names given with --set (apply_overrides). A closed run may use a GBS without an RCP only with a
    # base LR and warmup its submitter chose (closed_violation), not ones the harness kept from the tier.
    user_set: frozenset[str] = frozenset()
    # torchao's float8 recipe under `--precision fp8` (train/float8.py): a run setting, not a hyperparameter
    # of the rules, so neither logged as one nor checked by a rule file.
    fp8_recipe: str = "tensorwise"
    # Under a pipeline with FSDP2, the wraps that reduce their gradients and reshard after every micro-batch's
    # backward, not once a step (train/pipeline_reduce.py): a run setting, as fp8_recipe.
    pp_reduce: str = "experts"
    # The gradient-clip norm where the rules tie it to the GBS (qwen35_397b_grpo: 0.125 x sqrt(256 / GBS)),
    # replacing the optimizer's; None: `Optimizer.clip`.
    clip: float | None = None
    # Intra-op threads a CPU run of this tier takes when OMP_NUM_THREADS is unset (None: torch's default,
    # one per core). A model too small to split its GEMMs over threads runs faster on one, and a run's bits
    # depend on the thread count, so the tier's RCP runs are only repeated at theirs. Logged as
    # `ttt_cpu_threads`, which `ttt package`'s run_and_time.sh exports again.
    cpu_threads: int | None = None

    @property
    def eval_every_steps(self) -> int:
        """Eval points are in samples; rounded up to whole steps (MLPerf training rules, "Evaluation")."""
        return math.ceil(self.eval_every_samples / self.global_batch_size)

    @property
    def decay_steps(self) -> int:
        total = self.max_steps if self.schedule_steps is None else self.schedule_steps
        return total - (self.warmup_steps if self.decay_steps_exclude_warmup else 0)


# The shipped bases: package data (pyproject.toml), safetensors weights and their Hugging Face config.
# The shipped data of the declarations (bases, rule files) lies beside them in `suite/`.
SUITE_DIR = Path(__file__).parents[1] / "suite"
BASES = SUITE_DIR / "bases"


@dataclass(frozen=True)
class ShippedBase:
    """A base `ttt base` made once, shipped inside the package (`suite/bases/<name>/`) and pinned here by
    the sha256 of every file of its folder, `base.json` included (a pin outside the folder: a base.json
    edited to match an edited table is refused, train/base_model.py). Float reductions round differently on other CPUs (ATen's
    vectorized softmax at AVX2 and AVX-512 width, MKL's GEMM by thread count and code path), so the recipe
    rerun elsewhere gives other weights, and a target set a few hundredths under one host's base is met
    untrained on another. The tier therefore loads these bits on every host; the recipe stays the record
    of how they were made (docs/benchmarks/llama2_70b_lora.md, "Tiny tier")."""

    name: str  # the folder under suite/bases/, versioned (`<benchmark>-tiny-v<N>`): new bits, new name
    sha256: tuple[tuple[str, str], ...]  # (file name, sha256) for each file of the folder
    # The weights' identity: the sha256 of the one `model.safetensors` that `ttt base` writes (what it
    # compares a remade base with, and what a run logs). A base over 4 MiB ships as Hugging Face shards
    # under 5 MB a file; joined again they give those very bytes (tests/test_shipped_bases.py). Empty: the
    # folder holds that one file, pinned in `sha256`.
    weights: str = ""

    @property
    def folder(self) -> Path:
        return BASES / self.name

    @property
    def weights_sha256(self) -> str:
        return self.weights or dict(self.sha256)["model.safetensors"]


@dataclass(frozen=True)
class BaseRecipe:
    """How a tier's base model is made off the clock (`ttt base`, train/base_model.py): a pretraining tier
    of an unlisted benchmark, trained for its `max_steps` from a fixed seed, then saved in Hugging Face
    format. A run loads the `shipped` copy unless `--init-checkpoint` names another; its sha256 is logged."""

    benchmark: Benchmark
    tier: str
    seed: int
    data_hint: str  # how to prepare the data it pretrains on, for the error when --data is wrong
    shipped: ShippedBase | None = None  # the recipe's output as made once and shipped (None: make it)

    @property
    def pretraining(self) -> Tier:
        return self.benchmark.tier(self.tier)


def init_needed(bench: Benchmark, tier: Tier) -> str | None:
    """What a run of `tier` must be given with --init-checkpoint, in a user's words (`ttt plan` puts the flag
    into its launch line, `ttt run --dry-run` warns without it); None where the run starts from the family's
    init or from the shipped base it loads itself."""
    if tier.base is not None:
        if tier.base.shipped is not None:
            return None
        return f"the base `ttt base {bench.name} --tier {tier.name} --data DIR` makes ({tier.base.data_hint})"
    return bench.init_from


def init_warning(bench: Benchmark, tier: Tier, given) -> str | None:
    """The line a run of `tier` without --init-checkpoint gets where the tier starts from a checkpoint
    (`init_needed`): `ttt run --dry-run` shows it, a real run prints it before its clock and logs it. A warning,
    not a refusal: a run from random weights may be meant (a throughput check)."""
    needed = init_needed(bench, tier)
    if not needed or given:
        return None
    return (
        f"{bench.name} --tier {tier.name} starts from {needed}: without --init-checkpoint CKPT the run "
        "would start from random weights and measure nothing the benchmark means"
    )


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
    "fp8_recipe",
    "pp_reduce",
)

PP_REDUCE = ("experts", "stage", "step")  # train/pipeline_reduce.py

# train/float8.py applies them; the last two: MXFP8 (torchao's MX training, CUDA 10.0+ or emulated on a CPU)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_with_gw_hp")


@dataclass(frozen=True)
class Optimizer:
    """The optimizer a benchmark's rules fix, and how its constants are logged."""

    name: str = "adamw"  # "adamw" | "adam" | "adagrad" (the log's `opt_name`)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float | None = None  # global-norm gradient clipping, None for none
    # Which parameters decay: "megatron" (not biases and other 1-D tensors such as norm weights) or "all".
    decay_mask: str = "megatron"
    schedule_name: str | None = None  # logged as opt_learning_rate_decay_schedule when given
    # Adagrad only: one accumulator per embedding row (FBGEMM's EXACT_ROWWISE_ADAGRAD) instead of one per
    # element (EXACT_ADAGRAD, what the DLRM reference's torch.optim.Adagrad maps to): train/adagrad.py.
    rowwise: bool = False
    # The embedding tables' own optimizer, where the rules give them another (dlrmv4: row-wise Adagrad beside
    # Adam), at the same LR and schedule; the tables are the family's `table_parameters`, and the gradient
    # clip then covers the other parameters only (train/optim.OptimizerPair). None: one optimizer for all.
    tables: Optimizer | None = None

    def log_keys(self) -> list[tuple[str, object]]:
        if self.name == "adagrad":  # closed_dlrm_dcnv2.yaml's keys; lr_decay and the accumulator are 0
            return [
                ("opt_name", "adagrad"),
                ("opt_adagrad_learning_rate_decay", 0),
                ("opt_weight_decay", self.weight_decay),
                ("opt_adagrad_initial_accumulator_value", 0),
                ("opt_adagrad_epsilon", self.eps),
            ]
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


class RcpHparams(NamedTuple):
    """What a reference convergence point was run with. The RCP json records the base LR and warmup; the end
    LR comes from the reference's config: None means it followed the base LR (end/base as in the tier)."""

    lr: float
    warmup_steps: int
    end_lr: float | None = None


@dataclass(frozen=True)
class EndLRRule:
    """The end learning rates the training rules allow in the closed division (no official yaml checks
    them): `ratio` x the base LR, or one of `also`."""

    ratio: float
    also: tuple[float, ...] = ()

    def allows(self, lr: float, end_lr: float) -> bool:
        return any(
            math.isclose(end_lr, v, rel_tol=1e-9, abs_tol=1e-15) for v in (self.ratio * lr, *self.also)
        )

    def describe(self) -> str:
        first = f"{self.ratio:g} x the base LR" if self.ratio else "0"
        return " or ".join([first, *(f"{v:g}" for v in self.also)])


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
    # The MLPerf Training ruleset the benchmark's closed rules come from (the folder of `closed_rules`); the
    # rule files of our tiers are assembled on that ruleset's common rules (mlperf/rule_files.py).
    ruleset: str = "6.0.0"
    # GBS -> the hyperparameters of the reference convergence points, used when --set changes the GBS.
    rcp_hparams: dict[int, RcpHparams] = field(default_factory=dict)
    # Where the rules fix the hyperparameters as a function of the GBS (llama31_405b: no borrowing, LR and
    # schedule scale with the GBS): GBS -> the Tier fields a new --set global_batch_size takes.
    gbs_hparams: Callable[[int], dict[str, Any]] | None = None
    end_lr_rule: EndLRRule | None = None  # the closed division's end LR, None where the rules fix none
    listed: bool = True  # False: a test-only benchmark, not shown by `ttt list`
    # tier -> the layer count `ttt synth` uses when --layers is not given: a model too big for one device
    # runs at its exact width with fewer layers (llama31_405b reference), and the output says so.
    synth_layers: dict[str, int] = field(default_factory=dict)
    # Where the rule files of our (non-reference) tiers live, as `<name>_<tier>.yaml`, assembled by
    # `ttt rules build` from `src/<name>_<tier>.yaml` there (mlperf/rule_files.py); the official engine checks
    # the logs of those tiers against them.
    rules_dir: Path = SUITE_DIR / "rules"
    # The published checkpoint a run starts from, in a user's words, for a benchmark that continues or
    # fine-tunes one (llama31_405b, deepseekv3_671b, llama2_70b_lora, qwen35_397b_grpo): its tiers without a
    # base recipe of ours need it as --init-checkpoint (`init_needed`); None: the family's own init.
    init_from: str | None = None

    @property
    def metric(self) -> str:
        return self.task.metric.describe()

    def tier(self, name: str) -> Tier:
        if name not in self.tiers:
            raise UserError(
                f"--tier {name!r} is unknown for {self.name}: choose one of {', '.join(self.tiers)}"
            )
        return self.tiers[name]

    def micro_batch(self, tier: Tier, local: int | None = None) -> int:
        """The micro-batch of a rank that trains `local` samples a step (None: the whole global batch, one
        process): the tier's `micro_batch_size` (an upper bound: more ranks mean smaller per-rank batches),
        or all `local` at once for a task whose batch does not cut (`Task.whole_batches`)."""
        local = tier.global_batch_size if local is None else local
        return local if self.task.whole_batches else min(tier.micro_batch_size, local)

    def grad_accum(self, tier: Tier) -> int:
        """Micro-batches of one process's step."""
        return tier.global_batch_size // self.micro_batch(tier)

    def hyperparameters(self, tier: Tier, accum: int | None = None) -> list[tuple[str, object]]:
        """The task's MLPerf hyperparameters, then `ttt_model`: the model a run trains. Two of our tiers
        can log the same hyperparameters (llama31_8b and gpt_oss_20b tiny do), so without it a log that
        names the wrong submission_benchmark would pass that benchmark's rule file. `accum`: the run's
        gradient accumulation (`train/prepare.Prepared.accum`); None: one process's."""
        hp = self.task.hyperparameters(self, tier, accum or self.grad_accum(tier))
        return hp + [("ttt_model", self.model_key(tier))]

    def clip(self, tier: Tier) -> float | None:
        """The gradient-clip norm a run of `tier` uses and logs: the tier's where it has one, else the
        optimizer's."""
        return tier.clip if tier.clip is not None else self.optimizer.clip

    def model_key(self, tier: Tier) -> dict[str, object]:
        """What `ttt_model` logs: the family and its parameter count, which tells the shapes of the
        model apart without listing every config field."""
        return {"family": self.family.name, "parameters": self.family.param_count(tier.model)}

    def flops_per_sample(self, tier: Tier) -> float:
        return self.task.flops_per_sample(self.family, tier)


def base_recipe(
    of: str,
    *,
    task: Task,
    family: ModelFamily,
    optimizer,
    schedule: str,
    seed: int,
    data_hint: str,
    shipped: ShippedBase | None = None,
    **fields,
) -> BaseRecipe:
    """The base of `of`'s tiny tier: a pretraining tier (`fields`: model, data, batch sizes, LR, steps and
    eval cadence) of an unlisted benchmark named `<of>_base`. It has no target: `ttt base` runs it to its
    `max_steps`. The recipe's repr is part of the base's cache key, so the names here are fixed."""
    pretraining = Tier(
        name="tiny", target=0.0, runs=1, division="open", description=f"the base of {of} tiny", **fields
    )
    bench = Benchmark(
        name=f"{of}_base",
        area=f"base pretraining for {of} tiny (off the clock)",
        task=task,
        family=family,
        tiers={"tiny": pretraining},
        optimizer=optimizer,
        schedule=schedule,
        listed=False,
    )
    return BaseRecipe(benchmark=bench, tier="tiny", seed=seed, data_hint=data_hint, shipped=shipped)


def apply_overrides(bench: Benchmark, tier: Tier, sets: list[str]) -> Tier:
    """`--set key=value` with type conversion; a new GBS takes the RCP's LR and warmup unless also set (and
    the task's step cap at that GBS, where its reference caps epochs: `Task.steps_at_gbs`), and a new base
    LR takes its end LR along (the RCP's, or the tier's end/base ratio) unless end_lr is set."""
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
    given = frozenset(changes) | frozenset(data_changes)
    if data_changes:
        changes["data"] = dataclasses.replace(tier.data, **data_changes)
    gbs = changes.get("global_batch_size")
    if gbs is not None and follows_gbs_rule(bench, tier):
        for key, value in bench.gbs_hparams(gbs).items():
            changes.setdefault(key, value)
    rcp = bench.rcp_hparams.get(gbs) if gbs is not None and follows_rcp_table(bench, tier) else None
    if rcp is not None:
        changes.setdefault("lr", rcp.lr)
        changes.setdefault("warmup_steps", rcp.warmup_steps)
    if gbs is not None and "max_steps" not in changes:
        steps = bench.task.steps_at_gbs(tier, gbs)
        if steps is not None:
            changes["max_steps"] = steps
    if "lr" in changes and "end_lr" not in changes:
        if rcp is not None and rcp.end_lr is not None:
            changes["end_lr"] = rcp.end_lr
        else:
            changes["end_lr"] = changes["lr"] * tier.end_lr / tier.lr
    new = dataclasses.replace(tier, **changes, user_set=tier.user_set | given)
    validate(bench, new)
    return new


def follows_gbs_rule(bench: Benchmark, tier: Tier) -> bool:
    """Whether `tier` holds the hyperparameters `bench.gbs_hparams` gives at its own GBS (llama31_405b's
    reference does; its tiny tier, with its own LR and schedule, does not), so that a new GBS takes the
    rule's values. Applied to a tier it does not describe, the rule would give, e.g., the tiny tier a
    288,000-step warmup and an LR 1,800 times smaller."""
    if bench.gbs_hparams is None:
        return False
    return all(getattr(tier, k) == v for k, v in bench.gbs_hparams(tier.global_batch_size).items())


def follows_rcp_table(bench: Benchmark, tier: Tier) -> bool:
    """Whether `tier` runs the LR and warmup of `bench.rcp_hparams` at its own GBS (every reference tier
    does), so that a new GBS takes that RCP's values. The table is the reference's: at llama31_8b tiny,
    `--set global_batch_size=32` took the 8B model's 8e-4 and 128 warmup steps in place of the tier's 3e-3
    and 20 (`tests/test_bad_input.py`)."""
    rcp = bench.rcp_hparams.get(tier.global_batch_size)
    return rcp is not None and (tier.lr, tier.warmup_steps) == (rcp.lr, rcp.warmup_steps)


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
    if t.fp8_recipe not in FP8_RECIPES:
        raise UserError(f"--set fp8_recipe={t.fp8_recipe}: choose one of {', '.join(FP8_RECIPES)}")
    if t.pp_reduce not in PP_REDUCE:
        raise UserError(f"--set pp_reduce={t.pp_reduce}: choose one of {', '.join(PP_REDUCE)}")
    for key in ("global_batch_size", "micro_batch_size", "max_steps", "eval_samples", "eval_every_samples"):
        if getattr(t, key) <= 0:
            raise UserError(f"--set {key}={getattr(t, key)}: must be positive")
    if t.global_batch_size % bench.micro_batch(t):
        raise UserError(
            f"--set micro_batch_size={t.micro_batch_size} must divide global_batch_size={t.global_batch_size}"
        )
    if not 0 <= t.warmup_steps < t.max_steps:
        raise UserError(f"--set warmup_steps={t.warmup_steps} must be in [0, max_steps={t.max_steps})")
    if bench.schedule == "megatron" and t.warmup_steps >= t.decay_steps:
        # Megatron's cosine ends at step decay_steps (train/schedule.py), which must come after the warmup.
        raise UserError(
            f"--set warmup_steps={t.warmup_steps}: the cosine ends at step {t.decay_steps}, so warmup must end "
            "before it"
        )
    if t.lr <= 0 or t.end_lr < 0 or t.end_lr > t.lr:
        if "global_batch_size" in t.user_set and not {"lr", "end_lr"} & t.user_set:
            # The LR came with the GBS (the rules' function of it, or the RCP table's), not from the user.
            raise UserError(
                f"--set global_batch_size={t.global_batch_size}: the LR that comes with it, {t.lr:g}, is below "
                f"the end LR {t.end_lr:g}; choose a larger GBS, or give --set lr=... end_lr=... "
                "(--set division=open)"
            )
        raise UserError(f"--set lr={t.lr} end_lr={t.end_lr}: need 0 <= end_lr <= lr and lr > 0")
    if t.division not in ("closed", "open"):
        raise UserError(f"--set division={t.division!r}: choose closed or open")
    bench.task.validate(t)


def closed_violation(bench: Benchmark, tier: Tier) -> str | None:
    """What the training rules fix in the closed division but no official yaml checks, against the declared
    tier: the quality target, the eval cadence, the end LR, and a GBS without an RCP run with hyperparameters
    nobody chose. None when the tier is a closed configuration; else the one-line reason."""
    declared = bench.tiers[tier.name]
    rule = "MLPerf Training rules:"
    fix = "add --set division=open"
    if tier.target != declared.target:
        return f"{rule} the quality target is fixed in the closed division ({declared.target:g}); {fix}"
    if tier.eval_every_samples != declared.eval_every_samples:
        return (
            f"{rule} evaluation runs every {declared.eval_every_samples:,} samples in the closed division, "
            f"as in the reference; {fix}"
        )
    end = bench.end_lr_rule
    if end is not None and not end.allows(tier.lr, tier.end_lr):
        return (
            f"{rule} the end LR is {end.describe()} in the closed division, not {tier.end_lr:g} "
            f"(base LR {tier.lr:g}); change --set end_lr or {fix}"
        )
    gbs = tier.global_batch_size
    # Where the rules fix the hyperparameters as a function of the GBS (gbs_hparams), any legal GBS has them.
    free = bench.gbs_hparams is None and bench.rcp_hparams and gbs not in bench.rcp_hparams
    if free and not {"lr", "warmup_steps"} <= tier.user_set:
        rcps = ", ".join(str(b) for b in sorted(bench.rcp_hparams))
        return (
            f"{rule} global_batch_size={gbs} has no reference convergence point (RCPs at {rcps}), so its "
            f"base LR and warmup are the submitter's choice: give --set lr=... and --set warmup_steps=..., "
            f"or {fix}"
        )
    return None
