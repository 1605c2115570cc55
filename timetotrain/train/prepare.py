"""The one preparation path of `ttt run` and `ttt synth`: preflight (nothing logged, nothing built until it
passes), then the init phase's log block and the model, optimizer and schedule (`step.build_training`)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from timetotrain.errors import UserError
from timetotrain.mlperf.keys import config_keys, parallel_keys, submission_keys
from timetotrain.mlperf.logger import ResultLog, check_writable
from timetotrain.spec import registry
from timetotrain.spec.benchmark import Benchmark, Tier, apply_overrides
from timetotrain.spec.task import Share
from timetotrain.train import context_parallel, distributed, float8, parallel, pipeline, sdpa
from timetotrain.train.device import platform_name, set_cpu_threads
from timetotrain.train.device import resolve as resolve_device
from timetotrain.train.seeds import check_seed
from timetotrain.train.step import Training, build_training


@dataclass
class Prepared:
    bench: Benchmark
    tier: Tier
    plan: parallel.Plan
    dist: distributed.Dist
    logdir: Path
    share: Share  # this rank's part of every global batch, handed to `Task.open`
    accum: int  # micro-batches per rank per step
    # The log's hyperparameter block, computed once: `mlperf.keys.check_rules` checks it, `log_init_keys`
    # logs it.
    hyperparameters: list[tuple[str, object]]
    device: torch.device | None = None
    seed: int | None = None
    init_checkpoint: Path | None = None  # weights to start from instead of the benchmark's init
    init_kind: str | None = None  # what `checkpoint.check_init_source` found there: "hf" or "ours"

    @property
    def local_batch(self) -> int:
        """Samples per rank per step."""
        return self.share.local


def resolve_tier(benchmark: str | Benchmark, tier: str, sets: list[str]) -> tuple[Benchmark, Tier]:
    """`benchmark`: a registered name, or a declaration itself: a variant made in Python (a tier's recipe with
    another model family or task hooks) that no registry knows, logged under its `name`."""
    bench = benchmark if isinstance(benchmark, Benchmark) else registry.get(benchmark)
    return bench, apply_overrides(bench, bench.tier(tier), sets)


def preflight(
    bench: Benchmark, tier: Tier, logdir: Path, parallel_spec: str | None, precision: str, ac: int,
    compile: bool, micro_batch: int | None = None, micro_flag: str = "--set micro_batch_size",
    device: str | None = None, seed: int | None = None, ranks: distributed.Dist | None = None,
) -> Prepared:  # fmt: skip
    """Checks that need no data: seed in range, the device present, log dir writable, parallel plan, batch
    split. `ranks`: this process's place in the job (default: torchrun's environment; `ttt plan --simulate`
    names the rank it stands for)."""
    d = ranks or distributed.from_env()
    check_seed(seed)
    sdpa.check()
    dev = resolve_device(device, d.local_rank)
    logdir = check_writable(logdir)
    fp8 = {}
    if precision == "fp8":
        float8.check_model(tier.model, dev, tier.fp8_recipe)  # first: it needs no torchao (seconds to import)
        float8.check_device(dev, tier.fp8_recipe)
        # What float8 does not cover: bf16 where it is fast (GPUs), fp32 on CPUs (DESIGN: no fast bf16).
        fp8 = {"fp8_recipe": tier.fp8_recipe, "high": "bf16" if dev.type == "cuda" else "fp32"}
    elif "fp8_recipe" in tier.user_set:
        raise UserError(f"--set fp8_recipe={tier.fp8_recipe} applies to --precision fp8 only")
    # Every ac-th block checkpointed (0: none); more than the model's blocks is refused before any log line.
    ac = parallel.check_ac_every(ac, _blocks(tier.model))
    plan = parallel.parse(
        parallel_spec, d.world, precision=precision, activation_checkpointing=ac, compile=compile, **fp8
    )
    context_parallel.check(bench, tier, plan, parallel_spec)
    if precision == "fp8" and plan.world > 1:
        float8.check_mx_parallel(tier.fp8_recipe, parallel_spec)
    if plan.tp > 1:
        parallel.check_tensor_parallel(bench.family, tier.model, parallel_spec, plan.tp, bench.task)
    share = parallel.batch_share(tier.global_batch_size, plan, d.rank)
    local = share.local
    bench.task.check_share(tier, local, plan.data_parallel)
    micro = settle_micro_batch(bench, tier, plan, local, micro_batch, micro_flag)
    parallel.check_eval_split(tier.eval_samples, plan)
    if bench.family.embedding_tables is not None and plan.dp != plan.world:
        # Embedding tables shard over the data-parallel ranks themselves (train/embedding_parallel.py).
        raise UserError(
            f"--parallel {parallel_spec}: a model with embedding tables runs --parallel dp=N only"
        )
    tier = dataclasses.replace(tier, micro_batch_size=micro)
    accum = local // micro
    return Prepared(bench, tier, plan, d, logdir, share, accum, bench.hyperparameters(tier, accum))


def settle_micro_batch(
    bench: Benchmark, tier: Tier, plan: parallel.Plan, local: int, given: int | None = None,
    flag: str = "--set micro_batch_size",
) -> int:  # fmt: skip
    """The micro-batch a rank of `plan` with `local` samples a step runs: `given` (`ttt synth --micro-batch`),
    else the tier's for that batch (`Benchmark.micro_batch`), checked to cut `local` into whole micro-batches
    (an explicit 0 is an error, not "the default"); under pipeline parallelism, the schedule's
    (`pipeline.check`: at most that size, enough of them). The one place a run's micro-batch is settled
    (`ttt run` and `ttt synth` through `preflight`, `ttt plan --simulate`)."""
    micro = given if given is not None else bench.micro_batch(tier, local)
    if micro <= 0 or local % micro:
        raise UserError(f"{flag}={micro} must divide the per-rank batch {local} into whole micro-batches")
    if plan.pp > 1:
        explicit = given is not None or "micro_batch_size" in tier.user_set
        micro = pipeline.check(bench, tier, plan, local, micro, explicit, flag)
    return micro


def _blocks(cfg) -> int | None:
    """The blocks of `model.layers` a config builds, where it says (decoders, flux); None elsewhere."""
    if hasattr(cfg, "n_double"):
        return cfg.n_double + cfg.n_single
    return getattr(cfg, "n_layers", None)


def start_device(
    prep: Prepared, device: str | None, dist_timeout: float = 600.0, seed: int | None = None
) -> None:
    prep.device = distributed.setup(prep.dist, device, dist_timeout)
    if prep.device.type == "cpu" and set_cpu_threads(prep.tier.cpu_threads) and prep.dist.main:
        n = prep.tier.cpu_threads
        print(
            f"ttt: {n} CPU thread{'' if n == 1 else 's'}, the {prep.tier.name} tier's setting "
            "(OMP_NUM_THREADS chooses another)",
            file=sys.stderr,
            flush=True,
        )
    prep.seed = distributed.shared_seed(seed, prep.device)


# Our keys that repeat the user's own words (`--set`, `--config`), which may name global_batch_size: the official
# RCP checker and the result_summarizer take the batch size from the last line whose text names it
# (rcp_checker.py read_submission_file), so these go before the hyperparameter block. After it, the `ttt_set`
# of `--set global_batch_size=16384` was read as the batch size: the RCP check of every such run failed.
USER_WORDS = ("ttt_set", "ttt_config")


def log_init_keys(log: ResultLog, prep: Prepared, org: str, platform: str | None, extra: dict) -> None:
    """Everything between init_start and the model build: submission keys, seed, the user's own settings
    (`USER_WORDS` of `extra`), hyperparameters, the parallelism and precision keys, config_filename, then our
    other `ttt_*` keys."""
    tier = prep.tier
    plat = platform or platform_name(prep.device, prep.dist.world)
    for k, v in submission_keys(prep.bench, tier, org, plat):
        log.event(k, v)
    log.event("seed", prep.seed)
    for k in USER_WORDS:
        if k in extra:
            log.event(k, extra[k])
    for k, v in prep.hyperparameters:
        log.event(k, v)
    for k, v in parallel_keys(prep.plan, tier.micro_batch_size) + config_keys(prep.bench, tier):
        log.event(k, v)
    for k, v in extra.items():
        if k not in USER_WORDS:
            log.event(k, v)
    if prep.device is not None and prep.device.type == "cpu":  # a CPU run's bits depend on it
        log.event("ttt_cpu_threads", torch.get_num_threads())
    # The ruleset this log is written for: `ttt check` against another says so (official logs state none).
    log.event("ttt_ruleset", prep.bench.ruleset)


def build(prep: Prepared) -> Training:
    torch.manual_seed(prep.seed)
    return build_training(
        prep.bench, prep.tier, prep.device, prep.seed, prep.plan, prep.init_checkpoint, prep.init_kind
    )
