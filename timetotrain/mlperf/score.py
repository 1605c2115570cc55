"""`ttt score`: the MLPerf Training score of each system x benchmark in a tree of result logs.

The arithmetic is the official result_summarizer's (docs/submission.md), so a submission tree scores to the same
number: a run counts iff the official compliance engine accepts its file; its time is run_start ->
run_stop in minutes; the score is the olympic mean (drop the fastest and the slowest; a dropped,
non-compliant run counts as the slowest; more than one -> no score), times `scaling.json`'s factor when
the folder has one. For 3-run benchmarks the olympic mean is the median.

Unlike the summarizer, nothing is written into the tree: the summarizer's RCP check rewrites
`scaling.json`, so its score on a fresh tree changes between its first and second run. The RCP
normalization factor is reported instead (`rcp.norm_factor`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from timetotrain import fileio, strictjson
from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import RULESET
from timetotrain.mlperf.rcp import RcpResult, check_reference, check_tier, olympic_mean, submission_points
from timetotrain.mlperf.results import NOT_CONVERGED, ResultGroup, find_groups, official_compliance
from timetotrain.spec import official, registry


@dataclass
class RunScore:
    file: str
    seed: object
    minutes: float | None
    status: str | None
    converged: bool
    compliant: bool
    samples_to_converge: float | None
    problem: str = ""  # the compliance engine's first complaint, when not compliant


@dataclass
class Score:
    submitter: str
    system: str
    benchmark: str
    tier: str
    division: str
    folder: str
    ruleset: str
    global_batch_size: object
    runs_required: int | None
    runs: list[RunScore]
    score_minutes: float | None
    olympic_minutes: float | None
    scaling_factor: float
    dropped: int
    samples_to_converge: float | None  # olympic mean, as the summarizer's detailed table
    cv_minutes: float | None
    cv_samples: float | None
    rcp: RcpResult
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rcp"] = self.rcp.to_dict()
        return d


def required_runs(benchmark: str, tier: str) -> int | None:
    """The runs a score of `tier` counts: the round's (benchmark_meta, `official.result_files`) for the
    reference tier and any benchmark not ours; our own tiers' (their RCPs were set on that many)."""
    if tier != "reference" and benchmark in registry.names() and tier in registry.get(benchmark).tiers:
        return registry.get(benchmark).tiers[tier].runs
    return official.result_files(benchmark)


def scaling_factor(folder: Path) -> float:
    path = Path(folder) / "scaling.json"
    if not path.is_file():
        return 1.0
    try:
        return float(
            json.loads(fileio.read_bounded(path, fileio.SMALL_FILE, "scaling file").decode())[
                "scaling_factor"
            ]
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} has no readable scaling_factor ({e}): fix or remove it") from e


def olympic_score(minutes: list[float], dropped: int, max_dropped: int = 1) -> float | None:
    """The summarizer's olympic average: each dropped (failed) run stands in for one slowest run."""
    if dropped > max_dropped:
        return None
    kept = sorted(minutes)[max_dropped : len(minutes) - (max_dropped - dropped)]
    if not kept:
        return None
    return sum(kept) * 1.0 / len(kept)


def _runs(n: int, what: str = "run") -> str:
    """ "1 run", "2 runs": a count as a person writes it."""
    return f"{n} {what}" + ("" if n == 1 else "s")


def _cv(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = float(np.mean(values))
    return float(np.std(values, ddof=1)) / mean if mean else None


def olympic_drops(benchmark: str) -> int:
    """How many non-compliant result files a benchmark's score (and the official package checker) accepts,
    each counted as the slowest run: 4 for unet3d, 1 elsewhere."""
    return 4 if benchmark == "unet3d" else 1


def score_group(group: ResultGroup, ruleset: str = RULESET) -> Score:
    runs = []
    for lg in group.logs:
        ok, why = official_compliance(lg.path, ruleset)
        if ok and lg.minutes is None:  # cannot happen for a compliant log; kept for hand-made rule files
            ok, why = False, "run_start or run_stop not recorded"
        stc = lg.samples_to_converge
        runs.append(
            RunScore(
                lg.path.name,
                lg.seed,
                lg.minutes,
                lg.status,
                lg.converged,
                ok,
                None if stc == NOT_CONVERGED else stc,
                "" if ok else first_problem(why),
            )
        )
    notes = []
    counted = [r.minutes for r in runs if r.compliant]
    dropped = len(runs) - len(counted)
    max_dropped = olympic_drops(group.benchmark)
    olympic = olympic_score(counted, dropped, max_dropped)
    factor = scaling_factor(group.folder)
    if dropped > max_dropped:
        notes.append(f"{dropped} runs are not compliant; at most {max_dropped} may be dropped: no score")
    elif olympic is None:
        notes.append(f"{_runs(len(runs))} {'is' if len(runs) == 1 else 'are'} too few for an olympic mean")
    elif dropped:
        notes.append(f"{_runs(dropped, 'non-compliant run')} dropped as the slowest (olympic scoring)")
    need = required_runs(group.benchmark, group.tier)
    if need is not None and need != len(runs):
        notes.append(f"{group.benchmark} needs exactly {need} runs, found {len(runs)}")
    if factor != 1.0:
        notes.append(f"scaled by scaling.json factor {factor}")
    _, points, _ = submission_points(group.logs)
    samples = olympic_mean(points) if points is not None and len(points) >= 3 else None
    rcp = _rcp(group, ruleset, need or len(runs))
    return Score(
        group.submitter,
        group.system,
        group.benchmark,
        group.tier,
        group.division,
        str(group.folder),
        ruleset,
        group.logs[0].global_batch_size,
        need,
        runs,
        None if olympic is None else olympic * factor,
        olympic,
        factor,
        dropped,
        samples,
        _cv(counted),
        _cv([r.samples_to_converge for r in runs if r.samples_to_converge is not None]),
        rcp,
        notes,
    )


def _rcp(group: ResultGroup, ruleset: str, runs: int) -> RcpResult:
    if "+" in group.tier:
        return RcpResult("Fail", f"{group.folder} mixes tiers {group.tier}: keep one tier per folder")
    if group.tier == "reference":
        return check_reference(group.folder, group.logs, ruleset)
    return check_tier(group.benchmark, group.tier, group.logs, runs)


def first_problem(text: str) -> str:
    """The first line of the compliance engine's report that names a problem."""
    for line in text.splitlines():
        line = line.strip(" -")
        if line:
            return line[:200]
    return "not compliant"


def score_tree(root: Path, ruleset: str = RULESET) -> list[Score]:
    return [score_group(g, ruleset) for g in find_groups(Path(root))]


def _num(v, fmt: str = ",.0f") -> str:
    return "-" if v is None else format(v, fmt)


def point(value: float | None, benchmark: str, olympic: bool = False) -> str:
    """A convergence point in the unit the RCP checker counts for `benchmark`: "3,840 samples" (a run's),
    "3,840.0 samples" (a mean), "0.489 epochs", not an epoch count rounded to 0 or 0.5; "-" when none."""
    if value is None:
        return "-"
    unit = official.eval_unit(benchmark)
    spec = (",.1f" if olympic else ",.0f") if unit == official.SAMPLES else (",.4f" if olympic else ",.3f")
    return f"{value:{spec}} {unit}"


def format_text(scores: list[Score]) -> str:
    out = []
    for s in scores:
        out.append(
            f"{s.submitter} / {s.system} / {s.benchmark}  (tier {s.tier}, {s.division or '?'} division, "
            f"GBS {s.global_batch_size}, ruleset {s.ruleset})"
        )
        out.append(f"  {s.folder}")
        unit = official.eval_unit(s.benchmark)
        fmt = ",.0f" if unit == official.SAMPLES else ",.3f"
        out.append(f"  {'run':<16}{'seed':>12}{'minutes':>11}  {'status':<9}{unit:>12}  compliant")
        for r in s.runs:
            flag = "yes" if r.compliant else f"NO: {r.problem}"
            out.append(
                f"  {r.file:<16}{r.seed!s:>12}{_num(r.minutes, '.3f'):>11}  {r.status or '-':<9}"
                f"{_num(r.samples_to_converge, fmt):>12}  {flag}"
            )
        if s.score_minutes is None:
            out.append("  score: none")
        else:
            out.append(
                f"  score: {s.score_minutes:.4f} min (olympic mean {s.olympic_minutes:.4f} x scaling {s.scaling_factor:.6f})"
            )
        cvs = []
        if s.cv_minutes is not None:
            cvs.append(f"CV of times {100 * s.cv_minutes:.2f}%")
        if s.cv_samples is not None:
            cvs.append(f"CV of {unit} to converge {100 * s.cv_samples:.2f}%")
        if s.samples_to_converge is not None:
            olympic = format(s.samples_to_converge, ",.1f" if unit == official.SAMPLES else ",.3f")
            cvs.append(f"olympic {unit} to converge {olympic}")
        if cvs:
            out.append("  " + ", ".join(cvs))
        out.append("  " + rcp_line(s.rcp))
        for n in s.notes:
            out.append(f"  note: {n}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def rcp_line(r: RcpResult) -> str:
    text = f"RCP: {r.text()} - {r.message}"
    if r.rcp_mean is not None:
        fmt = ",.4f" if r.unit == official.EPOCHS else ",.1f"  # 0.9250 epochs, not 0.9
        runs = "" if r.submission_mean is None else f"runs {r.submission_mean:{fmt}} vs "
        text += f"; BS {r.bs}: {runs}RCP mean {r.rcp_mean:{fmt}}, min {r.rcp_min:{fmt}} {r.unit}"
        if r.norm_factor != 1.0:
            text += f"; normalization factor {r.norm_factor:.6f}"
    return text


def to_json(scores: list[Score]) -> str:
    """Strict JSON (no NaN: a figure that has none is null, with its reason beside it)."""
    return strictjson.dumps({"results": [s.to_dict() for s in scores]}, indent=2, default=str)
