"""The picture of one system x benchmark: the eval metric of every run against training samples (or
epochs), the quality target as a horizontal line, and the runs' olympic mean and the RCP mean and
minimum acceptable mean as vertical lines when an RCP applies."""

from __future__ import annotations

from pathlib import Path

from timetotrain import fileio
from timetotrain.markup import mpl
from timetotrain.mlperf.results import ResultGroup
from timetotrain.mlperf.score import Score
from timetotrain.spec import official, registry

# Marks in colors outside matplotlib's default cycle, so they never look like one of the runs.
RUNS_COLOR, RCP_MEAN_COLOR, RCP_MIN_COLOR = "#000080", "#006400", "#dc143c"


def target_of(benchmark: str, tier: str) -> float | None:
    """Our tier's target for benchmarks timetotrain implements; the closed target for reference logs."""
    if benchmark in registry.names() and tier in registry.get(benchmark).tiers:
        return registry.get(benchmark).tiers[tier].target
    facts = official.get(benchmark)
    return facts.target if facts is not None and tier == "reference" else None


def metric_label(benchmark: str) -> str:
    """The y axis: the logged key and what it measures, with its direction."""
    facts = official.get(benchmark)
    if facts is not None and facts.target is None:  # several metrics (stable_diffusion): no one direction
        return f"eval_accuracy: {facts.metric_label}"
    if facts is not None:
        better = "higher" if facts.higher_is_better else "lower"
        return f"eval_accuracy: {facts.metric_label}, {better} is better"
    if benchmark in registry.names():
        return f"eval_accuracy: {registry.get(benchmark).metric}"
    return "eval_accuracy"


def point_label(v: float) -> str:
    """A convergence point for the legend: whole samples when large, else 4 significant digits, so an
    epoch count such as 0.79 is not rounded to 1."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def plot_group(group: ResultGroup, score: Score, path: Path, staged: fileio.Staged | None = None) -> Path:
    """Left: whole runs. Right: the same, zoomed on where runs cross the target and the RCP marks sit.
    Written atomically, or into `staged` (renamed with the report's other files, or removed with them)."""
    import matplotlib  # heavy (0.6 s with pyplot): only the PNGs, not `ttt report --html`

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
                xs,
                ys,
                "-" if run.converged else "--",
                marker="o",
                markersize=3,
                linewidth=1.1,
                label=mpl(label),
            )
        if target is not None:
            ax.axhline(target, color="black", linewidth=1.2, label=f"target {target}")
        if score.samples_to_converge is not None:
            ax.axvline(
                score.samples_to_converge,
                color=RUNS_COLOR,
                linestyle="--",
                linewidth=1.3,
                label=f"runs' olympic mean {point_label(score.samples_to_converge)}",
            )
        if r.rcp_mean is not None:
            ax.axvline(
                r.rcp_mean, color=RCP_MEAN_COLOR, linewidth=1.5, label=f"RCP mean {point_label(r.rcp_mean)}"
            )
            ax.axvline(
                r.rcp_min,
                color=RCP_MIN_COLOR,
                linestyle=":",
                linewidth=1.5,
                label=f"RCP min {point_label(r.rcp_min)}",
            )
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if abs(v) >= 10 else f"{v:g}"))
    unit = official.eval_unit(group.benchmark)
    full.set_xlabel(f"training {unit}")
    zoom.set_xlabel(f"training {unit} (near the target)")
    full.set_ylabel(metric_label(group.benchmark))
    _zoom_limits(
        zoom, group, target, [v for v in (r.rcp_mean, r.rcp_min, score.samples_to_converge) if v is not None]
    )
    scored = "no score" if score.score_minutes is None else f"score {score.score_minutes:.4g} min"
    fig.suptitle(
        mpl(f"{group.benchmark} tier {group.tier}: {group.submitter} / {group.system}: {scored}, ")
        + f"RCP {r.text()}",
        fontsize=11,
    )
    # Below the panels: with 10 runs and 4 marks a legend inside would cover the curves.
    handles, labels = full.get_legend_handles_labels()
    ncol = 5
    rows = -(-len(labels) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.02 + 0.045 * rows, 1, 1))
    for ax in (full, zoom):
        _thin_x_ticks(fig, ax)
    try:
        with fileio.atomic_write(path, "wb") if staged is None else staged.open(path) as f:
            fig.savefig(f, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path


def _visible_x_labels(ax) -> list:
    lo, hi = sorted(ax.get_xlim())
    pairs = zip(ax.get_xticklabels(), ax.get_xticks(), strict=True)
    return [t for t, x in pairs if t.get_text() and lo <= x <= hi]


def x_labels_overlap(ax, gap_px: float = 4.0) -> bool:
    """Whether two shown tick labels of the x axis touch (the figure must have been drawn)."""
    boxes = sorted((t.get_window_extent() for t in _visible_x_labels(ax)), key=lambda b: b.x0)
    return any(a.x1 + gap_px > b.x0 for a, b in zip(boxes, boxes[1:], strict=False))


def _thin_x_ticks(fig, ax) -> None:
    """Fewer x ticks until their labels do not touch. Matplotlib sizes the tick count by the axis length
    and font size, not the label width, so the narrow zoom panel ran 7-8 digit sample counts into one
    another (flux1's ~8.5 M, llama31_405b)."""
    from matplotlib.ticker import MaxNLocator  # heavy: as in plot_group, its caller

    fig.canvas.draw()
    nbins = len(_visible_x_labels(ax))
    while nbins > 2 and x_labels_overlap(ax):
        nbins -= 1
        ax.xaxis.set_major_locator(MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10]))
        fig.canvas.draw()


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


# What a training panel shows, by series name (RunLog.steps): its axis label. train_loss first, then the
# per-step figures of GRPO's rollouts (`ttt_rollout_stats`) that a run is judged by.
TRAINING_PANELS = {
    "train_loss": "train_loss (the step's mean training loss)",
    "reward": "reward (mean over the step's rollouts, ttt_rollout_stats)",
}


def training_panels(group: ResultGroup) -> list[str]:
    """The TRAINING_PANELS some log of the group has a series for, in their order."""
    return [name for name in TRAINING_PANELS if any(lg.steps.get(name) for lg in group.logs)]


def plot_training(group: ResultGroup, path: Path, staged: fileio.Staged | None = None) -> Path | None:
    """The per-step curves of every run against training samples, one panel per series (train_loss, and
    beside it the reward for GRPO runs); None, and no file, when no log has a per-step series."""
    panels = training_panels(group)
    if not panels:
        return None
    import matplotlib  # heavy (0.6 s with pyplot): only the PNGs, not `ttt report --html`

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), dpi=100, squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        for lg in group.logs:
            pts = lg.steps.get(name, [])
            xs, ys = zip(*pts, strict=True) if pts else ((), ())
            ax.plot(xs, ys, linewidth=1.0, label=mpl(f"{lg.path.stem} (seed {lg.seed})"))
        ax.set_xlabel("training samples")
        ax.set_ylabel(TRAINING_PANELS[name])
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    fig.suptitle(
        mpl(f"{group.benchmark} tier {group.tier}: {group.submitter} / {group.system}: per step"), fontsize=11
    )
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = 5
    rows = -(-len(labels) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.02 + 0.05 * rows, 1, 1))
    for ax in axes[0]:
        _thin_x_ticks(fig, ax)
    try:
        with fileio.atomic_write(path, "wb") if staged is None else staged.open(path) as f:
            fig.savefig(f, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path
