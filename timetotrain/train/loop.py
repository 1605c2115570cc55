"""The timed run with MLPerf semantics (docs/running.md, "What a run does").

preflight (no log line yet) -> cache_clear, init_start, submission keys, seed, hyperparameters, model build
and warm-up, init_stop -> run_start (clock on; first dataset access after this) -> blocks of training with
an eval at every eval point -> run_stop success at the first eval meeting the target (<= or >=, as the
task's metric says), else aborted and exit != 0.

The loop knows a benchmark only through its task (data, loss, evaluation, metric) and model family
(build, init, telemetry): spec/task.py. Under torchrun every rank runs this function; only global rank 0
writes the log. Each rank trains on its contiguous share of every global batch and evaluates its share of
the eval set; losses are averaged and eval sums reduced across ranks, so `samples_count` and every logged
figure are global.

`_run` reads as the run's steps in order (`_TimedRun`: preflight, open_outputs, log_header, build,
start_clock, train and evaluate, stop_run, teardown); those `ttt synth` takes too are in train/run_steps.py.
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
from timetotrain.mlperf.logger import ResultLog
from timetotrain.mlperf.structure import STOP_SIGNAL_KEY
from timetotrain.spec.benchmark import Benchmark, init_warning
from timetotrain.train import distributed, prepare, run_steps
from timetotrain.train.abort import Aborter
from timetotrain.train.base_model import check_init_base
from timetotrain.train.checkpoint import META, check_init_source, save_checkpoint
from timetotrain.train.device import threads_kept
from timetotrain.train.expert_parallel import expert_dtensors
from timetotrain.train.terminal import Progress, status_word, stop_line

EXIT_ABORTED = 1
_BEFORE_RUN_START = "stopped before run_start (preflight or init): no result file written"
# Fault injection for the fault-tolerance tests: "RANK:STEP" makes that rank raise before that step.
FAULT_ENV = "TTT_INJECT_FAULT"


@dataclass
class RunOptions:
    benchmark: str | Benchmark  # a registered name, or a declaration (prepare.resolve_tier)
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
    r = _TimedRun(opts)
    r.preflight()
    r.open_outputs()
    aborter = r.aborter = opts.aborter or Aborter()
    aborter.arm(r.on_timeout, opts.abort_grace)
    try:
        with aborter if opts.aborter is None else contextlib.nullcontext():
            r.log_header()
            r.build()
            r.start_clock()
            r.train()
            r.stop_run()
    except BaseException as e:
        r.reason = r.reason or f"{type(e).__name__}: {e}"
        r.stop("aborted", r.step * r.tier.global_batch_size, aborter.caught)
        r.failed = e
        raise
    finally:
        r.teardown()
        if r.failed is not None:
            r.say_failed()
    return r.result()


class _TimedRun:
    """One timed run, in the order of its named steps (`_run`); the state the steps hand on (the step count,
    the last eval, why the run stopped) lives here, where the abort watcher's `on_timeout` reads it too."""

    def __init__(self, opts: RunOptions):
        self.opts = opts
        self.step = 0
        self.items_done = 0
        self.last_eval: float | None = None
        self.status, self.reason = "aborted", ""
        self.t_run0: float | None = None
        self.tr = None
        self.data = None
        self.clean = False  # every rank finished: teardown may wait for the others at a barrier
        self.aborter: Aborter | None = None
        self.progress: Progress | None = None  # what the live line shows besides the step's own figures
        self.failed: BaseException | None = None

    def preflight(self) -> None:
        """Nothing logged, nothing built, until all of this passes."""
        opts = self.opts
        bench, tier = prepare.resolve_tier(opts.benchmark, opts.tier, opts.sets)
        if opts.max_steps is not None and opts.max_steps <= 0:
            raise UserError(f"--max-steps {opts.max_steps} must be positive")
        self.stop_after = min(opts.max_steps or tier.max_steps, tier.max_steps)
        prep = prepare.preflight(
            bench, tier, opts.logdir / bench.name / tier.name, opts.parallel, opts.precision,
            opts.activation_checkpointing, opts.compile, device=opts.device, seed=opts.seed,
        )  # fmt: skip
        self.bench, self.prep, self.tier, self.task = bench, prep, prep.tier, bench.task
        check_rules(bench, self.tier, prep.hyperparameters)
        # The tier's shipped base (against its pinned sha256s), or a `ttt base` folder (against its
        # base.json), is hashed before anything parses it.
        base = check_init_base(bench, self.tier, Path(opts.init_checkpoint) if opts.init_checkpoint else None)
        if base.folder is not None:
            prep.init_kind = check_init_source(base.folder, bench.family, self.tier.model)
            prep.init_checkpoint = base.folder
        if base.note and prep.dist.main:
            print(f"ttt: {base.note}", file=sys.stderr)
        self.base = base
        if opts.save_checkpoint is not None:
            _check_save_target(Path(opts.save_checkpoint))
        self.res = self.task.resolve(
            self.tier,
            opts.data,
            verify=opts.verify_data and prep.dist.main,
            init_checkpoint=prep.init_checkpoint,
        )
        prepare.start_device(prep, opts.device, opts.dist_timeout, opts.seed)
        self.fault_at = _fault_step(prep.dist.rank)
        self.item_name, self.items_per_sample = self.task.sample_items(self.tier)
        # Said once every check has passed, before the clock: a run meant to start from a checkpoint that
        # starts from random weights runs on (a throughput check may mean it), but not unnoticed.
        self.init_warning = init_warning(bench, self.tier, opts.init_checkpoint)
        if self.init_warning and prep.dist.main:
            print(f"ttt: warning: {self.init_warning}", file=sys.stderr, flush=True)

    def open_outputs(self) -> None:
        self.out = run_steps.open_outputs(
            self.prep, "", {}, (self.item_name, self.items_per_sample), self.opts
        )
        self.log, self.live = self.out.log, self.out.live
        self.stop = _Stopper(self.log)

    def on_timeout(self, sig: int) -> None:
        """The abort watcher's: the loop did not stop within the grace after a signal."""
        self.stop("aborted", self.step * self.tier.global_batch_size, sig)
        self.log.close()
        if not self.log.started:
            print(f"ttt: interrupted by {signal_name(sig)}: {_BEFORE_RUN_START}", file=sys.stderr, flush=True)
        elif self.log.path is not None:  # rank 0: the process exits from this thread, so say it here
            why = f"the step did not end within --abort-grace {self.opts.abort_grace:g} s; {self.step} steps"
            self._say(stop_line(status_word("aborted", sig), why, self.log.path))

    def say_failed(self) -> None:
        """A run that an exception ended after its clock started: one line, above the error itself."""
        if self.log.path is None or not self.log.started:  # no result log: the CLI's error line says it all
            return
        e, sig = self.failed, self.aborter.caught if self.aborter else None
        why = f"{type(e).__name__} at step {self.step} (below)"
        self._say(stop_line(status_word("failed", sig), why, self.log.path))

    def _say(self, line: str) -> None:
        if self.live:
            self.live.print(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def log_header(self) -> None:
        """cache_clear, init_start and the init block's keys, ours (`ttt_*`) last but for the user's own
        settings (`prepare.USER_WORDS`: before the hyperparameters)."""
        opts, prep, base = self.opts, self.prep, self.base
        extra = {
            "ttt_tier": self.tier.name,
            "ttt_parallel": prep.plan.describe(),
            "ttt_eval_every_samples": self.tier.eval_every_samples,
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
        if self.init_warning is not None:  # the log says so too: a reader of the result sees why it lags
            extra["ttt_init_warning"] = self.init_warning
        if opts.config is not None:
            extra["ttt_config"] = opts.config
        run_steps.log_init(
            self.log, prep, loader.drop_page_cache(self.res.files()), opts.org, opts.platform, extra
        )

    def build(self) -> None:
        self.tr = run_steps.build(self.prep, self.out)
        if self.out.trackers is not None:
            self.out.trackers.lr_at = self.tr.sched  # a host function of the step: no device read
        self.log.end("init_stop")

    def start_clock(self) -> None:
        """run_start, unless a signal came during preflight or init: then the run stops before its clock,
        with no result file. Every rank takes the same decision (one reduction), so none waits on a peer
        that left."""
        caught = int(distributed.all_reduce([float(self.aborter.caught or 0)], "max", self.prep.device)[0])
        if caught:
            raise Interrupted(caught, _BEFORE_RUN_START)
        self.log.start("run_start")
        self.t_run0 = time.monotonic()

    def train(self) -> None:
        """Blocks of steps with an eval at each eval point, until the run ends (sets status and reason).
        Dataset access starts here, on the clock."""
        prep, tier, task, d = self.prep, self.tier, self.task, self.prep.dist
        if self.live:  # tens of seconds at the reference scale (a seeded shuffle of ~360 M document ids)
            self.live.update("opening the data ...", force=True)
        data = self.data = task.open(tier, self.res, prep.seed, prep.share, prep.device)
        self.progress = Progress(task, tier, self.stop_after)
        self.progress.samples_per_epoch = data.samples_per_epoch
        fetch = loader.Prefetcher(data, 0, prep.device)
        self.log_from = task.first_logged_eval_step(tier)
        items_per_step = tier.global_batch_size * self.items_per_sample
        pending = None  # (step, [loss, stop votes]): read one step late so the host never waits
        # Blocks count samples for every task, epoch-counted ones too: the common rules want
        # `samples_count` (or whole-epoch `epoch_count` + `first_epoch_num`) on block_start/stop.
        self.log.start("block_start", metadata={"samples_count": 0})
        try:
            while True:
                if self.fault_at is not None and self.step + 1 >= self.fault_at:
                    raise RuntimeError(
                        f"injected fault on rank {d.rank} at step {self.step + 1} ({FAULT_ENV})"
                    )
                batch = fetch.next()
                if task.on_policy:  # rollouts from the weights of this step (GRPO)
                    batch = data.prepare(self.tr.model, batch)
                loss = self.tr.step(
                    self.step, batch, prep.accum, data.loss,
                    stop_vote=self.aborter.caught is not None, sums=data.step_sums(),
                )  # fmt: skip
                self.step += 1
                self.items_done += items_per_step
                if pending is not None and self._report(pending):
                    break
                pending = (self.step, loss)
                on_cadence = task.eval_due(tier, self.step)
                if on_cadence or self.step == self.stop_after:
                    if self._report(pending):
                        break
                    pending = None
                    if not on_cadence:  # only an eval point can end a run with success
                        self._exhausted()
                        break
                    if self.evaluate():
                        break
        finally:
            fetch.close()

    def _report(self, pending) -> bool:
        """Log a step's loss (read one step late); True when the run must stop."""
        self.reason = _report(
            self.log, self.live, *pending, self.items_done, self.item_name, self.t_run0, self.progress,
            self.tier.global_batch_size, self.data,
        )  # fmt: skip
        self.progress.times.mark(self.step)  # the read waited for the step before: host time, no sync
        return bool(self.reason)

    def _exhausted(self) -> None:
        self.reason = f"reached {self.step} steps without meeting the target {self.tier.target}"
        self.status = self.task.exhausted_status

    def evaluate(self) -> bool:
        """An eval point: block_stop, eval_start, eval_accuracy, eval_stop (where the point is logged), then
        block_start of the next block; True when the run ends here (sets status and reason)."""
        step, tier, log, live, metric = self.step, self.tier, self.log, self.live, self.task.metric
        samples = step * tier.global_batch_size
        point = _point(samples, self.data, metric)
        logged = step >= self.log_from
        stats = _telemetry(self.bench, self.tr.bare, log, point) if logged else ""
        if logged:
            log.end("block_stop", metadata={"samples_count": samples})
            log.start("eval_start", metadata=point)
        self.last_eval = last = self.data.evaluate(self.tr.model, self.tr.autocast)
        self.progress.evaluated(last)
        if not logged and metric.met(last, tier.target):
            # An evaluation the reference runs but does not report (llama2_70b_lora's at eval_delay) costs
            # its time and may end the run; it is logged only then, so the log keeps the eval_accuracy the
            # rules require.
            logged = True
            log.end("block_stop", metadata={"samples_count": samples})
            log.start("eval_start", metadata=point)
        if logged:
            log.event("eval_accuracy", last, metadata=point)
            log.end("eval_stop", metadata=point)
            if live:
                where = ", ".join(f"{k} {v:,}" for k, v in point.items())
                live.print(
                    f"eval at {where} (step {step}): {last:.4f}  target "
                    f"{metric.comparison} {tier.target}  [{time.monotonic() - self.t_run0:.1f} s]{stats}"
                )
        if metric.met(last, tier.target):
            self.status = "success"
            self.reason = f"eval {last:.4f} {metric.comparison} target {tier.target}"
            return True
        if not math.isfinite(last):
            self.reason = f"non-finite eval metric at step {step}"
            return True
        if step >= self.stop_after:
            self._exhausted()
            return True
        if logged:  # else the block that an unreported evaluation interrupted goes on
            log.start("block_start", metadata={"samples_count": samples})
        return False

    def stop_run(self) -> None:
        """run_stop (the signal's name first, after one), then the checkpoint off the clock."""
        aborter, opts = self.aborter, self.opts
        sig = aborter.caught if self.status != "success" else None
        if sig:
            self.reason = f"signal {signal_name(sig)}, logged as aborted"
        self.stop(self.status, self.step * self.tier.global_batch_size, sig)
        if opts.save_checkpoint is not None and aborter.caught is None:
            # After run_stop: the clock has stopped, so saving costs the result nothing.
            _save_after_run(
                Path(opts.save_checkpoint),
                self.tr,
                self.bench,
                self.tier,
                self.prep.seed,
                self.step,
                self.live,
            )
        aborter.finish()
        self.clean = aborter.caught is None

    def teardown(self) -> None:
        self.out.close()
        if self.data is not None:
            self.data.close()
        self.tr = None  # release the DDP/FSDP model before its process group
        distributed.teardown(barrier=self.clean)

    def result(self) -> RunResult:
        seconds = time.monotonic() - (self.t_run0 or time.monotonic())
        sig = self.aborter.caught
        code = 0 if self.status == "success" else (128 + sig if sig else EXIT_ABORTED)
        return RunResult(
            self.status, self.reason, self.log.path, self.step, self.step * self.tier.global_batch_size,
            self.last_eval, seconds, self.items_done / max(seconds, 1e-9), self.item_name, code,
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


def _report(log, live, step, loss_t, items_done, item_name, t0, progress, gbs, data) -> str:
    """Log a step's loss, and the task's per-step figures (read in the same host transfer); returns why the
    run must stop ('' to go on). Every rank reads the same reduced values, so every rank takes the same
    decision at the same step. The live line is built only when it is due to print."""
    loss, votes, *sums = loss_t.tolist()
    point = {"step_num": step, "samples_count": step * gbs}
    log.event("train_loss", loss, metadata=point)
    figures = data.step_figures(sums) if sums else {}
    if figures:
        log.event(data.step_key, figures, metadata=point)
    if live and live.due():
        rate = items_done / max(time.monotonic() - t0, 1e-9)
        more = "".join(f"  {k} {v:.3g}" for k, v in list(figures.items())[:1])
        live.update(
            f"step {step}  samples {step * gbs:,}  loss {loss:.4f}{more}  {rate:,.0f} {item_name}/s  "
            + progress.text(step)
        )
    if votes > 0:
        return "stopped by a signal"
    if not math.isfinite(loss):
        return f"non-finite train_loss at step {step}"
    return ""


def signal_name(sig: int | None) -> str:
    return signal.Signals(sig).name if sig else ""
