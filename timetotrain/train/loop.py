"""The timed run with MLPerf semantics (DESIGN.md "The timed run"; spec §2.6, §3.5).

preflight (no log line yet) -> cache_clear, init_start, submission keys, seed, hyperparameters, model build
and warm-up, init_stop -> run_start (clock on; first dataset access after this) -> blocks of training with
an eval at every eval point -> run_stop success at the first eval <= target, else aborted and exit != 0.
"""

from __future__ import annotations

import math
import os
import platform
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
from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir, rule_file
from timetotrain.mlperf.logger import ResultLog, check_writable
from timetotrain.progress import LiveLine
from timetotrain.suite.base import Benchmark, Tier, apply_overrides
from timetotrain.train.optim import build_adamw, set_lr
from timetotrain.train.schedule import WarmupCosine

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


def hyperparameters(bench: Benchmark, tier: Tier) -> list[tuple[str, object]]:
    """The hyperparameter block of the log, in log order (the rules' POST/CHECK order depends on it)."""
    hp = [
        ("global_batch_size", tier.global_batch_size),
        ("gradient_accumulation_steps", tier.grad_accum),
        ("micro_batch_size", tier.micro_batch_size),
        ("max_sequence_length", tier.seq_len),
        ("max_steps", tier.max_steps),
        ("opt_base_learning_rate", tier.lr),
        ("opt_end_learning_rate", tier.end_lr),
        ("opt_learning_rate_warmup_steps", tier.warmup_steps),
        ("opt_learning_rate_decay_steps", tier.decay_steps),
    ]
    hp += list(bench.fixed_hparams.items())
    hp += [("train_samples", tier.max_steps * tier.global_batch_size), ("eval_samples", tier.eval_samples)]
    return hp


def submission_keys(bench: Benchmark, tier: Tier, org: str, plat: str) -> list[tuple[str, object]]:
    return [
        ("submission_benchmark", bench.name),
        ("submission_org", org),
        ("submission_division", tier.division),
        ("submission_status", "onprem"),
        ("submission_platform", plat),
    ]


def check_rules(bench: Benchmark, tier: Tier) -> None:
    """Refuse, before any log line, a configuration the rule file of its division would reject."""
    if tier.name == "reference":
        if tier.division != "closed":
            return
        files = [official_rules_dir() / f for f in bench.closed_rules]
    else:
        files = [rule_file(bench.name, tier.name)]
    logged = submission_keys(bench, tier, "x", "x") + hyperparameters(bench, tier)
    problems = hparam_violations(files, logged)
    if problems:
        hint = " (or --set division=open)" if tier.name == "reference" else ""
        raise UserError(f"{bench.name} {tier.name}: {problems[0]}: change the --set value{hint}")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def platform_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"1x{torch.cuda.get_device_name(device)}"
    return f"{os.cpu_count()}-core {_cpu_model()}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def train_step(model, opt, tokens: torch.Tensor, accum: int, clip: float, params) -> torch.Tensor:
    """One optimizer step over a local batch split into `accum` equal micro-batches. Returns the mean loss
    as a device tensor: no host sync here."""
    total = torch.zeros((), device=tokens.device)
    for mb in tokens.chunk(accum):
        logits = model(mb[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten()) / accum
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def _warmup(model, tier: Tier, device, vocab: int) -> None:
    """Touch every kernel once before the clock (allocator, kernel selection); weights are re-initialized
    afterwards, so nothing learned here survives."""
    mb = min(tier.micro_batch_size, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (mb, tier.seq_len + 1), generator=g).to(device)
    logits = model(x[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)


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
            # Built on the meta device and materialised where it runs: an 8B model never exists on the host.
            with torch.device("meta"):
                model = bench.build_model(tier)
            model.to_empty(device=device)
            bench.init_model(model, torch.Generator(device=device).manual_seed(seed + 1))
            _warmup(model, tier, device, tier.model.vocab_size)
            bench.init_model(model, torch.Generator(device=device).manual_seed(seed))
            model.train()
            fx = bench.fixed_hparams
            opt = build_adamw(
                model, tier.lr, (fx["opt_adamw_beta_1"], fx["opt_adamw_beta_2"]),
                fx["opt_adamw_epsilon"], fx["opt_adamw_weight_decay"],
            )  # fmt: skip
            sched = WarmupCosine(tier.lr, tier.end_lr, tier.warmup_steps, tier.max_steps, bench.schedule_rule)
            params = [p for p in model.parameters() if p.requires_grad]
            clip = fx["opt_gradient_clip_norm"]
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
                    set_lr(opt, sched(step))
                    loss = train_step(model, opt, fetch.next(), tier.grad_accum, clip, params)
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
                        last_eval = evaluate(model)
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
