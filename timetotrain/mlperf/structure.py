"""ttt's own checks of a result log's structure, judged beside the official compliance engine's verdict.

The engine passes logs no submitter would send: it compares only the values of the keys its rule files
mark EXACTLY_ONE, so a second `run_start` or a second `run_stop` with another status (both have the value
null) is a warning, a repeated `seed` (AT_LEAST_ONE) is nothing, and it never reads the status. Here:
each lifecycle key exactly once, each configuration key with one value, a status the rules know, and the
status the evals imply (success iff the last eval is the first to meet the target). Every finding names
its line, 1-based, as an editor counts them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from timetotrain import fileio
from timetotrain.errors import UserError
from timetotrain.spec import official, registry

TOKEN = ":::MLLOG "
# The key a run stopped by a signal logs before run_stop (train/loop.py), with the signal's name. Here, not
# in mlperf/logger.py: that module loads mlperf_logging and numpy (whose BLAS starts threads), and the CLI
# imports this one before it blocks SIGTERM/SIGINT for the abort watcher (train/abort.py).
STOP_SIGNAL_KEY = "ttt_stop_signal"

# Keys a log holds exactly once, and why a second is wrong.
ONCE = {
    "init_stop": "a run initializes once",
    "run_start": "a result file is one run: a second run_start is a second run or another rank's copy",
    "run_stop": "a run stops once: the official tools time the first run_stop and read the last one's status",
}
# The run's configuration: logged once; a repeat (another rank's copy) must agree. Keys beginning with one
# of the prefixes count too, and for a benchmark of ours every key its hyperparameter block logs.
ONE_VALUE = frozenset(
    {
        "seed",
        "global_batch_size",
        "gradient_accumulation_steps",
        "micro_batch_size",
        "train_samples",
        "eval_samples",
        "max_sequence_length",
        "max_steps",
        "init_checkpoint_step",
        "tensor_parallelism",
        "pipeline_parallelism",
        "context_parallelism",
        "expert_parallelism",
        "config_filename",
        # what `ttt check` itself reads to choose the rules and the target
        "ttt_tier",
        "ttt_model",
        "ttt_ruleset",
        "ttt_set",
        "ttt_eval_every_samples",
    }
)
ONE_VALUE_PREFIXES = ("submission_", "opt_", "lowest_numerical_precision_")
# run_stop statuses (mlperf_logging.mllog.constants SUCCESS and ABORTED); a benchmark of ours adds the
# status its reference ends an exhausted run with (llama2_70b_lora: "fail", Task.exhausted_status).
SUCCESS = "success"
STATUSES = (SUCCESS, "aborted")


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int  # 1-based
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


@dataclass(frozen=True)
class _Record:
    line: int
    key: str
    value: object
    metadata: dict


@dataclass(frozen=True)
class Target:
    """What a run of the log must reach: `met` as the harness decides it, `text` e.g. "<= 4.8"."""

    met: Callable[[float], bool]
    text: str


def records(path: Path) -> list[_Record]:
    """The MLLOG records of a file with their line numbers, read as the official parsers read them (latin-1,
    the JSON after the last token of a line). Lines that are not records are the engine's to report."""
    out = []
    with open(path, encoding="latin-1") as f:
        lines = list(fileio.bounded_lines(f, fileio.LINE, str(path)))
    for n, line in enumerate(lines, 1):
        _, sep, payload = line.rpartition(TOKEN)
        if not sep:
            continue
        try:
            rec = json.loads(payload)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("key"), str):
            meta = rec.get("metadata")
            out.append(_Record(n, rec["key"], rec.get("value"), meta if isinstance(meta, dict) else {}))
    return out


def _first(recs: list[_Record], key: str):
    return next((r.value for r in recs if r.key == key), None)


def _our_tier(recs: list[_Record]):
    """(benchmark, tier as the run ran it) for a log of one of our benchmarks and tiers, else None. A tier
    changed with --set (`ttt_set`) is changed here the same way: its target may be another."""
    bench, tier = _first(recs, "submission_benchmark"), str(_first(recs, "ttt_tier") or "reference")
    if not isinstance(bench, str) or not registry.known(bench) or tier not in registry.get(bench).tiers:
        return None
    b = registry.get(bench)
    sets = _first(recs, "ttt_set")
    t = b.tiers[tier]
    if isinstance(sets, list) and sets and all(isinstance(s, str) for s in sets):
        # spec.benchmark imports torch, and `ttt --help` imports this module (through cli.results)
        from timetotrain.spec.benchmark import apply_overrides

        try:
            t = apply_overrides(b, t, sets)
        except UserError:
            pass  # a --set this version cannot replay: the declared tier's target
    return b, t


def _target(recs: list[_Record], ours) -> Target | None:
    """The quality target of the log's run: our tier's (`ours`, with its metric's comparison), else the
    official benchmark's; None where neither is one number."""
    if ours is not None:
        bench, tier = ours
        metric = bench.task.metric
        return Target(lambda v: metric.met(v, tier.target), f"{metric.comparison} {tier.target:g}")
    facts = official.get(str(_first(recs, "submission_benchmark")))
    if facts is None or facts.target is None:
        return None
    goal, higher = facts.target, facts.higher_is_better
    return Target(
        lambda v: math.isfinite(v) and (v >= goal if higher else v <= goal),
        f"{'>=' if higher else '<='} {goal:g}",
    )


def _statuses(ours) -> tuple[str, ...]:
    """The run_stop statuses a log may end with: STATUSES, and for a benchmark of ours its exhausted one."""
    extra = ours[0].task.exhausted_status if ours is not None else None
    return STATUSES + ((extra,) if extra not in STATUSES and extra else ())


def _one_value(key: str, ours_keys: frozenset[str]) -> bool:
    return key in ONE_VALUE or key in ours_keys or key.startswith(ONE_VALUE_PREFIXES)


def _hparam_keys(ours) -> frozenset[str]:
    return frozenset(k for k, _ in ours[0].hyperparameters(ours[1])) if ours is not None else frozenset()


def model_mismatch(keys: dict[str, object]) -> str | None:
    """For reference-tier logs, whose rule files are the official ones and identical for benchmarks that
    differ only in the model (llama31_8b, gpt_oss_20b): the `ttt_model` a log of ours carries against the
    model of the benchmark it names. Logs without the key (other harnesses') are not judged here."""
    logged = keys.get("ttt_model")
    bench, tier = str(keys.get("submission_benchmark", "")), str(keys.get("ttt_tier", "reference"))
    if logged is None or not registry.known(bench) or tier not in registry.get(bench).tiers:
        return None
    b = registry.get(bench)
    expected = b.model_key(b.tiers[tier])
    if logged == expected:
        return None
    return (
        f"ttt_model {logged} is not the {bench} {tier} model {expected}: the log names a benchmark "
        "other than the one it trained"
    )


def check_structure(path: Path) -> list[Finding]:
    """ttt's findings on the log at `path`, in line order; none means it passes ttt's checks."""
    path = Path(path)
    recs = records(path)
    found: list[tuple[int, str]] = []
    last_line = max((r.line for r in recs), default=1)
    ours = _our_tier(recs)
    hparams = _hparam_keys(ours)
    first: dict[str, _Record] = {}
    for r in recs:
        seen = first.setdefault(r.key, r)
        if seen is r:
            continue
        if r.key in ONCE:
            found.append((r.line, f"{r.key} again (first at line {seen.line}): {ONCE[r.key]}"))
        elif _one_value(r.key, hparams) and r.value != seen.value:
            found.append(
                (
                    r.line,
                    f"{r.key} {_show(r.value)} contradicts {_show(seen.value)} at line {seen.line}: a run has one {r.key}",
                )
            )
    keys = {k: r.value for k, r in first.items()}
    if str(keys.get("ttt_tier", "reference")) == "reference":  # our rule files check ttt_model themselves
        mismatch = model_mismatch(keys)
        if mismatch:
            found.append((first["ttt_model"].line, mismatch))
    for key in ONCE:
        if key not in first:
            found.append((last_line, f"no {key}: {ONCE[key]}"))
    stop = first.get("run_stop")
    if stop is not None:
        found += _status_findings(recs, stop, ours)
    return [Finding(path, line, what) for line, what in sorted(found, key=lambda f: f[0])]


def _status_findings(recs: list[_Record], stop: _Record, ours) -> list[tuple[int, str]]:
    """The status of the (first) run_stop against the evals before it: a known status, success iff the
    last eval is the first to meet the target (the run stops there)."""
    status = stop.metadata.get("status")
    known = _statuses(ours)
    if status not in known:
        return [(stop.line, f"run_stop status {_show(status)} is not one of {', '.join(known)}")]
    goal = _target(recs, ours)
    if goal is None:
        return []
    evals = [
        r
        for r in recs
        if r.line < stop.line and r.key == "eval_accuracy" and isinstance(r.value, int | float)
        and not isinstance(r.value, bool)
    ]  # fmt: skip
    met = next((r for r in evals if goal.met(r.value)), None)
    if met is None:
        if status == SUCCESS:
            last = f" (the last, line {evals[-1].line}: {evals[-1].value:g})" if evals else ""
            return [
                (stop.line, f"run_stop says success, but no eval_accuracy meets the target {goal.text}{last}")
            ]
        return []
    out = []
    later = [r for r in evals if r.line > met.line]
    if later:
        out.append(
            (
                later[0].line,
                f"eval_accuracy after the target was met at line {met.line} ({met.value:g} {goal.text}): "
                "a run stops at the first eval that meets its target",
            )
        )
    if status != SUCCESS:
        out.append(
            (
                stop.line,
                f"run_stop status {status!r}, but eval_accuracy {met.value:g} at line {met.line} meets the target "
                f"{goal.text}: the run converged, its status is success",
            )
        )
    return out


def explain_stop(path: Path) -> str | None:
    """How the run of the log at `path` ended, in a user's words, where that is why a log is no result or
    no converged one: cut before run_start, cut before run_stop (truncated, or still running), stopped
    before its first eval (the official engine then says only "Required AT_LEAST_ONE occurrence of
    'eval_accuracy'"), or stopped short of the target. None for a run that reached its target."""
    recs = records(Path(path))
    keys = {r.key: r for r in reversed(recs)}  # the first of each key
    if "run_start" not in keys:
        return (
            "the log ends before run_start: the run stopped during initialization, or the file is cut "
            "short; no clock ran, so it is no result"
        )
    stop = keys.get("run_stop")
    if stop is None:
        last = max(r.line for r in recs)
        return (
            f"the log ends without run_stop (last record at line {last}): truncated, or the run is still "
            "running (a live run's log is result_<k>.txt.partial); the official checker needs exactly one "
            "run_stop"
        )
    status = stop.metadata.get("status")
    if status == SUCCESS:
        return None
    sig = keys.get(STOP_SIGNAL_KEY)
    how = f"{status}, by {sig.value}" if sig is not None else str(status)
    samples = stop.metadata.get("samples_count")
    at = f" at {samples:,} samples" if isinstance(samples, int) and not isinstance(samples, bool) else ""
    evals = [
        r.value for r in recs
        if r.line < stop.line and r.key == "eval_accuracy" and isinstance(r.value, int | float)
        and not isinstance(r.value, bool)
    ]  # fmt: skip
    if not evals:
        return (
            f"this run stopped ({how}){at} before its first eval: no eval_accuracy, which the official "
            "checker requires at least once, so the log is no result"
        )
    goal = _target(recs, _our_tier(recs))
    best = (min if goal is None or goal.text.startswith("<") else max)(evals)
    target = f" {goal.text}" if goal is not None else ""
    return (
        f"this run stopped ({how}){at} after {len(evals)} eval{'' if len(evals) == 1 else 's'} without "
        f"reaching its target{target} (best {best:g}): not converged, which the rules' check of the last "
        "eval_accuracy fails; olympic scoring drops one such run as the slowest"
    )


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)
