"""The timed run with MLPerf semantics (DESIGN.md "The timed run"; spec §2.6, §3.5).

preflight (no log line yet) -> cache_clear, init_start, submission keys, seed, hyperparameters, model build
and warm-up, init_stop -> run_start (clock on; first dataset access after this) -> blocks of training with
an eval at every eval point -> run_stop success at the first eval <= target, else aborted and exit != 0.

Under torchrun every rank runs this function; only global rank 0 writes the log. Each rank trains on its
contiguous share of every global batch and evaluates its share of the eval windows; losses are averaged
and eval sums reduced across ranks, so `samples_count` and every logged figure are global.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from timetotrain import suite
from timetotrain.data import loader
from timetotrain.data.tokenizer import EOS_IDS
from timetotrain.errors import UserError
from timetotrain.mlperf.keys import check_rules, hyperparameters, parallel_keys, submission_keys
from timetotrain.mlperf.logger import ResultLog, check_writable
from timetotrain.progress import LiveLine
from timetotrain.suite.base import apply_overrides
from timetotrain.train import distributed, parallel
from timetotrain.train.abort import Aborter
from timetotrain.train.device import platform_name
from timetotrain.train.step import build_training, targets

EXIT_ABORTED = 1
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
    activation_checkpointing: bool = False
    compile: bool = False
    dist_timeout: float = 600.0  # a collective waiting longer than this fails (a peer is gone)
    abort_grace: float = 10.0  # after a signal, how long the loop gets to stop before the process exits
    aborter: Aborter | None = None  # the CLI's, entered before torch starts threads; else run() makes one


@dataclass
class RunResult:
    status: str  # success | aborted
    reason: str
    log_path: Path | None
    steps: int
    samples: int
    last_eval: float | None
    seconds: float
    tokens_per_s: float
    exit_code: int


class Evaluator:
    """Mean next-token cross-entropy over the fixed validation windows (token-weighted), each rank
    computing a contiguous share and the sums reduced across ranks."""

    def __init__(
        self, windows, n: int, table, device, micro_batch: int, rank: int = 0, world: int = 1, eod_id=None
    ):
        lo, hi = n * rank // world, n * (rank + 1) // world
        tokens = windows.batch(list(range(lo, hi)))
        if table is not None:
            tokens = table[tokens]
        self.tokens = tokens.to(device)
        self.micro_batch = micro_batch
        self.world = world
        self.device = device
        self.eod_id = eod_id

    @torch.no_grad()
    def __call__(self, model, autocast=None) -> float:
        was_training = model.training
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, token count
        for chunk in self.tokens.split(self.micro_batch):
            with torch.autocast(
                self.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
            ):
                labels = targets(chunk, self.eod_id)
                sums[0] += model(chunk[:, :-1], labels=labels, reduction="sum")
            sums[1] += (labels != -100).sum()
        if self.world > 1:
            dist.all_reduce(sums)
        model.train(was_training)
        total, count = sums.tolist()
        return total / count


class _Stopper:
    """Writes run_stop exactly once, from the loop or from the abort watcher thread."""

    def __init__(self, log: ResultLog):
        self.log = log
        self.done = False
        self._lock = threading.Lock()

    def __call__(self, status: str, samples: int) -> None:
        with self._lock:
            if not self.done:
                self.done = True
                self.log.end("run_stop", metadata={"status": status, "samples_count": samples})


def _fault_step(rank: int) -> int | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    r, _, s = spec.partition(":")
    return int(s) if int(r) == rank else None


def run(opts: RunOptions) -> RunResult:
    bench = suite.get(opts.benchmark)
    tier = apply_overrides(bench, bench.tier(opts.tier), opts.sets)
    if opts.max_steps is not None and opts.max_steps <= 0:
        raise UserError(f"--max-steps {opts.max_steps} must be positive")
    stop_after = min(opts.max_steps or tier.max_steps, tier.max_steps)
    d = distributed.from_env()
    # -- preflight: nothing logged, nothing built, until all of this passes --
    logdir = check_writable(opts.logdir / bench.name / tier.name)
    plan = parallel.parse(
        opts.parallel, d.world, precision=opts.precision,
        activation_checkpointing=opts.activation_checkpointing, compile=opts.compile,
    )  # fmt: skip
    local_batch = tier.global_batch_size // plan.data_parallel
    # A tier's micro-batch is an upper bound: more ranks means smaller per-rank batches.
    micro = min(tier.micro_batch_size, local_batch)
    if tier.global_batch_size % plan.data_parallel or local_batch % micro:
        raise UserError(
            f"global_batch_size {tier.global_batch_size} must split into {plan.data_parallel} ranks x whole "
            f"micro-batches of {micro}: change --set micro_batch_size or the process count"
        )
    if plan.ep > 1 and tier.eval_samples % plan.data_parallel:
        # Expert all-to-alls need every rank in every eval forward: equal eval shares.
        raise UserError(
            f"eval_samples {tier.eval_samples} must divide over {plan.data_parallel} expert-parallel ranks"
        )
    tier = dataclasses.replace(tier, micro_batch_size=micro)
    accum = local_batch // micro
    check_rules(bench, tier)
    res = loader.resolve(tier.data, opts.data, verify=opts.verify_data and d.main)
    device = distributed.setup(d, opts.device, opts.dist_timeout)
    seed = distributed.shared_seed(opts.seed, device)
    fault_at = _fault_step(d.rank)

    log = ResultLog(logdir if d.main else None, echo=opts.echo and d.main)
    stop = _Stopper(log)
    live = LiveLine() if d.main else None
    t_run0 = None
    step = 0
    last_eval = None
    status, reason = "aborted", ""
    tokens_done = 0
    tr = None
    clean = False

    def on_timeout(sig: int) -> None:
        stop("aborted", step * tier.global_batch_size)
        log.close()

    aborter = opts.aborter or Aborter()
    aborter.arm(on_timeout, opts.abort_grace)
    try:
        with aborter if opts.aborter is None else contextlib.nullcontext():
            log.event("cache_clear", value=loader.drop_page_cache(res.files()))
            log.start("init_start")
            for k, v in submission_keys(
                bench, tier, opts.org, opts.platform or platform_name(device, d.world)
            ):
                log.event(k, v)
            log.event("seed", seed)
            for k, v in hyperparameters(bench, tier, accum):
                log.event(k, v)
            for k, v in parallel_keys(plan, tier.micro_batch_size):
                log.event(k, v)
            log.event("ttt_tier", tier.name)
            log.event("ttt_parallel", plan.describe())
            log.event("ttt_eval_every_samples", tier.eval_every_samples)

            torch.manual_seed(seed)
            tr = build_training(bench, tier, device, seed, plan)
            log.end("init_stop")

            log.start("run_start")
            t_run0 = time.monotonic()
            # -- the clock runs: dataset access from here on --
            table = (
                loader.vocab_table(res.counts_file, tier.data.vocab_keep) if tier.data.vocab_keep else None
            )
            tr.eod_id = _eod_id(bench, tier, table)
            if live:  # tens of seconds at the reference scale (a seeded shuffle of ~360 M document ids)
                live.update("building the shuffled training sample index ...", force=True)
            train = loader.open_train(res, tier.seq_len, tier.max_steps * tier.global_batch_size, seed)
            evaluate = Evaluator(
                loader.open_val(res, tier.seq_len, tier.eval_samples), tier.eval_samples, table, device,
                tier.micro_batch_size, d.rank, plan.data_parallel, tr.eod_id,
            )  # fmt: skip
            source = loader.TokenSource(train, tier.global_batch_size, table, d.rank, plan.data_parallel)
            fetch = loader.Prefetcher(source, 0, device)
            gbs, every = tier.global_batch_size, tier.eval_every_steps
            tokens_per_step = gbs * tier.seq_len
            pending = None  # (step, [loss, stop votes]): read one step late so the host never waits
            log.start("block_start", metadata={"samples_count": 0})
            try:
                while True:
                    if fault_at is not None and step + 1 >= fault_at:
                        raise RuntimeError(
                            f"injected fault on rank {d.rank} at step {step + 1} ({FAULT_ENV})"
                        )
                    loss = tr.step(step, fetch.next(), accum, stop_vote=aborter.caught is not None)
                    step += 1
                    tokens_done += tokens_per_step
                    if pending is not None:
                        reason = _report(log, live, *pending, tokens_done, t_run0, last_eval, gbs)
                        if reason:
                            break
                    pending = (step, loss)
                    if step % every == 0 or step == stop_after:
                        reason = _report(log, live, *pending, tokens_done, t_run0, last_eval, gbs)
                        if reason:
                            break
                        pending = None
                        samples = step * gbs
                        stats = _telemetry(bench, tr.model, log, samples)
                        log.end("block_stop", metadata={"samples_count": samples})
                        log.start("eval_start", metadata={"samples_count": samples})
                        last_eval = evaluate(tr.model, tr.autocast)
                        log.event("eval_accuracy", last_eval, metadata={"samples_count": samples})
                        log.end("eval_stop", metadata={"samples_count": samples})
                        if live:
                            live.print(
                                f"eval at {samples:,} samples (step {step}): {last_eval:.4f}  target "
                                f"{tier.target}  [{time.monotonic() - t_run0:.1f} s]{stats}"
                            )
                        if math.isfinite(last_eval) and last_eval <= tier.target:
                            status, reason = "success", f"eval {last_eval:.4f} <= target {tier.target}"
                            break
                        if not math.isfinite(last_eval):
                            reason = f"non-finite eval loss at step {step}"
                            break
                        if step >= stop_after:
                            reason = f"reached {step} steps without meeting the target {tier.target}"
                            break
                        log.start("block_start", metadata={"samples_count": samples})
            finally:
                fetch.close()
            if status != "success" and aborter.caught:
                reason = f"signal {signal_name(aborter.caught)}"
            stop(status, step * gbs)
            aborter.finish()
            clean = aborter.caught is None
    except BaseException as e:
        reason = reason or f"{type(e).__name__}: {e}"
        stop("aborted", step * tier.global_batch_size)
        raise
    finally:
        if live:
            live.close()
        log.close()
        tr = None  # noqa: F841 - release the DDP/FSDP model before its process group
        distributed.teardown(barrier=clean)
    seconds = time.monotonic() - (t_run0 or time.monotonic())
    sig = aborter.caught
    code = 0 if status == "success" else (128 + sig if sig else EXIT_ABORTED)
    return RunResult(
        status, reason, log.path, step, step * tier.global_batch_size, last_eval, seconds,
        tokens_done / max(seconds, 1e-9), code,
    )  # fmt: skip


def _eod_id(bench, tier, table) -> int | None:
    """The end-of-document id as the model sees it, for benchmarks that mask the loss after EOD."""
    if not bench.eod_mask_loss:
        return None
    eos = EOS_IDS[tier.data.tokenizer]
    if table is None:
        return eos
    eod = int(table[eos])
    if eod == tier.data.vocab_keep:  # narrowed away: masking "other" would drop unrelated tokens
        raise UserError(
            f"end-of-document id {eos} is not among the {tier.data.vocab_keep} kept ids of this tier"
        )
    return eod


def _telemetry(bench, model, log, samples: int) -> str:
    """Benchmark-specific figures at each eval point (MoE: tokens per expert), logged as extra keys;
    returns a short text for the live output. Reading them syncs the host, once per eval."""
    if bench.telemetry is None:
        return ""
    figures, text = bench.telemetry(getattr(model, "module", model))
    for key, value in figures.items():
        log.event(key, value, metadata={"samples_count": samples})
    return text


def _report(log, live, step, loss_t, tokens_done, t0, last_eval, gbs) -> str:
    """Log a step's loss; returns why the run must stop ('' to go on). Every rank reads the same reduced
    values, so every rank takes the same decision at the same step."""
    loss, votes = loss_t.tolist()
    log.event("train_loss", loss, metadata={"step_num": step, "samples_count": step * gbs})
    if live:
        rate = tokens_done / max(time.monotonic() - t0, 1e-9)
        ev = f"{last_eval:.4f}" if last_eval is not None else "-"
        live.update(
            f"step {step}  samples {step * gbs:,}  loss {loss:.4f}  {rate:,.0f} tok/s  last eval {ev}"
        )
    if votes > 0:
        return "stopped by a signal"
    if not math.isfinite(loss):
        return f"non-finite train_loss at step {step}"
    return ""


def signal_name(sig: int | None) -> str:
    return signal.Signals(sig).name if sig else ""
