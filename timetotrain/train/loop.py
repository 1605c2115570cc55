"""The timed run with MLPerf semantics (DESIGN.md "The timed run"; spec §2.6, §3.5).

preflight (no log line yet) -> cache_clear, init_start, submission keys, seed, hyperparameters, model build
and warm-up, init_stop -> run_start (clock on; first dataset access after this) -> blocks of training with
an eval at every eval point -> run_stop success at the first eval <= target, else aborted and exit != 0.
"""

from __future__ import annotations

import math
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from timetotrain import suite
from timetotrain.data import loader
from timetotrain.errors import UserError
from timetotrain.mlperf.keys import check_rules, hyperparameters, submission_keys
from timetotrain.mlperf.logger import ResultLog, check_writable
from timetotrain.progress import LiveLine
from timetotrain.suite.base import apply_overrides
from timetotrain.train.device import default_device, platform_name
from timetotrain.train.step import build_training

EXIT_ABORTED = 1


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


class _Signals:
    """SIGTERM/SIGINT become a flag the loop checks between steps, so the log always gets run_stop."""

    def __init__(self):
        self.caught: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, _frame):
        self.caught = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Evaluator:
    """Mean next-token cross-entropy over the fixed validation windows (token-weighted)."""

    def __init__(self, windows, n: int, table, device, micro_batch: int):
        tokens = windows.batch(list(range(n)))
        if table is not None:
            tokens = table[tokens]
        self.tokens = tokens.to(device)
        self.micro_batch = micro_batch

    @torch.no_grad()
    def __call__(self, model) -> float:
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.tokens.device)
        count = 0
        for chunk in self.tokens.split(self.micro_batch):
            logits = model(chunk[:, :-1])
            total += F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum")
            count += chunk[:, 1:].numel()
        model.train(was_training)
        return (total / count).item()


def run(opts: RunOptions) -> RunResult:
    bench = suite.get(opts.benchmark)
    tier = apply_overrides(bench, bench.tier(opts.tier), opts.sets)
    if opts.max_steps is not None and opts.max_steps <= 0:
        raise UserError(f"--max-steps {opts.max_steps} must be positive")
    stop_after = min(opts.max_steps or tier.max_steps, tier.max_steps)
    # -- preflight: nothing logged, nothing built, until all of this passes --
    logdir = check_writable(opts.logdir / bench.name / tier.name)
    check_rules(bench, tier)
    res = loader.resolve(tier.data, opts.data, verify=opts.verify_data)
    device = torch.device(opts.device) if opts.device else default_device()
    seed = opts.seed if opts.seed is not None else secrets.randbelow(2**31 - 1)

    log = ResultLog(logdir, echo=opts.echo)
    live = LiveLine()
    t_run0 = None
    step = 0
    last_eval = None
    status, reason = "aborted", ""
    tokens_done = 0
    stopped = False
    try:
        with _Signals() as sig:
            log.event("cache_clear", value=loader.drop_page_cache(res.files()))
            log.start("init_start")
            for k, v in submission_keys(bench, tier, opts.org, opts.platform or platform_name(device)):
                log.event(k, v)
            log.event("seed", seed)
            for k, v in hyperparameters(bench, tier):
                log.event(k, v)
            log.event("ttt_tier", tier.name)
            log.event("ttt_eval_every_samples", tier.eval_every_samples)
            log.event("lowest_numerical_precision_in_linear", "fp32")

            torch.manual_seed(seed)
            tr = build_training(bench, tier, device, seed)
            log.end("init_stop")

            log.start("run_start")
            t_run0 = time.monotonic()
            # -- the clock runs: dataset access from here on --
            table = (
                loader.vocab_table(res.counts_file, tier.data.vocab_keep) if tier.data.vocab_keep else None
            )
            train = loader.open_train(res, tier.seq_len, tier.max_steps * tier.global_batch_size, seed)
            evaluate = Evaluator(
                loader.open_val(res, tier.seq_len, tier.eval_samples), tier.eval_samples, table, device,
                tier.micro_batch_size,
            )  # fmt: skip
            source = loader.TokenSource(train, tier.global_batch_size, table)
            fetch = loader.Prefetcher(source, 0, device)
            gbs, every = tier.global_batch_size, tier.eval_every_steps
            tokens_per_step = gbs * tier.seq_len
            pending = None  # (step, loss tensor): read one step late so the host never waits on the device
            log.start("block_start", metadata={"samples_count": 0})
            try:
                while True:
                    if sig.caught is not None:
                        reason = f"signal {signal.Signals(sig.caught).name}"
                        break
                    loss = tr.step(step, fetch.next(), tier.grad_accum)
                    step += 1
                    tokens_done += tokens_per_step
                    if pending is not None and not _report(
                        log, live, *pending, tokens_done, t_run0, last_eval, gbs
                    ):
                        reason = f"non-finite train_loss at step {pending[0]}"
                        break
                    pending = (step, loss)
                    if step % every == 0 or step == stop_after:
                        if not _report(log, live, *pending, tokens_done, t_run0, last_eval, gbs):
                            reason = f"non-finite train_loss at step {step}"
                            break
                        pending = None
                        samples = step * gbs
                        log.end("block_stop", metadata={"samples_count": samples})
                        log.start("eval_start", metadata={"samples_count": samples})
                        last_eval = evaluate(tr.model)
                        log.event("eval_accuracy", last_eval, metadata={"samples_count": samples})
                        log.end("eval_stop", metadata={"samples_count": samples})
                        live.print(
                            f"eval at {samples:,} samples (step {step}): {last_eval:.4f}  target {tier.target}"
                            f"  [{time.monotonic() - t_run0:.1f} s]"
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
            stopped = True
            log.end("run_stop", metadata={"status": status, "samples_count": step * gbs})
    except BaseException as e:
        if not stopped:
            reason = reason or f"{type(e).__name__}: {e}"
            log.end(
                "run_stop", metadata={"status": "aborted", "samples_count": step * tier.global_batch_size}
            )
        raise
    finally:
        live.close()
        log.close()
    seconds = time.monotonic() - (t_run0 or time.monotonic())
    code = 0 if status == "success" else (128 + sig.caught if sig.caught else EXIT_ABORTED)
    return RunResult(
        status, reason, log.path, step, step * tier.global_batch_size, last_eval, seconds,
        tokens_done / max(seconds, 1e-9), code,
    )  # fmt: skip


def _report(log, live, step, loss_t, tokens_done, t0, last_eval, gbs) -> bool:
    loss = loss_t.item()
    log.event("train_loss", loss, metadata={"step_num": step, "samples_count": step * gbs})
    rate = tokens_done / max(time.monotonic() - t0, 1e-9)
    ev = f"{last_eval:.4f}" if last_eval is not None else "-"
    live.update(f"step {step}  samples {step * gbs:,}  loss {loss:.4f}  {rate:,.0f} tok/s  last eval {ev}")
    return math.isfinite(loss)
