"""Result logs as data: parsing `result_<k>.txt`, finding the result folders of a tree, and the official
compliance verdict of each file.

Two layouts are understood. A submission tree `ORG/results/SYSTEM/BENCH/result_*.txt` with
`ORG/systems/SYSTEM.json` (what the official result_summarizer and package_checker read), and any other
folder holding result files, e.g. `<logdir>/<benchmark>/<tier>/` as `ttt run` writes it; there the
submitter, system and benchmark come from the logs' own `submission_*` keys.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mlperf_logging.compliance_checker import mlp_compliance

from timetotrain import fileio, trees
from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import log_rules, read_log_keys
from timetotrain.mlperf.structure import check_structure, model_mismatch
from timetotrain.spec import official

TOKEN = ":::MLLOG "
_RESULT_RE = re.compile(r"^result_(.*)\.txt$")
NOT_CONVERGED = 1e9  # the official RCP checker's stand-in for a run that did not converge
SYNTHETIC = "synthetic"  # the ttt_mode `ttt synth` logs
# Per-step keys of ours whose value is a dict of figures (tasks/grpo.py: the rollouts of each step).
ROLLOUT_STATS_KEY = "ttt_rollout_stats"
STEP_KEYS = (ROLLOUT_STATS_KEY,)


@dataclass
class RunLog:
    """One result file, reduced to what scoring, RCPs, packaging and plots need."""

    path: Path
    keys: dict[str, object] = field(default_factory=dict)  # first value of each key
    # The run_start/run_stop pair the result_summarizer times (_query_run_start_stop): both are taken
    # from the lines up to the first point where each has been seen.
    run_start_ms: float | None = None
    run_stop_ms: float | None = None
    status: str | None = None  # of the last run_stop, as the RCP checker reads it
    evals: list[tuple[float, float]] = field(default_factory=list)  # (samples or epoch, metric)
    # Per-step training figures by name, each [(samples_count, value)]: `train_loss`, and each field of a
    # dict-valued per-step key of ours (STEP_KEYS: GRPO's `ttt_rollout_stats` gives `reward`, ...).
    steps: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # samples/epoch of the last eval line before the last run_stop, when that run_stop says success
    converge_point: float | None = None
    # The batch size as the RCP checker (and the summarizer's GBS column) reads it: the value of the
    # last line whose record names global_batch_size.
    batch_size: object = None
    seed_lines: list[tuple[str, int, object]] = field(default_factory=list)  # (file, lineno, seed)
    parse_errors: int = 0
    records: int = 0  # MLLOG lines read; none means the file is not an MLPerf log at all
    run_starts: int = 0  # more than one: per-rank copies, or two runs' logs in one file
    starts_after_stop: int = 0  # run_start lines after a run_stop: a second run in this file

    @property
    def benchmark(self) -> str:
        return str(self.keys.get("submission_benchmark", ""))

    @property
    def tier(self) -> str:
        return str(self.keys.get("ttt_tier", "reference"))

    @property
    def division(self) -> str:
        return str(self.keys.get("submission_division", ""))

    @property
    def seed(self):
        return self.keys.get("seed")

    @property
    def global_batch_size(self):
        return self.batch_size

    @property
    def minutes(self) -> float | None:
        """run_start -> run_stop in minutes, computed exactly as the result_summarizer does."""
        if self.run_start_ms is None or self.run_stop_ms is None:
            return None
        return (self.run_stop_ms - self.run_start_ms) / 60 / 1000

    @property
    def synthetic(self) -> bool:
        """A `ttt synth` log: a throughput run on random data, never a result (no eval, no target)."""
        return self.keys.get("ttt_mode") == SYNTHETIC

    @property
    def converged(self) -> bool:
        return self.status == "success"

    @property
    def samples_to_converge(self) -> float:
        """The RCP checker's convergence value: NOT_CONVERGED unless run_stop says success."""
        if not self.converged or self.converge_point is None:
            return NOT_CONVERGED
        return self.converge_point


def parse_log(path: Path) -> RunLog:
    """Read a result file the way the official parsers do: latin-1, any line containing the MLLOG token,
    the JSON after its last occurrence (their `.*:::MLLOG ` regex is greedy, so a rank prefix, or a
    record another rank printed on the same line, is dropped). Which lines count for the time, the
    status, the convergence point and the batch size follows the result_summarizer and the RCP
    checker line for line, so a log that logs a key more than once reads as they read it."""
    log = RunLog(Path(path))
    bench = None
    last_point = None
    timed = False
    try:
        text = fileio.read_bounded(path, fileio.LARGE_FILE, "result log").decode("latin-1")
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror}): check the path and permissions") from e
    # Split on newlines only, as the official readers iterate a file (str.splitlines would also split
    # on \x85 and other separators that latin-1 text can hold).
    for line in text.split("\n"):
        _, sep, payload = line.rpartition(TOKEN)
        if not sep:
            continue
        try:
            rec = json.loads(payload)
            key, value, meta = rec["key"], rec.get("value"), rec.get("metadata")
            t = float(rec["time_ms"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            log.parse_errors += 1
            continue
        log.records += 1
        meta = meta if isinstance(meta, dict) else {}
        log.keys.setdefault(key, value)
        if not timed:  # result_summarizer._query_run_start_stop: the latest of each until both are seen
            if key == "run_start":
                log.run_start_ms = t
            elif key == "run_stop":
                log.run_stop_ms = t
            timed = log.run_start_ms is not None and log.run_stop_ms is not None
        # rcp_checker.read_submission_file finds these by substring anywhere in the record, in this order.
        if "global_batch_size" in payload:
            log.batch_size = value
        if "submission_benchmark" in payload:
            bench = value if isinstance(value, str) else None
        if "eval_accuracy" in payload or "eval_error" in payload:
            point = _eval_point(bench, meta)
            if point is not None:
                last_point = point
                if key in ("eval_accuracy", "eval_error") and isinstance(value, int | float):
                    log.evals.append((point, float(value)))
        if key == "train_loss" or key in STEP_KEYS:
            _step_figures(log.steps, key, value, meta)
        if key == "seed":
            log.seed_lines.append((meta.get("file"), meta.get("lineno"), value))
        elif key == "run_start":
            log.run_starts += 1
            log.starts_after_stop += log.run_stop_ms is not None
        elif key == "run_stop":  # the last one decides, as in the RCP checker
            log.status = meta.get("status")
            log.converge_point = last_point if log.status == "success" else None
    return log


def _step_figures(steps: dict, key: str, value, meta: dict) -> None:
    """A per-step line's numbers, at its `samples_count`; a line without one, or a value that is not a
    finite number (a log is untrusted), adds nothing."""
    at = meta.get("samples_count")
    fields = {key: value} if key == "train_loss" else value if isinstance(value, dict) else {}
    for name, v in fields.items():
        if isinstance(name, str) and _finite(v) and _finite(at):
            steps.setdefault(name, []).append((float(at), float(v)))


def _finite(v) -> bool:
    try:
        return _is_number(v) and math.isfinite(v)
    except OverflowError:  # an integer beyond any float
        return False


def _eval_point(bench, meta: dict):
    """The convergence point of an eval line, in the unit the official RCP checker counts for this
    benchmark: samples_count, or epoch_num rounded to 3 decimals (as the official RCP checker reads them). Benchmarks the official
    tools do not know use epoch_num when the line has one."""
    if official.eval_unit(bench) == official.SAMPLES or "epoch_num" not in meta:
        point = meta.get("samples_count")
        return point if _is_number(point) else None
    epoch = meta["epoch_num"]
    return round(epoch, 3) if _is_number(epoch) else None


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def result_files(folder: Path) -> list[Path]:
    """`result_*.txt` (the official glob), ordered by their run index where it is a number."""

    def order(p: Path):
        idx = _RESULT_RE.match(p.name).group(1)
        return (0, int(idx), "") if idx.isdigit() else (1, 0, idx)

    return sorted((p for p in folder.glob("result_*.txt") if p.is_file()), key=order)


@dataclass
class ResultGroup:
    """The result files of one system x benchmark (one tier), and where its context comes from."""

    folder: Path
    files: list[Path]
    logs: list[RunLog]
    submitter: str
    system: str
    benchmark: str
    tier: str
    division: str
    system_json: Path | None  # set for the submission layout
    foreign: list[Path] = field(default_factory=list)  # result_*.txt without MLLOG lines: not in `logs`
    synthetic: list[Path] = field(default_factory=list)  # `ttt synth` logs: not in `logs` either

    @property
    def layout(self) -> str:
        return "submission" if self.system_json else "folder"


@dataclass
class LogProblem:
    """A result file that will not pass as a result, found before the official tools read it (their
    reports name the rule, not the cause, and some end in a traceback)."""

    path: Path
    what: str
    misplaced: bool  # the file does not belong to its folder's benchmark at all

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def log_problems(groups: list[ResultGroup]) -> list[LogProblem]:
    """Files that are not MLPerf logs, another benchmark's log in a folder, two runs in one file, logs cut
    short (no run_stop, or lines that are not JSON), and, for a file with none of these, the first of the
    findings of ttt's own checks (mlperf/structure.py) that make `ttt check` fail it."""
    out = []
    for g in groups:
        for p in g.foreign:
            out.append(LogProblem(p, "holds no :::MLLOG lines: not an MLPerf result log; move it away", True))
        for lg in g.logs:
            if lg.benchmark != g.benchmark:
                named = repr(lg.benchmark) if lg.benchmark else "no submission_benchmark"
                out.append(
                    LogProblem(
                        lg.path,
                        f"names {named}, but {g.folder} holds {g.benchmark} logs: one folder per benchmark",
                        True,
                    )
                )
            if lg.run_starts > 1:
                why = (
                    "one after a run_stop: two runs in one file; one result file is one run"
                    if lg.starts_after_stop
                    else "before its run_stop (one per rank?): the official checker accepts repeats whose "
                    "values agree"
                )
                out.append(LogProblem(lg.path, f"logs run_start {lg.run_starts} times, {why}", False))
            if lg.run_stop_ms is None:
                out.append(
                    LogProblem(
                        lg.path,
                        "has no run_stop: the log is truncated (a live or killed run is result_<k>.txt.partial)",
                        False,
                    )
                )
            elif lg.parse_errors:
                out.append(
                    LogProblem(
                        lg.path, f"{lg.parse_errors} :::MLLOG line(s) are not valid JSON: damaged", False
                    )
                )
            if not any(p.path == lg.path for p in out):  # else that problem is the cause
                findings = check_structure(lg.path)
                if findings:
                    more = (
                        f" (and {len(findings) - 1} more: `ttt check` lists them)"
                        if len(findings) > 1
                        else ""
                    )
                    first = findings[0]
                    out.append(
                        LogProblem(
                            lg.path, f"fails ttt's checks: line {first.line}: {first.what}{more}", False
                        )
                    )
    return out


def find_groups(root: Path, with_foreign: bool = False) -> list[ResultGroup]:
    """Every folder under `root` (itself included) that directly holds result logs; `with_foreign` adds
    the folders whose result_*.txt are none of them MLPerf logs (for log_problems)."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(
            f"{root} is not a directory: pass a folder of result_<k>.txt files or a submission tree"
        )
    files = [p for p in root.rglob("result_*.txt") if p.is_file()]
    for p in files:  # a symlink to a log elsewhere would be counted, scored and packaged as this tree's
        trees.check_inside(p, root, "copy the log into the tree if it belongs there")
    folders = sorted({p.parent for p in files})
    found = [_group(f) for f in folders]
    groups = [g for g in found if g.logs]
    synthetic = [p for g in found for p in g.synthetic]
    if not groups and synthetic:
        raise UserError(
            f"only `ttt synth` logs under {root} ({synthetic[0]}"
            + (f" and {len(synthetic) - 1} more" if len(synthetic) > 1 else "")
            + "): throughput runs, not results; pass the --logdir of `ttt run` "
            "(`ttt report DIR --html` shows synth summaries)"
        )
    if not groups and found:
        foreign = [p for g in found for p in g.foreign]
        raise UserError(
            f"no MLPerf result logs under {root}: {foreign[0]}"
            + (f" and {len(foreign) - 1} other result_*.txt hold" if len(foreign) > 1 else " holds")
            + " no :::MLLOG lines"
        )
    if with_foreign:
        groups = [g for g in found if g.logs or g.foreign]
    if not groups:
        partial = unfinished_logs(root)
        also = f" (only {len(partial)} unfinished result_*.txt.partial)" if partial else ""
        raise UserError(
            f"no result_*.txt files under {root}{also}: pass the --logdir of `ttt run` or an ORG/results/... tree"
        )
    return groups


def unfinished_logs(root: Path) -> list[Path]:
    """Logs of runs that never wrote run_stop (killed, or still running): `result_<k>.txt.partial`. The
    result glob `result_*.txt` does not match them, so no score, RCP check or package ever uses one."""
    return sorted(p for p in Path(root).rglob("result_*.txt.partial") if p.is_file())


def synthetic_logs(root: Path) -> list[Path]:
    """The `ttt synth` logs among the result files under root, which every reader of results skips: a
    synth run logs no eval and meets no target, so scored it would only read as a failed run. Only files
    that name `ttt_mode` are parsed, so a large tree of other logs costs one read per file."""
    out = []
    for p in sorted(Path(root).rglob("result_*.txt")):
        trees.check_inside(p, root, "copy the log into the tree if it belongs there")
        try:
            named = p.is_file() and b'"ttt_mode"' in fileio.read_bounded(p, fileio.LARGE_FILE, "result log")
        except OSError:
            continue  # find_groups reports an unreadable file itself
        if named and parse_log(p).synthetic:
            out.append(p)
    return out


def synthetic_note(root: Path) -> str | None:
    """One line for the commands that read a tree of results, naming the `ttt synth` logs they skipped."""
    found = synthetic_logs(root)
    if not found:
        return None
    return (
        f"note: skipped {_count(len(found), '`ttt synth` log')} (throughput on random data, not results; "
        f"`ttt report DIR --html` shows their summaries): {_shown(found)}"
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _shown(paths: list[Path]) -> str:
    return ", ".join(str(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def unfinished_note(root: Path) -> str | None:
    """One line for the commands that read a tree of results, naming the `.partial` logs they skipped."""
    partial = unfinished_logs(root)
    if not partial:
        return None
    return (
        f"note: skipped {len(partial)} unfinished run log(s), not results (no run_stop: the run was killed "
        f"or is still running): {_shown(partial)}"
    )


# A folder naming an MLPerf Training round: mlperf_results_v5.1, training_results_v5.0, v6.0.
_ROUND_RE = re.compile(r"(?:^|[_-])v(\d+)\.(\d+)$")


def ruleset_note(path: Path, ruleset: str) -> str | None:
    """One line where a log checked against `ruleset` says it belongs to another: the `ttt_ruleset` ttt
    logs, or (official logs state none) a folder above it that names an MLPerf round."""
    stated = parse_log(path).keys.get("ttt_ruleset")
    if stated is not None:
        if str(stated) == ruleset:
            return None
        return f"{path} was written for ruleset {stated} (its ttt_ruleset), checked against {ruleset}"
    for folder in Path(path).resolve().parents:
        m = _ROUND_RE.search(folder.name)
        if m is None:
            continue
        round_ = f"{m.group(1)}.{m.group(2)}"
        if ruleset.startswith(round_ + "."):
            return None
        return (
            f"{path} lies under {folder.name}, a folder naming MLPerf Training v{round_}, and is checked "
            f"against ruleset {ruleset}: pass --ruleset {round_}.0 for that round's rules"
        )
    return None


def _group(folder: Path) -> ResultGroup:
    """The group of one folder. Files without any MLLOG line are set aside in `foreign`: a stray text
    file is not a failed run. The benchmark is the one most of the logs name, so that one misfiled log
    is the one reported (log_problems), not its neighbours."""
    parsed = [parse_log(f) for f in result_files(folder)]
    logs = [lg for lg in parsed if lg.records and not lg.synthetic]
    foreign = [lg.path for lg in parsed if not lg.records]
    synthetic = [lg.path for lg in parsed if lg.synthetic]
    if not logs:
        return ResultGroup(folder, [], [], "", "", "", "", "", None, foreign, synthetic)
    named = Counter(lg.benchmark for lg in logs if lg.benchmark).most_common(1)
    first = next((lg for lg in logs if named and lg.benchmark == named[0][0]), logs[0])
    tiers = sorted({lg.tier for lg in logs})
    sysjson = None
    if folder.parent.parent.name == "results":
        cand = folder.parents[2] / "systems" / f"{folder.parent.name}.json"
        sysjson = cand if cand.is_file() else None
    if sysjson is not None:
        desc = _read_json(sysjson)
        submitter = str(desc.get("submitter", folder.parents[2].name))
        division = str(desc.get("division", first.division))
        system, benchmark = folder.parent.name, folder.name
    else:
        submitter = str(first.keys.get("submission_org", ""))
        system = str(first.keys.get("submission_platform", ""))
        division = first.division
        benchmark = first.benchmark or folder.name
    files = [lg.path for lg in logs]
    return ResultGroup(
        folder,
        files,
        logs,
        submitter,
        system,
        benchmark,
        "+".join(tiers),
        division,
        sysjson,
        foreign,
        synthetic,
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(fileio.read_bounded(path, fileio.SMALL_FILE, "JSON file").decode())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not readable JSON ({e}): fix or remove the file") from e


@contextlib.contextmanager
def captured_logging():
    """The official checkers report through the root logger; collect their lines instead of printing."""
    lines: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers = [_Collect()]
    root.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)


class _ParsedRules:
    """Stands in for the `yaml` module inside the compliance engine while it checks a log: the engine
    re-parses its rule files (pure-Python YAML, most of its time) for every log it checks, though they
    do not change within a run. Each file is parsed once per content (path and mtime); every check gets
    its own deep copy, so no check can see another's data. Anything else is the real module."""

    _cache: dict[tuple, object] = {}

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def load(self, stream, Loader):  # noqa: N803 (the engine's keyword)
        name = getattr(stream, "name", None)
        if not isinstance(name, str):
            return self._real.load(stream, Loader=Loader)
        key = (os.path.abspath(name), os.stat(name).st_mtime_ns, Loader)
        if key not in self._cache:
            self._cache[key] = self._real.load(stream, Loader=Loader)
        return copy.deepcopy(self._cache[key])


@contextlib.contextmanager
def _rules_parsed_once(mlp_compliance):
    real = mlp_compliance.yaml
    mlp_compliance.yaml = _ParsedRules(real)
    try:
        yield
    finally:
        mlp_compliance.yaml = real


def official_compliance(path: Path, ruleset: str) -> tuple[bool, str]:
    """The official compliance engine, in process, with the rule file `ttt check` would use: the
    ruleset's common.yaml for reference logs (as the result_summarizer does), ours for other tiers."""
    keys = read_log_keys(path)
    rules = log_rules(path, keys, ruleset)
    config = str(rules) if rules is not None else f"training_{ruleset}/common.yaml"
    # The engine queues rule files in a module-level list; a check that raised would leave files queued
    # for the next one.
    mlp_compliance.enqueued_configs.clear()
    checker = mlp_compliance.make_checker("training", ruleset, quiet=False, werror=False)
    with captured_logging() as lines, _rules_parsed_once(mlp_compliance):
        try:
            valid, *_ = mlp_compliance.main(str(path), config, checker)
        except Exception as e:  # the engine evaluates rule code; a crash is a failed check, as in its CLI
            valid = False
            lines.append(f"compliance engine error: {type(e).__name__}: {e}")
        finally:
            mlp_compliance.enqueued_configs.clear()
    problems = [
        ln.strip() for ln in lines if not ln.lstrip().startswith(("Running compliance", "Compliance checks"))
    ]
    mismatch = model_mismatch(keys) if rules is None else None  # ttt's check of reference logs (`ttt check`)
    if mismatch:
        valid = False
        problems.append(mismatch)
    return bool(valid), "\n".join(problems)
