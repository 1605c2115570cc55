"""`ttt report`: a picture per benchmark and a markdown summary of a tree of result logs.

Each PNG shows the eval metric of every run against training samples, the quality target as a
horizontal line, and the RCP mean and minimum acceptable mean (in samples) as vertical lines when an
RCP applies. summary.md holds the score table of `ttt score`; scores.json its machine-readable form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import RULESET
from timetotrain.mlperf.results import SAMPLE_BENCHMARKS, ResultGroup, find_groups
from timetotrain.mlperf.score import Score, rcp_line, score_group, to_json

# Closed-division quality targets (spec §1), for logs of benchmarks timetotrain does not implement yet.
OFFICIAL_TARGETS = {
    "llama31_8b": 3.3,
    "gpt_oss_20b": 3.34,
    "deepseekv3_671b": 3.6,
    "llama31_405b": 5.6,
    "llama2_70b_lora": 0.925,
    "flux1": 0.586,
    "dlrm_dcnv2": 0.80275,
    "rgat": 0.72,
}
# Marks in colors outside matplotlib's default cycle, so they never look like one of the runs.
RUNS_COLOR, RCP_MEAN_COLOR, RCP_MIN_COLOR = "#000080", "#006400", "#dc143c"


@dataclass
class Report:
    summary: Path
    scores_json: Path
    plots: list[Path]
    scores: list[Score]


def target_of(benchmark: str, tier: str) -> float | None:
    from timetotrain import suite

    if benchmark in suite.names() and tier in suite.get(benchmark).tiers:
        return suite.get(benchmark).tiers[tier].target
    return OFFICIAL_TARGETS.get(benchmark) if tier == "reference" else None


def _metric_label(benchmark: str) -> str:
    from timetotrain import suite

    if benchmark in suite.names():
        return f"eval_accuracy: {suite.get(benchmark).metric.split(',')[0]}"
    return "eval_accuracy"


def _slug(*parts: str) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p).strip("_") for p in parts if p)


def plot_group(group: ResultGroup, score: Score, path: Path) -> Path:
    """Left: whole runs. Right: the same, zoomed on where runs cross the target and the RCP marks sit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (full, zoom) = plt.subplots(1, 2, figsize=(13, 6.5), dpi=100, gridspec_kw={"width_ratios": [3, 2]})
    target = target_of(group.benchmark, group.tier.split("+")[0])
    r = score.rcp
    for ax in (full, zoom):
        for lg, run in zip(group.logs, score.runs, strict=True):
            xs, ys = zip(*lg.evals, strict=True) if lg.evals else ((), ())
            label = f"{lg.path.stem} (seed {lg.seed})"
            if not run.converged:
                label += f", {lg.status or 'no run_stop'}"
            if not lg.evals:  # still listed, so a run that stopped before its first eval is not lost
                label += ", no eval"
            ax.plot(
                xs, ys, "-" if run.converged else "--", marker="o", markersize=3, linewidth=1.1, label=label
            )
        if target is not None:
            ax.axhline(target, color="black", linewidth=1.2, label=f"target {target}")
        if score.samples_to_converge is not None:
            ax.axvline(
                score.samples_to_converge,
                color=RUNS_COLOR,
                linestyle="--",
                linewidth=1.3,
                label=f"runs' olympic mean {score.samples_to_converge:,.0f}",
            )
        if r.rcp_mean is not None:
            ax.axvline(r.rcp_mean, color=RCP_MEAN_COLOR, linewidth=1.5, label=f"RCP mean {r.rcp_mean:,.0f}")
            ax.axvline(
                r.rcp_min,
                color=RCP_MIN_COLOR,
                linestyle=":",
                linewidth=1.5,
                label=f"RCP min {r.rcp_min:,.0f}",
            )
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if abs(v) >= 10 else f"{v:g}"))
    unit = "samples" if group.benchmark in SAMPLE_BENCHMARKS else "epochs"
    full.set_xlabel(f"training {unit}")
    zoom.set_xlabel(f"training {unit} (near the target)")
    full.set_ylabel(_metric_label(group.benchmark))
    _zoom_limits(
        zoom, group, target, [v for v in (r.rcp_mean, r.rcp_min, score.samples_to_converge) if v is not None]
    )
    scored = "no score" if score.score_minutes is None else f"score {score.score_minutes:.4g} min"
    fig.suptitle(
        f"{group.benchmark} tier {group.tier}: {group.submitter} / {group.system}: {scored}, "
        f"RCP {r.verdict}" + (" (interpolated)" if r.interpolated else ""),
        fontsize=11,
    )
    # Below the panels: with 10 runs and 4 marks a legend inside would cover the curves.
    handles, labels = full.get_legend_handles_labels()
    ncol = 5
    rows = -(-len(labels) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.02 + 0.045 * rows, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def _zoom_limits(ax, group: ResultGroup, target: float | None, marks: list[float]) -> None:
    # Runs that stopped early (aborted) would stretch the window back to their last eval.
    ends = [lg.evals[-1][0] for lg in group.logs if lg.evals and lg.converged]
    ends = ends or [lg.evals[-1][0] for lg in group.logs if lg.evals]
    if not ends:
        return
    hi = max(ends + marks)
    lo = min(ends + marks)
    span = max(hi - lo, 0.25 * hi)
    x0, x1 = lo - 0.6 * span, hi + 0.15 * span
    ys = [y for lg in group.logs for x, y in lg.evals if x0 <= x <= x1]
    if target is not None:
        ys.append(target)
    if ys:
        pad = 0.08 * (max(ys) - min(ys) or abs(max(ys)) or 1.0)
        ax.set_ylim(min(ys) - pad, max(ys) + pad)
    ax.set_xlim(x0, x1)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def summary_markdown(scores: list[Score], plots: list[Path]) -> str:
    lines = [
        "# Results",
        "",
        "Scores as the official result_summarizer computes them (olympic mean of run_start -> run_stop "
        "minutes of compliant runs, times scaling.json); RCP verdicts from the official rcp_checker "
        "(reference tiers) or timetotrain's RCP files (other tiers).",
        "",
        "| submitter | system | benchmark | tier | compliant runs | score (min) | CV time | "
        "samples to converge | CV samples | RCP | RCP mean | RCP min | plot |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, p in zip(scores, plots, strict=True):
        ok = sum(r.compliant for r in s.runs)
        rcp = s.rcp.verdict + (" (interp.)" if s.rcp.interpolated else "")
        lines.append(
            f"| {s.submitter} | {s.system} | {s.benchmark} | {s.tier} | {ok}/{len(s.runs)} | "
            f"{_fmt(s.score_minutes, '.4f')} | {_pct(s.cv_minutes)} | "
            f"{_fmt(s.samples_to_converge, ',.1f')} | {_pct(s.cv_samples)} | "
            f"{rcp} | {_fmt(s.rcp.rcp_mean, ',.1f')} | {_fmt(s.rcp.rcp_min, ',.1f')} | [{p.name}]({p.name}) |"
        )
    lines += ["", "## Details", ""]
    for s, p in zip(scores, plots, strict=True):
        lines += [
            f"### {s.benchmark} ({s.tier}) - {s.submitter} / {s.system}",
            "",
            f"![{p.name}]({p.name})",
            "",
        ]
        lines += [
            "| run | seed | minutes | status | samples to converge | compliant |",
            "|---|---|---|---|---|---|",
        ]
        for r in s.runs:
            ok = "yes" if r.compliant else f"no: {r.problem}"
            lines.append(
                f"| {r.file} | {r.seed} | {_fmt(r.minutes, '.3f')} | {r.status or '-'} | "
                f"{_fmt(r.samples_to_converge, ',.0f')} | {ok.replace('|', '/')} |"
            )
        lines += ["", rcp_line(s.rcp), ""]
        lines += [f"- {n}" for n in s.notes]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def make_report(root: Path, out: Path, ruleset: str = RULESET) -> Report:
    out = Path(out)
    groups = find_groups(Path(root))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out} cannot be created ({e.strerror}): pass a writable folder") from e
    scores, plots, used = [], [], set()
    for g in groups:
        s = score_group(g, ruleset)
        name = _slug(g.benchmark, g.tier)
        if name in used:
            name = _slug(g.benchmark, g.tier, g.submitter, g.system)
        k = 2
        while name in used:
            name, k = f"{name}-{k}", k + 1
        used.add(name)
        plots.append(plot_group(g, s, out / f"{name}.png"))
        scores.append(s)
    summary = out / "summary.md"
    summary.write_text(summary_markdown(scores, plots))
    scores_json = out / "scores.json"
    scores_json.write_text(to_json(scores) + "\n")
    return Report(summary, scores_json, plots, scores)
