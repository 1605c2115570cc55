"""`ttt report`: a picture per benchmark and a markdown summary of a tree of result logs.

summary.md holds the score table of `ttt score` with a section per system x benchmark (every value from a
log escaped: `markup.md`); scores.json its machine-readable form; one PNG per group (see plots.py), and a
second, `<name>-training.png`, of the per-step curves (train_loss; the reward of GRPO runs) where the logs
have them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from timetotrain import fileio
from timetotrain.errors import UserError
from timetotrain.markup import md
from timetotrain.mlperf.compliance import RULESET
from timetotrain.mlperf.results import find_groups
from timetotrain.mlperf.score import Score, point, rcp_line, score_group, to_json
from timetotrain.report.plots import plot_group, plot_training


@dataclass
class Report:
    summary: Path
    scores_json: Path
    plots: list[Path]
    scores: list[Score]
    # Per group, its per-step curves (plots.plot_training), or None where its logs have none.
    training_plots: list[Path | None] = field(default_factory=list)


def _slug(*parts: str) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p).strip("_") for p in parts if p)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def summary_markdown(
    scores: list[Score], plots: list[Path], training: list[Path | None] | None = None
) -> str:
    lines = [
        "# Results",
        "",
        "Scores as the official result_summarizer computes them (olympic mean of run_start -> run_stop "
        "minutes of compliant runs, times scaling.json); RCP verdicts from the official rcp_checker "
        "(reference tiers) or timetotrain's RCP files (other tiers).",
        "",
        "| submitter | system | benchmark | tier | compliant runs | score (min) | CV time | "
        "to converge (olympic) | CV to converge | RCP | RCP mean | RCP min | plot |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, p in zip(scores, plots, strict=True):
        ok = sum(r.compliant for r in s.runs)
        rcp = s.rcp.text(short=True)
        lines.append(
            f"| {md(s.submitter)} | {md(s.system)} | {md(s.benchmark)} | {md(s.tier)} | {ok}/{len(s.runs)} | "
            f"{_fmt(s.score_minutes, '.4f')} | {_pct(s.cv_minutes)} | "
            f"{point(s.samples_to_converge, s.benchmark, olympic=True)} | {_pct(s.cv_samples)} | {md(rcp)} | "
            f"{point(s.rcp.rcp_mean, s.benchmark, olympic=True)} | {point(s.rcp.rcp_min, s.benchmark, olympic=True)} | "
            f"[{p.name}]({p.name}) |"
        )
    lines += ["", "## Details", ""]
    for s, p, t in zip(scores, plots, training or [None] * len(plots), strict=True):
        lines += [
            f"### {md(s.benchmark)} ({md(s.tier)}) - {md(s.submitter)} / {md(s.system)}",
            "",
            f"![{p.name}]({p.name})",
            "",
        ]
        if t is not None:
            lines += [f"![{t.name}]({t.name})", ""]
        lines += [
            "| run | seed | minutes | status | to converge | compliant |",
            "|---|---|---|---|---|---|",
        ]
        for r in s.runs:
            ok = "yes" if r.compliant else f"no: {r.problem}"
            lines.append(
                f"| {md(r.file)} | {md(r.seed)} | {_fmt(r.minutes, '.3f')} | {md(r.status or '-')} | "
                f"{point(r.samples_to_converge, s.benchmark)} | {md(ok)} |"
            )
        lines += ["", md(rcp_line(s.rcp)), ""]
        lines += [f"- {md(n)}" for n in s.notes]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def make_report(root: Path, out: Path, ruleset: str = RULESET) -> Report:
    out = Path(out)
    groups = find_groups(Path(root))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out} cannot be created ({e.strerror}): pass a writable folder") from e
    scores, plots, training, used = [], [], [], set()
    # A benchmark x tier that more than one group holds names every one of its plots by submitter and
    # system, so a plot's name does not depend on which folder happened to sort first.
    shared = Counter((g.benchmark, g.tier) for g in groups)
    summary, scores_json = out / "summary.md", out / "scores.json"
    # Every output appears at once or none does: a full disk halfway leaves the previous report as it was.
    with fileio.Staged() as staged:
        for g in groups:
            s = score_group(g, ruleset)
            if shared[g.benchmark, g.tier] == 1:
                name = _slug(g.benchmark, g.tier)
            else:
                name = _slug(g.benchmark, g.tier, g.submitter, g.system)
            k = 2  # the same submitter and system in two folders: numbered in folder order
            # A name is taken with its training plot's, so no group's plot is another's `-training` one.
            while name in used or f"{name}-training" in used:
                name, k = f"{name}-{k}", k + 1
            used.update((name, f"{name}-training"))
            plots.append(plot_group(g, s, out / f"{name}.png", staged))
            training.append(plot_training(g, out / f"{name}-training.png", staged))
            scores.append(s)
        staged.write_text(summary, summary_markdown(scores, plots, training))
        staged.write_text(scores_json, to_json(scores) + "\n")
    return Report(summary, scores_json, plots, scores, training)
