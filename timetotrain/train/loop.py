"""The timed run with MLPerf semantics (README "What a run does").

preflight (no log line yet) -> cache_clear, init_start, submission keys, seed, hyperparameters, model build
and warm-up, init_stop -> run_start (clock on; first dataset access after this) -> blocks of training with
an eval at every eval point -> run_stop success at the first eval meeting the target (<= or >=, as the
task's metric says), else aborted and exit != 0.

The loop knows a benchmark only through its task (data, loss, evaluation, metric) and model family
(build, init, telemetry): spec/task.py. Under torchrun every rank runs this function; only global rank 0
writes the log. Each rank trains on its contiguous share of every global batch and evaluates its share of
the eval set; losses are averaged and eval sums reduced across ranks, so `samples_count` and every logged
figure are global.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from timetotrain.data import loader
from timetotrain.errors import Interrupted, UserError
from timetotrain.mlperf.keys import check_rules
from timetotrain.mlperf.logger import STOP_SIGNAL_KEY, ResultLog
from timetotrain.progress import LiveLine
from timetotrain.train import distributed, prepare
from timetotrain.train.abort import Aborter
from timetotrain.train.base_model import check_init_base
from timetotrain.train.checkpoint import META, check_init_source, save_checkpoint
from timetotrain.train.device import threads_kept
from timetotrain.train.expert_parallel import expert_dtensors
from timetotrain.train.trackers import open_trackers

EXIT_ABORTED = 1
_BEFORE_RUN_START = "stopped before run_start (preflight or init): no result file written"
# Fault injection for the fault-tolerance tests: "RANK:STEP" makes that rank raise before that step.
FAULT_ENV = "TTT_INJECT_FAULT"


@dataclass
class RunOptions:
    benchmark: str
    tier: str
    data: Path
    logdir: Path
    seed: int | None = None
    max_steps: int | None = None  # stop after this many steps (aborted); the schedule keeps the tier's
    sets: list[str] = field(default_factory=list)
    device: str | None = None
    org: str = "timetotrain"
    platform: str | None = None
    echo: bool = True
    verify_data: bool = True
    parallel: str | None = None  # e.g. "dp=8", "fsdp=8"; default: dp over all ranks
    precision: str = "fp32"
    activation_checkpointing: int = 0  # checkpoint every K-th block; 0 none, 1 all (train/parallel.py)
    compile: bool = False
    init_checkpoint: Path | None = None  # start from these weights (Hugging Face or ttt checkpoint folder)
    save_checkpoint: Path | None = None  # after run_stop, save the trained state here (a ttt checkpoint)
    dist_timeout: float = 600.0  # a collective waiting longer than this fails (a peer is gone)
    abort_grace: float = 10.0  # after a signal, how long the loop gets to stop before the process exits
    aborter: Aborter | None = None  # the CLI's, entered before torch starts threads; else run() makes one
    tensorboard: Path | None = None  # write TensorBoard events under this folder (train/trackers.py)
    wandb: bool = False  # log to Weights & Biases (offline unless WANDB_MODE says otherwise)
    config: dict | None = None  # the --config file and its values (cli/config.py), logged as ttt_config


@dataclass
class RunResult:
    status: str  # success | aborted
    reason: str
    log_path: Path | None
    steps: int
    samples: int
    last_eval: float | None
    seconds: float
    items_per_s: float  # throughput in the task's items (tokens, images, ...) per second
    item_name: str
    exit_code: int


class _Stopper:
    """Writes run_stop exactly once, from the loop or from the abort watcher thread; after a signal, the
    signal's name first (`ttt_stop_signal`: `ttt suite` reruns such a run). Before run_start there is no
    run to stop: nothing is written and the log is removed (mlperf/logger.py)."""

    def __init__(self, log: ResultLog):
        self.log = log
        self.done = False
        self._lock = threading.Lock()

    def __call__(self, status: str, samples: int, sig: int | None = None) -> None:
        with self._lock:
            if not self.done and self.log.started:
                self.done = True
                if sig:
                    self.log.event(STOP_SIGNAL_KEY, signal_name(sig))
                self.log.end("run_stop", metadata={"status": status, "samples_count": samples})


def _fault_step(rank: int) -> int | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    r, _, s = spec.partition(":")
    return int(s) if int(r) == rank else None


def run(opts: RunOptions) -> RunResult:
    with threads_kept():  # a tier's CPU thread count holds for this call only
        return _run(opts)


def _run(opts: RunOptions) -> RunResult:
    # -- preflight: nothing logged, nothing built, until all of this passes --
    bench, tier = prepare.resolve_tier(opts.benchmark, opts.tier, opts.sets)
    if opts.max_steps is not None and opts.max_steps <= 0:
        raise UserError(f"--max-steps {opts.max_steps} must be positive")
    stop_after = min(opts.max_steps or tier.max_steps, tier.max_steps)
    prep = prepare.preflight(
        bench, tier, opts.logdir / bench.name / tier.name, opts.parallel, opts.precision,
        opts.activation_checkpointing, opts.compile, device=opts.device, seed=opts.seed,
    )  # fmt: skip
    tier, d, task = prep.tier, prep.dist, bench.task
    check_rules(bench, tier, prep.hyperparameters)
    # The tier's shipped base (against its pinned sha256s), or a `ttt base` folder (against its base.json),
    # is hashed before anything parses it.
    base = check_init_base(bench, tier, Path(opts.init_checkpoint) if opts.init_checkpoint else None)
    if base.folder is not None:
        prep.init_kind = check_init_source(base.folder, bench.family, tier.model)
        prep.init_checkpoint = base.folder
    if base.note and d.main:
        print(f"ttt: {base.note}", file=sys.stderr)
    if opts.save_checkpoint is not None:
        _check_save_target(Path(opts.save_checkpoint))
    res = task.resolve(
        tier, opts.data, verify=opts.verify_data and d.main, init_checkpoint=prep.init_checkpoint
    )
    prepare.start_device(prep, opts.device, opts.dist_timeout, opts.seed)
    device, seed = prep.device, prep.seed
    fault_at = _fault_step(d.rank)
    metric = task.metric
    item_name, items_per_sample = task.sample_items(tier)

    trackers = None  # opened before the log, so a missing tracker package leaves no result file behind
    if d.main:
        trackers = open_trackers(
            opts.tensorboard, opts.wandb, f"{bench.name}-{tier.name}-seed{seed}",
            {"benchmark": bench.name, "tier": tier.name, "seed": seed, "global_batch_size": tier.global_batch_size,
             "item": item_name, "items_per_sample": items_per_sample},
            opts.logdir / "wandb",
        )  # fmt: skip
    log = ResultLog(prep.logdir if d.main else None, echo=opts.echo and d.main)
    if trackers is not None:
        log.listeners.append(trackers.on_event)
    stop = _Stopper(log)
    live = LiveLine() if d.main else None
    t_run0 = None
    step = 0
    last_eval = None
    status, reason = "aborted", ""
    items_done = 0
    tr = None
    data = None
    clean = False

    def on_timeout(sig: int) -> None:
        stop("aborted", step * tier.global_batch_size, sig)
        log.close()
        if not log.started:
            print(f"ttt: interrupted by {signal_name(sig)}: {_BEFORE_RUN_START}", file=sys.stderr, flush=True)

    aborter = opts.aborter or Aborter()
    aborter.arm(on_timeout, opts.abort_grace)
    try:
        with aborter if opts.aborter is None else contextlib.nullcontext():
            log.event("cache_clear", value=loader.drop_page_cache(res.files()))
            log.start("init_start")
            extra = {
                "ttt_tier": tier.name,
                "ttt_parallel": prep.plan.describe(),
                "ttt_eval_every_samples": tier.eval_every_samples,
                # The inputs `ttt package` writes into run_and_time.sh to repeat this run.
                "ttt_data": str(Path(opts.data).resolve()),
                "ttt_set": list(opts.sets),
            }
            if opts.max_steps is not None:
                extra["ttt_max_steps"] = opts.max_steps
            if base.shipped is not None:  # by name, not by its path inside this installation
                extra["ttt_init_base"] = base.shipped
            elif prep.init_checkpoint is not None:
                extra["ttt_init_checkpoint"] = str(prep.init_checkpoint)
            if base.sha256 is not None:
                extra["ttt_init_checkpoint_sha256"] = base.sha256
            if opts.config is not None:
                extra["ttt_config"] = opts.config
            prepare.log_init_keys(log, prep, opts.org, opts.platform, extra)
            tr = prepare.build(prep)
            if tr.load_seconds is not None:
                # Inside init, before run_start: loading the starting weights is not timed, but reported.
                log.event("ttt_init_checkpoint_load_seconds", round(tr.load_seconds, 3))
                if live:
                    live.print(f"loaded {prep.init_checkpoint} in {tr.load_seconds:.1f} s")
            if trackers is not None:
                trackers.lr_at = tr.sched  # a host function of the step: no device read
            log.end("init_stop")

            # A signal during preflight or init stops the run here, before its clock: no result file. Every
            # rank takes the same decision (one reduction), so none waits on a peer that left.
            caught = int(distributed.all_reduce([float(aborter.caught or 0)], "max", device)[0])
            if caught:
                raise Interrupted(caught, _BEFORE_RUN_START)
            log.start("run_start")
            t_run0 = time.monotonic()
            # -- the clock runs: dataset access from here on --
            if live:  # tens of seconds at the reference scale (a seeded shuffle of ~360 M document ids)
                live.update("opening the data ...", force=True)
            data = task.open(tier, res, seed, prep.share, device)
            fetch = loader.Prefetcher(data, 0, device)
            gbs, accum = tier.global_batch_size, prep.accum
            log_from = task.first_logged_eval_step(tier)
            items_per_step = gbs * items_per_sample
            pending = None  # (step, [loss, stop votes]): read one step late so the host never waits
            # Blocks count samples for every task, epoch-counted ones too: the common rules want
            # `samples_count` (or whole-epoch `epoch_count` + `first_epoch_num`) on block_start/stop.
            log.start("block_start", metadata={"samples_count": 0})
            try:
                while True:
                    if fault_at is not None and step + 1 >= fault_at:
                        raise RuntimeError(
                            f"injected fault on rank {d.rank} at step {step + 1} ({FAULT_ENV})"
                        )
                    batch = fetch.next()
                    if task.on_policy:  # rollouts from the weights of this step (GRPO)
                        batch = data.prepare(tr.bare, batch)
                    loss = tr.step(
                        step,
                        batch,
                        accum,
                        data.loss,
                        stop_vote=aborter.caught is not None,
                        sums=data.step_sums(),
                    )
                    step += 1
                    items_done += items_per_step
                    if pending is not None:
                        reason = _report(
                            log, live, *pending, items_done, item_name, t_run0, last_eval, gbs, data
                        )
                        if reason:
                            break
                    pending = (step, loss)
                    on_cadence = task.eval_due(tier, step)
                    if on_cadence or step == stop_after:
                        reason = _report(
                            log, live, *pending, items_done, item_name, t_run0, last_eval, gbs, data
                        )
                        if reason:
                            break
                        pending = None
                        if not on_cadence:  # only an eval point can end a run with success
                            reason = f"reached {step} steps without meeting the target {tier.target}"
                            status = task.exhausted_status
                            break
                        point = _point(step * gbs, data, metric)
                        logged = step >= log_from
                        stats = _telemetry(bench, tr.bare, log, point) if logged else ""
                        if logged:
                            log.end("block_stop", metadata={"samples_count": step * gbs})
                            log.start("eval_start", metadata=point)
                        last_eval = data.evaluate(tr.model, tr.autocast)
                        if not logged and metric.met(last_eval, tier.target):
                            # An evaluation the reference runs but does not report (llama2_70b_lora's at
                            # eval_delay) costs its time and may end the run; it is logged only then, so
                            # the log keeps the eval_accuracy the rules require.
                            logged = True
                            log.end("block_stop", metadata={"samples_count": step * gbs})
                            log.start("eval_start", metadata=point)
                        if logged:
                            log.event("eval_accuracy", last_eval, metadata=point)
                            log.end("eval_stop", metadata=point)
                            if live:
                                where = ", ".join(f"{k} {v:,}" for k, v in point.items())
                                live.print(
                                    f"eval at {where} (step {step}): {last_eval:.4f}  target "
                                    f"{metric.comparison} {tier.target}  [{time.monotonic() - t_run0:.1f} s]{stats}"
                                )
                        if metric.met(last_eval, tier.target):
                            status = "success"
                            reason = f"eval {last_eval:.4f} {metric.comparison} target {tier.target}"
                            break
                        if not math.isfinite(last_eval):
                            reason = f"non-finite eval metric at step {step}"
                            break
                        if step >= stop_after:
                            reason = f"reached {step} steps without meeting the target {tier.target}"
                            status = task.exhausted_status
                            break
                        if logged:  # else the block that an unreported evaluation interrupted goes on
                            log.start("block_start", metadata={"samples_count": step * gbs})
            finally:
                fetch.close()
            sig = aborter.caught if status != "success" else None
            if sig:
                reason = f"signal {signal_name(sig)}"
            stop(status, step * gbs, sig)
            if opts.save_checkpoint is not None and aborter.caught is None:
                # After run_stop: the clock has stopped, so saving costs the result nothing.
                _save_after_run(Path(opts.save_checkpoint), tr, bench, tier, seed, step, live)
            aborter.finish()
            clean = aborter.caught is None
    except BaseException as e:
        reason = reason or f"{type(e).__name__}: {e}"
        stop("aborted", step * tier.global_batch_size, aborter.caught)
        raise
    finally:
        if live:
            live.close()
        log.close()
        if trackers is not None:
            trackers.close()
        if data is not None:
            data.close()
        tr = None  # noqa: F841 - release the DDP/FSDP model before its process group
        distributed.teardown(barrier=clean)
    seconds = time.monotonic() - (t_run0 or time.monotonic())
    sig = aborter.caught
    code = 0 if status == "success" else (128 + sig if sig else EXIT_ABORTED)
    return RunResult(
        status, reason, log.path, step, step * tier.global_batch_size, last_eval, seconds,
        items_done / max(seconds, 1e-9), item_name, code,
    )  # fmt: skip


def _check_save_target(path: Path) -> None:
    """--save-checkpoint replaces only an earlier ttt checkpoint, never another folder or a file."""
    if path.exists() and not (path.is_dir() and (path / META).is_file()):
        raise UserError(
            f"--save-checkpoint {path} exists and is not a ttt checkpoint: choose a new folder "
            "(only an earlier checkpoint is replaced)"
        )
    if path.parent.exists() and not path.parent.is_dir():
        raise UserError(f"--save-checkpoint {path}: {path.parent} is not a folder")


def _save_after_run(path: Path, tr, bench, tier, seed: int, step: int, live) -> None:
    """The trained model (and its optimizer, except under expert parallelism, where DCP gets the model
    alone) as a ttt checkpoint `--init-checkpoint` reads; every rank writes its own shards."""
    opt = None if expert_dtensors(tr.bare) else tr.opt
    extra = {"benchmark": bench.name, "tier": tier.name, "seed": seed}
    try:
        save_checkpoint(path, tr.bare, opt, step, extra)
    except OSError as e:
        raise UserError(
            f"--save-checkpoint {path}: cannot be written ({e.strerror}); the run's result is complete, "
            "only the checkpoint is missing"
        ) from None
    if live:
        live.print(f"saved the trained state (step {step}) to {path}")


def _point(samples: int, data, metric) -> dict:
    """The metadata of an eval point: `samples_count`, or `epoch_num` for tasks counted in epochs."""
    if metric.unit == "epochs":
        epochs = samples / data.samples_per_epoch
        return {
            "epoch_num": epochs if metric.epoch_decimals is None else round(epochs, metric.epoch_decimals)
        }
    return {"samples_count": samples}


def _telemetry(bench, model, log, point: dict) -> str:
    """Model-specific figures at each eval point (MoE: tokens per expert), logged as extra keys; returns a
    short text for the live output. Reading them syncs the host, once per eval."""
    if bench.family.telemetry is None:
        return ""
    figures, text = bench.family.telemetry(model)
    for key, value in figures.items():
        log.event(key, value, metadata=point)
    return text


def _report(log, live, step, loss_t, items_done, item_name, t0, last_eval, gbs, data) -> str:
    """Log a step's loss, and the task's per-step figures (read in the same host transfer); returns why the
    run must stop ('' to go on). Every rank reads the same reduced values, so every rank takes the same
    decision at the same step."""
    loss, votes, *sums = loss_t.tolist()
    point = {"step_num": step, "samples_count": step * gbs}
    log.event("train_loss", loss, metadata=point)
    figures = data.step_figures(sums) if sums else {}
    if figures:
        log.event(data.step_key, figures, metadata=point)
    if live:
        rate = items_done / max(time.monotonic() - t0, 1e-9)
        ev = f"{last_eval:.4f}" if last_eval is not None else "-"
        more = "".join(f"  {k} {v:.3g}" for k, v in list(figures.items())[:1])
        live.update(
            f"step {step}  samples {step * gbs:,}  loss {loss:.4f}{more}  {rate:,.0f} {item_name}/s  last eval {ev}"
        )
    if votes > 0:
        return "stopped by a signal"
    if not math.isfinite(loss):
        return f"non-finite train_loss at step {step}"
    return ""


def signal_name(sig: int | None) -> str:
    return signal.Signals(sig).name if sig else ""
