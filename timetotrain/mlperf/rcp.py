"""Reference convergence points (RCPs): is a set of runs converging as fast as the reference may?

Reference tiers are judged by the official `mlperf_logging.rcp_checker` against its own JSON files.
Other tiers (e.g. `tiny`) are judged by the same algorithm (docs/submission.md, "RCP verdicts"), implemented here, against an RCP
JSON in the official format shipped at `timetotrain/suite/rcps/<bench>_<tier>.json`; `build_rcp_json`
writes such a record from converged result logs of the tier.

The algorithm, per record: the RCP mean is the olympic mean of its convergence list, the stdev the
population stdev of the whole list, and the minimum acceptable submission mean the smallest mean a
one-sided equal-variance t-test cannot tell apart from the RCP mean at alpha 0.05 (bisection). Records
are pruned so that convergence never gets faster with a larger batch; a submission at a batch size
between two records is compared with their linear interpolation.
"""

from __future__ import annotations

import datetime
import json
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scipy.stats
from mlperf_logging.rcp_checker import rcp_checker

from timetotrain import __version__, fileio
from timetotrain.errors import UserError
from timetotrain.mlperf.results import NOT_CONVERGED, RunLog, captured_logging, parse_log
from timetotrain.spec import official

ALPHA = 0.05
TOLERANCE = 1e-4  # bisection stops below this width, in the benchmark's own unit (samples or epochs)
_RCP_DIR = Path(__file__).parents[1] / "suite" / "rcps"


def rcp_path(benchmark: str, tier: str) -> Path:
    return _RCP_DIR / f"{benchmark}_{tier}.json"


def official_rcp_path(benchmark: str, ruleset: str) -> Path:
    return Path(rcp_checker.__file__).parent / f"training_{ruleset}" / f"rcps_{benchmark}.json"


def olympic_mean(values, drop: int = 1) -> float:
    s = sorted(values)
    if len(s) <= 2 * drop:  # nothing left to average: NaN, as np.mean gives, without its RuntimeWarning
        return math.nan
    return float(np.mean(s[drop : len(s) - drop]))


def _one_sided_p(m: float, ref_mean: float, stdev: float, n_m: int, n_ref: int) -> float:
    """p that mean m is not below ref_mean (two-sided scipy p turned one-sided)."""
    t, p = scipy.stats.ttest_ind_from_stats(m, stdev, n_m, ref_mean, stdev, n_ref, equal_var=True)
    return p / 2 if t < 0 else 1 - p / 2


def min_acceptable_mean(mean: float, stdev: float, n_ref: int, n_subm: int) -> float:
    """Bisection on [0, mean] for the lowest submission mean that still passes the t-test.

    The sample-size arguments are passed in the order the official checker passes them: the candidate
    mean is paired with `n_ref` and the RCP mean with `n_subm` (see rcp_checker._find_min_acceptable_mean).
    """
    if stdev == 0:
        return mean
    lo, hi = 0.0, mean
    mid = (lo + hi) / 2
    while hi - lo > TOLERANCE:
        if _one_sided_p(mid, mean, stdev, n_ref, n_subm) > ALPHA:
            hi = mid
        else:
            lo = mid
        mid = (lo + hi) / 2
    return mid


@dataclass
class Record:
    name: str
    benchmark: str
    bs: int
    mean: float
    stdev: float
    min_mean: float  # minimum acceptable submission mean
    n: int = 0  # convergence points behind it (0 for an interpolated record)


class RcpTable:
    """The records of one benchmark (one tier), their statistics and the pruned set used for checks."""

    def __init__(self, raw: dict, benchmark: str, runs: int, source: str = ""):
        self.benchmark, self.runs, self.source = benchmark, runs, source
        recs = []
        for name, r in raw.items():
            key = official.converge_key(r["Benchmark"])
            if key not in r:
                raise UserError(f"{source}: RCP record {name!r} has no {key!r} list: fix the RCP file")
            points = sorted(r[key])
            if len(points) < 3:
                raise UserError(f"{source}: RCP record {name!r} needs at least 3 convergence points")
            mean = olympic_mean(points)
            stdev = float(np.std(points))
            recs.append(
                Record(
                    name,
                    r["Benchmark"],
                    r["BS"],
                    mean,
                    stdev,
                    self._min_mean(mean, stdev, len(points) - 2),
                    len(points),
                )
            )
        self.records = sorted(recs, key=lambda r: r.bs)
        self.pruned = self._prune(self.records)

    @classmethod
    def load(cls, path: Path, benchmark: str, runs: int) -> RcpTable:
        try:
            raw = json.loads(fileio.read_bounded(path, fileio.SMALL_FILE, "RCP file").decode())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read RCP file {path} ({e}): rebuild it with build_rcp_json") from e
        return cls(raw, benchmark, runs, str(path))

    def _min_mean(self, mean: float, stdev: float, n_ref: int) -> float:
        return min_acceptable_mean(mean, stdev, n_ref, self.runs - 2)

    def interpolate(self, bs: int, lo: Record, hi: Record) -> Record:
        mean = float(np.interp(bs, [lo.bs, hi.bs], [lo.mean, hi.mean]))
        stdev = float(np.interp(bs, [lo.bs, hi.bs], [lo.stdev, hi.stdev]))
        # An interpolated record stands for 2N reference runs (the RCP policy's minimum per batch size).
        return Record(
            f"{self.benchmark}_interp_{bs}",
            self.benchmark,
            bs,
            mean,
            stdev,
            self._min_mean(mean, stdev, 2 * self.runs),
        )

    def _prune(self, recs: list[Record]) -> list[Record]:
        if not recs:
            return []
        fastest = min(recs, key=lambda r: r.mean)
        kept = [r for r in recs if r.bs >= fastest.bs]
        i = 1
        while i < len(kept) - 1:
            between = float(
                np.interp(kept[i].bs, [kept[i - 1].bs, kept[i + 1].bs], [kept[i - 1].mean, kept[i + 1].mean])
            )
            if kept[i].mean > between:
                del kept[i]  # and look at the new neighbour at the same index
            else:
                i += 1
        return kept

    def lookup(self, bs: int) -> tuple[str, Record | None]:
        """(how, record): how is 'found', 'interpolated', 'smaller-bs' (only larger-BS records exist),
        'above' (only smaller-BS records) or 'none'."""
        exact = [r for r in self.pruned if r.bs == bs]
        if exact:
            return "found", exact[0]
        below = [r for r in self.pruned if r.bs < bs]
        above = [r for r in self.pruned if r.bs > bs]
        if below and above:
            return "interpolated", self.interpolate(bs, below[-1], above[0])
        if above:
            return "smaller-bs", self.pruned[0]
        if below:
            return "above", None
        return "none", None


# The olympic mean of the runs' convergence points drops the fastest and the slowest: it needs 3 runs. With
# fewer, the official rcp_checker's mean is NaN and its verdict Fail; ours says what is true instead.
MIN_RUNS = 3
NOT_ENOUGH_RUNS = "Not enough runs"


@dataclass
class RcpResult:
    """The RCP verdict for one set of runs. verdict uses the result_summarizer's words: Pass, Fail,
    Interp. Fail, Missing, No RCP; or Fail when the runs themselves cannot be compared; or NOT_ENOUGH_RUNS
    where an RCP exists but fewer than MIN_RUNS runs have no mean to compare with it (`runs` says how many).
    `text()` and `kind` are the one wording and the one colour class every table, plot and page uses."""

    verdict: str
    message: str
    interpolated: bool = False
    bs: int | None = None
    rcp_mean: float | None = None
    rcp_min: float | None = None
    rcp_stdev: float | None = None
    submission_mean: float | None = None
    norm_factor: float = 1.0
    source: str = ""
    unit: str = official.SAMPLES  # of the means: samples, or epochs (rgat and other epoch-counted benchmarks)
    runs: int | None = None  # the runs compared (their convergence points), where they could be read

    @property
    def passed(self) -> bool:
        return self.verdict == "Pass"

    def text(self, short: bool = False) -> str:
        """The verdict as every output words it: "not enough runs (1 of >= 3)", never a Fail of a NaN."""
        if self.verdict == NOT_ENOUGH_RUNS:
            return f"not enough runs ({self.runs} of >= {MIN_RUNS})"
        if self.interpolated and self.verdict == "Pass":
            return "Pass (interp.)" if short else "Pass (interpolated)"
        return self.verdict

    @property
    def kind(self) -> str:
        """pass, fail, or pending (not enough runs yet: neither), for the colour of the verdict."""
        if self.verdict == NOT_ENOUGH_RUNS:
            return "pending"
        return "pass" if self.passed else "fail"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["text"] = self.text()
        if self.verdict == NOT_ENOUGH_RUNS:
            d["submission_mean_reason"] = (
                f"{self.runs} {'run' if self.runs == 1 else 'runs'}: an olympic mean needs at least {MIN_RUNS}"
            )
        return d


def submission_points(logs: list[RunLog]) -> tuple[int | None, list[float] | None, str]:
    """(bs, convergence points, problem) with the official rules: all runs must agree on the batch size;
    a run that did not converge counts as NOT_CONVERGED; more than one such run is not comparable."""
    # A list, not a set: the checker takes the value of any line naming global_batch_size, which need
    # not be hashable.
    sizes = [lg.global_batch_size for lg in logs]
    if not sizes or any(not isinstance(s, int | float) or isinstance(s, bool) for s in sizes):
        return None, None, "Could not detect global_batch_size"
    if any(s != sizes[0] for s in sizes):
        return None, None, "Batch sizes in files do not match"
    bs = int(sizes[0])
    points = [lg.samples_to_converge for lg in logs]
    if sum(p == NOT_CONVERGED for p in points) > 1:
        return bs, None, "Insufficient convergence"
    return bs, points, ""


def _judge(table: RcpTable, bs: int, points: list[float], allowance: float = 0.0) -> RcpResult:
    how, rec = table.lookup(bs)
    if rec is None:
        msg = "Cannot find any RCPs" if how == "none" else f"Missing RCP, please submit RCP with BS = {bs}"
        return RcpResult("No RCP" if how == "none" else "Missing", msg, bs=bs, source=table.source)
    if len(points) < MIN_RUNS:
        threshold = rec.mean / (rec.mean / (rec.min_mean - allowance))
        return RcpResult(
            NOT_ENOUGH_RUNS, _not_enough(len(points)), how == "interpolated", bs, rec.mean, threshold,
            rec.stdev, None, 1.0, table.source, official.eval_unit(table.benchmark), len(points),
        )  # fmt: skip
    mean = olympic_mean(points)
    # Compared as RCP mean / max speedup, the official expression, so a run on the boundary gets the
    # official verdict to the last bit.
    threshold = rec.mean / (rec.mean / (rec.min_mean - allowance))
    ok = mean >= threshold
    norm = max(1.0, rec.mean / mean)
    if how == "found":
        verdict, msg = ("Pass" if ok else "Fail"), "RCP found"
    elif how == "interpolated":
        verdict, msg = ("Pass" if ok else "Interp. Fail"), "RCP Interpolation"
    elif ok:
        verdict, msg = "Pass", "RCP not found but slower convergence on smaller batch size"
    else:
        verdict, msg = "Missing", f"Missing RCP, please submit RCP with BS = {bs}"
    return RcpResult(
        verdict,
        msg,
        how == "interpolated",
        bs,
        rec.mean,
        threshold,
        rec.stdev,
        mean,
        norm,
        table.source,
        official.eval_unit(table.benchmark),
        len(points),
    )


def _not_enough(n: int) -> str:
    # Not "Fail", which the official rcp_checker says of the NaN mean: more runs may well pass.
    return f"an RCP verdict compares the olympic mean of at least {MIN_RUNS} runs; {n} cannot have one"


def check_tier(
    benchmark: str, tier: str, logs: list[RunLog], runs: int, rcp_file: Path | None = None
) -> RcpResult:
    """Our implementation of the checker, for tiers whose RCPs this project produces."""
    path = Path(rcp_file) if rcp_file else rcp_path(benchmark, tier)
    if not path.is_file():
        return RcpResult(
            "Missing",
            f"no RCP file for {benchmark} tier {tier} ({path}); build one with `ttt rcp build`",
            source=str(path),
        )
    bs, points, problem = submission_points(logs)
    if points is None:
        return RcpResult("Fail", problem, bs=bs, source=str(path))
    return _judge(RcpTable.load(path, benchmark, runs), bs, points)


def check_reference(folder: Path, logs: list[RunLog], ruleset: str) -> RcpResult:
    """The official rcp_checker on a folder of result files (pruned RCPs, nothing written to the folder),
    with the statistics of the record it compared against."""
    benchmark = logs[0].benchmark if logs else ""
    source = f"mlperf_logging training_{ruleset}/rcps_{benchmark}.json"
    if not official_rcp_path(benchmark, ruleset).is_file():
        return RcpResult(
            "No RCP", f"the official ruleset {ruleset} has no RCPs for {benchmark!r}", source=source
        )
    # Its mean of fewer than 3 runs is NaN, with numpy's RuntimeWarning: ttt says not enough runs instead.
    with captured_logging(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            passed, msg, norm = rcp_checker.check_directory(
                str(folder), "training", ruleset, False, False, rcp_pass="pruned_rcps", set_scaling=False
            )
        except Exception as e:  # e.g. a benchmark the checker does not know, or logs it cannot read
            return RcpResult("Fail", f"rcp_checker error: {type(e).__name__}: {e}", source=source)
    if passed:
        verdict = "Pass"
    elif msg == "RCP found":
        verdict = "Fail"
    elif msg == "RCP Interpolation":
        verdict = "Interp. Fail"
    elif "Missing" in msg:
        verdict = "Missing"
    elif msg == "Cannot find any RCPs":
        verdict = "No RCP"
    else:
        verdict = "Fail"
    res = RcpResult(verdict, msg, msg == "RCP Interpolation", norm_factor=float(norm), source=source)
    res.unit = official.eval_unit(benchmark)
    bs, points, _ = submission_points(logs)
    res.bs = bs
    if points is None:
        return res
    res.runs = len(points)
    if len(points) < MIN_RUNS and verdict in ("Fail", "Interp. Fail"):  # its olympic mean was NaN
        res.verdict, res.message, res.norm_factor = NOT_ENOUGH_RUNS, _not_enough(len(points)), 1.0
    else:
        res.submission_mean = olympic_mean(points)
    rec = _official_record(benchmark, ruleset, bs, msg)
    if rec is not None:
        res.rcp_mean, res.rcp_stdev = float(rec["RCP Mean"]), float(rec["RCP Stdev"])
        low = float(rec["Min Epochs"])
        facts = official.get(benchmark)
        if facts is not None and facts.min_mean_allowance(ruleset):  # llama31_405b from 5.0.0 on
            low -= facts.min_mean_allowance(ruleset)
        res.rcp_min = res.rcp_mean / (res.rcp_mean / low)
    return res


def _official_record(benchmark: str, ruleset: str, bs: int, msg: str) -> dict | None:
    """The record the official checker compared with, read back from its own pruned table."""
    with captured_logging():
        checker = rcp_checker.RCP_Checker("training", ruleset, benchmark, False)
    pruned = sorted(checker.pruned_rcp_data.values(), key=lambda r: r["BS"])
    exact = [r for r in pruned if r["BS"] == bs]
    if exact:
        return exact[0]
    below = [r for r in pruned if r["BS"] < bs]
    above = [r for r in pruned if r["BS"] > bs]
    if below and above:
        with captured_logging():
            return checker._create_interp_rcp(bs, below[-1], above[0])[1]
    if above and "slower convergence" in msg:
        return pruned[0]
    return None


# --- building an RCP record from a tier's runs ---


# How to read an official RCP record's hyperparameter from a log where the log has no key of that name.
# Warm-up is recorded in samples for the LLM pretraining benchmarks (steps x GBS), as their official
# files do; every other name is the logged key itself.
def _warmup_samples(k: dict):
    steps = k.get("opt_learning_rate_warmup_steps")
    return None if steps is None else int(steps) * int(k["global_batch_size"])


_DERIVED = {"opt_learning_rate_warmup_samples": _warmup_samples}


def _hyperparams(benchmark: str, keys: dict) -> dict:
    """The "Hyperparams" of an RCP record: the keys the official records of this benchmark carry; for a
    benchmark without official RCPs, the optimizer keys as logged (as the flux1 and lora files do)."""
    facts = official.get(benchmark)
    if facts is not None:
        names = list(facts.rcp_hparams)
    else:
        names = sorted(k for k in keys if k.startswith("opt_")) + ["gradient_accumulation_steps"]
    out = {n: _DERIVED[n](keys) if n in _DERIVED else keys.get(n) for n in names}
    return {k: v for k, v in out.items() if v is not None}


def build_rcp_json(benchmark: str, tier: str, logs: list[RunLog | Path | str]) -> dict:
    """The official-format RCP records (one per batch size) from converged result logs of one tier.

    Every log must be of this benchmark and tier, converged (`run_stop` status success), and carry a
    distinct seed; at least 3 per batch size (the olympic mean drops two). The rules ask the reference
    for 2N points per batch size, N being the runs a submission needs.
    """
    runs = [lg if isinstance(lg, RunLog) else parse_log(Path(lg)) for lg in logs]
    if not runs:
        raise UserError(f"no result logs given for the {benchmark} {tier} RCP: run the tier first")
    by_bs: dict[int, list[RunLog]] = {}
    seeds: dict[object, Path] = {}
    for lg in runs:
        if lg.benchmark != benchmark or lg.tier != tier:
            raise UserError(
                f"{lg.path} is {lg.benchmark or '?'} tier {lg.tier}, not {benchmark} tier {tier}: leave it out"
            )
        if not lg.converged or lg.converge_point is None:
            raise UserError(
                f"{lg.path} did not converge (run_stop status {lg.status}): RCPs are built from converged runs only"
            )
        if lg.seed in seeds:
            raise UserError(
                f"{lg.path} repeats seed {lg.seed} of {seeds[lg.seed]}: every RCP run needs its own seed"
            )
        seeds[lg.seed] = lg.path
        by_bs.setdefault(int(lg.global_batch_size), []).append(lg)
    out = {}
    for bs, group in sorted(by_bs.items()):
        if len(group) < 3:
            raise UserError(f"{benchmark} {tier} BS {bs}: {len(group)} converged runs, at least 3 are needed")
        points = [_point(lg.converge_point) for lg in group]
        first = group[0].keys
        out[f"{benchmark}_{tier}_{bs}"] = {
            "Benchmark": benchmark,
            "Creator": f"timetotrain {__version__}",
            "When": f"{datetime.date.today().isoformat()}, {len(group)} runs of tier {tier}",
            "Platform": str(first.get("submission_platform", "")),
            "Precision": str(first.get("lowest_numerical_precision_in_linear", "")).upper(),
            "BS": bs,
            "Hyperparams": _hyperparams(benchmark, first),
            official.converge_key(benchmark): points,
            "Tier": tier,
            "Seeds": [lg.seed for lg in group],
        }
    return out


def _point(v):
    return int(v) if float(v).is_integer() else v
