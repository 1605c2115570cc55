"""`ttt report DIR --html`: one self-contained HTML page of a tree of results.

The page holds the score table, one interactive chart per system x benchmark (every run's eval curve with
hover values, the target and the RCP marks as their own traces) and, where the logs have per-step lines, a
chart of those beside one another (train_loss; the reward of GRPO runs), the compliance verdict of every log with
the official checker's message, and per benchmark a table and a chart (throughput, MFU, peak memory, each
on its own axis with its unit) of the `ttt synth` summaries found under DIR.
Charts are Plotly figures; plotly.js is inlined once, so the page needs no network and no server.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from plotly.offline import get_plotlyjs

from timetotrain import fileio, trees
from timetotrain.errors import UserError
from timetotrain.markup import plotly
from timetotrain.mlperf.compliance import RULESET
from timetotrain.mlperf.results import ResultGroup, find_groups, official_compliance, synthetic_logs
from timetotrain.mlperf.score import Score, point, rcp_line, score_group
from timetotrain.report.plots import (
    RCP_MEAN_COLOR,
    RCP_MIN_COLOR,
    RUNS_COLOR,
    TRAINING_PANELS,
    metric_label,
    point_label,
    target_of,
    training_panels,
)
from timetotrain.report.summary import _slug
from timetotrain.spec import official

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.pass { color: #006400; font-weight: 600; } td.fail { color: #b00020; font-weight: 600; }
td.pending { color: #8a6d00; font-weight: 600; }
pre { white-space: pre-wrap; margin: 0; font-size: 0.85em; }
.chart { width: 100%; height: 520px; } .chart.synth { height: 420px; } .chart.training { height: 440px; }
"""


def _e(v) -> str:
    return html.escape(str(v))


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _round(v: float) -> float:
    """Six significant digits: hover values stay exact to the eye, the page stays small."""
    return float(f"{v:.6g}")


def group_figure(group: ResultGroup, score: Score) -> dict:
    """The Plotly figure (as JSON-able dict) of one system x benchmark: one trace per run, then the target
    and the RCP marks as line traces, so each shows in the legend and answers hover."""
    traces = []
    xs_all = []
    for lg, run in zip(group.logs, score.runs, strict=True):
        xs = [_round(x) for x, _ in lg.evals]
        ys = [_round(y) for _, y in lg.evals]
        xs_all += xs
        name = f"{lg.path.stem} (seed {lg.seed})"
        if not run.converged:
            name += f", {lg.status or 'no run_stop'}"
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": plotly(name),  # a log value: shown as text, never as Plotly markup
                "x": xs,
                "y": ys,
                "line": {"dash": "solid" if run.converged else "dash", "width": 1.5},
                "marker": {"size": 5},
                "hovertemplate": f"{plotly(lg.path.name)}<br>%{{x:,}} -> %{{y:.5g}}<extra></extra>",
            }
        )
    target = target_of(group.benchmark, group.tier.split("+")[0])
    r = score.rcp
    verticals = [
        (score.samples_to_converge, "runs' olympic mean", RUNS_COLOR, "dash"),
        (r.rcp_mean, "RCP mean", RCP_MEAN_COLOR, "solid"),
        (r.rcp_min, "RCP min", RCP_MIN_COLOR, "dot"),
    ]
    ys_all = [y for t in traces for y in t["y"]]
    if target is not None:
        ys_all.append(target)
    marks = [v for v, *_ in verticals if v is not None]
    if target is not None and (xs_all or marks):
        x0, x1 = min(xs_all + marks), max(xs_all + marks)
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": f"target {target}",
                "x": [x0, x1],
                "y": [target, target],
                "line": {"color": "black", "width": 2},
                "hovertemplate": f"target {target}<extra></extra>",
            }
        )
    if ys_all:
        y0, y1 = min(ys_all), max(ys_all)
        for v, what, color, dash in verticals:
            if v is None:
                continue
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "name": f"{what} {point_label(v)}",
                    "x": [_round(v), _round(v)],
                    "y": [y0, y1],
                    "line": {"color": color, "dash": dash, "width": 2},
                    "hovertemplate": f"{what} {point_label(v)}<extra></extra>",
                }
            )
    unit = official.eval_unit(group.benchmark)
    scored = "no score" if score.score_minutes is None else f"score {score.score_minutes:.4g} min"
    layout = {
        "title": {"text": plotly(f"{group.benchmark} tier {group.tier}: {scored}, RCP {r.text()}")},
        "xaxis": {"title": {"text": f"training {unit}"}},
        # The metric label is long (key, what it measures, direction): a smaller font keeps it on the axis.
        "yaxis": {"title": {"text": metric_label(group.benchmark), "font": {"size": 11}}},
        "hovermode": "closest",
        "legend": {"orientation": "h", "y": -0.2},
        "margin": {"t": 50, "l": 90, "r": 20},
    }
    return {"data": traces, "layout": layout}


def training_figure(group: ResultGroup) -> dict | None:
    """The Plotly figure of the group's per-step curves, one panel per series side by side (train_loss, and
    the reward of GRPO runs: plots.TRAINING_PANELS), one trace per run and panel; None when no log has one."""
    panels = training_panels(group)
    if not panels:
        return None
    width, gap = 1.0 / len(panels), 0.08 if len(panels) > 1 else 0.0
    data, layout = [], {}
    for k, name in enumerate(panels):
        x, y = ("x", "y") if k == 0 else (f"x{k + 1}", f"y{k + 1}")
        for i, lg in enumerate(group.logs):
            pts = lg.steps.get(name, [])
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "name": plotly(f"{lg.path.stem} (seed {lg.seed})"),
                    "legendgroup": f"run{i}",  # one legend entry per run toggles it in every panel
                    "showlegend": k == 0,
                    "x": [_round(v) for v, _ in pts],
                    "y": [_round(v) for _, v in pts],
                    "xaxis": x,
                    "yaxis": y,
                    "line": {"width": 1.2},
                    "hovertemplate": f"{plotly(lg.path.name)}<br>{name} %{{y:.5g}} at %{{x:,}}<extra></extra>",
                }
            )
        lo, hi = k * width, (k + 1) * width
        layout["xaxis" + x[1:]] = {
            "domain": [lo + (gap / 2 if k else 0), hi - (gap / 2 if k < len(panels) - 1 else 0)],
            "anchor": y,
            "title": {"text": "training samples"},
        }
        layout["yaxis" + y[1:]] = {
            "anchor": x,
            "title": {"text": TRAINING_PANELS[name], "font": {"size": 11}},
        }
    layout.update(
        {
            "title": {"text": plotly(f"{group.benchmark} tier {group.tier}: per step")},
            "hovermode": "closest",
            "legend": {"orientation": "h", "y": -0.2},
            "margin": {"t": 50, "l": 70, "r": 20},
        }
    )
    return {"data": data, "layout": layout}


def _score_table(rows: list[tuple[Score, str]]) -> str:
    out = [
        "<table id='scores'><tr><th>submitter</th><th>system</th><th>benchmark</th><th>tier</th>"
        "<th>runs converged</th><th>compliant runs</th><th>score (min)</th><th>to converge (olympic)</th>"
        "<th>RCP</th><th>RCP mean</th><th>RCP min</th></tr>"
    ]
    for s, anchor in rows:
        conv = sum(r.converged for r in s.runs)
        ok = sum(r.compliant for r in s.runs)
        rcp, cls = s.rcp.text(short=True), s.rcp.kind  # the colour follows the wording: pending is neither
        out.append(
            f"<tr><td>{_e(s.submitter)}</td><td>{_e(s.system)}</td>"
            f"<td><a href='#{anchor}'>{_e(s.benchmark)}</a></td><td>{_e(s.tier)}</td>"
            f"<td>{conv}/{len(s.runs)}</td><td>{ok}/{len(s.runs)}</td>"
            f"<td>{_fmt(s.score_minutes, '.4f')}</td><td>{point(s.samples_to_converge, s.benchmark, True)}</td>"
            f"<td class='{cls}'>{_e(rcp)}</td><td>{point(s.rcp.rcp_mean, s.benchmark, True)}</td>"
            f"<td>{point(s.rcp.rcp_min, s.benchmark, True)}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def _runs_table(group: ResultGroup, s: Score, ruleset: str, root: Path) -> str:
    out = [
        "<table class='runs'><tr><th>log</th><th>seed</th><th>minutes</th><th>status</th>"
        "<th>to converge</th><th>compliance (official checker)</th></tr>"
    ]
    for lg, r in zip(group.logs, s.runs, strict=True):
        if r.compliant:
            verdict = "<td class='pass'>PASS</td>"
        else:
            # The score keeps the first complaint; the page shows the checker's whole message.
            _, message = official_compliance(lg.path, ruleset)
            verdict = f"<td class='fail'>FAIL<pre>{_e(message.strip() or r.problem)}</pre></td>"
        out.append(
            f"<tr><td>{_e(_rel(lg.path, root))}</td><td>{_e(r.seed)}</td><td>{_fmt(r.minutes, '.3f')}</td>"
            f"<td>{_e(r.status or '-')}</td><td>{point(r.samples_to_converge, s.benchmark)}</td>{verdict}</tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def synth_summaries(root: Path) -> list[dict]:
    """Every per-run `summary_<k>.json` of `ttt synth` under root (summary.json repeats the latest)."""
    found = []
    for p in sorted(Path(root).rglob("summary_*.json")):
        trees.check_inside(p, root, "copy the summary into the tree if it belongs there")
        try:
            doc = json.loads(fileio.read_bounded(p, fileio.SMALL_FILE, "synth summary").decode())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and "mfu" in doc and "benchmark" in doc:
            problem = _summary_problem(doc)
            if problem:
                raise UserError(
                    f"{p}: not a `ttt synth` summary ({problem}): remove it or run `ttt synth` again"
                )
            doc["_path"] = str(p)
            found.append(doc)
    return found


_SUMMARY_NUMBERS = ("mfu", "samples_per_s", "model_tflops_per_s", "peak_memory_bytes")


def _summary_problem(doc: dict) -> str:
    """Why a file that names a benchmark and an MFU is not what `ttt synth` writes ('' when it is): the
    page formats these fields as numbers and strings."""
    for key in ("benchmark", "tier", "item", "device", "precision"):
        if (key in doc or key == "tier") and not isinstance(doc.get(key), str):
            return f"`{key}` is {doc.get(key)!r}, not a string"
    item = doc.get("item", "tokens")
    for key in (*_SUMMARY_NUMBERS, f"{item}_per_s"):
        v = doc.get(key)
        required = key == "mfu"
        if (v is None and required) or (
            v is not None and (not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v))
        ):
            return f"`{key}` is {v!r}, not a finite number"
    if "layers" in doc and (not isinstance(doc["layers"], int) or isinstance(doc["layers"], bool)):
        return f"`layers` is {doc['layers']!r}, not an integer"
    return ""


def _synth_label(s: dict) -> str:
    """One synth run on a chart's category axis: tier, depth, precision, world size and its summary file."""
    label = s["tier"] + (f" {s['layers']}L" if "layers" in s else "")
    world = s.get("world_size")
    label += f" {s.get('precision', '')}" + (f" x{world}" if isinstance(world, int) and world > 1 else "")
    return label + f" ({Path(s['_path']).stem})"


def _num(s: dict, key: str):
    v = s.get(key)
    return v if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _step_p50(s: dict):
    st = s.get("step_time_s")
    return _num(st, "p50") if isinstance(st, dict) else None


def _per_rank_text(s: dict, item: str) -> str:
    ranks = [r for r in s.get("per_rank", []) if isinstance(r, dict) and _num(r, f"{item}_per_s") is not None]
    if len(ranks) < 2:
        return "-"
    xs = [r[f"{item}_per_s"] for r in ranks]
    return f"{_rate(min(xs))} to {_rate(max(xs))} {_e(item)}/s over {len(ranks)} ranks"


def _synth_table(bench: str, runs: list[dict], item: str) -> str:
    head = (
        f"<table class='synth' id='synth-{_e(bench)}'><tr><th>run</th><th>tier</th><th>layers</th>"
        f"<th>device</th><th>world size</th><th>parallel, precision</th><th>throughput ({_e(item)}/s)</th>"
        f"<th>per device ({_e(item)}/s)</th><th>per rank</th><th>samples/s</th><th>step time p50 (s)</th>"
        "<th>model TFLOP/s</th><th>MFU (% of peak)</th><th>peak memory (GiB)</th><th>final loss (uninformed guess)</th></tr>"
    )
    rows = [head]
    for s in runs:
        mem = _num(s, "peak_memory_bytes")
        kind = s.get("peak_memory_kind") if isinstance(s.get("peak_memory_kind"), str) else ""
        loss, guess = _num(s, "final_loss"), _num(s, "baseline_loss")
        rows.append(
            f"<tr><td>{_e(Path(s['_path']).name)}</td><td>{_e(s['tier'])}</td><td>{_e(s.get('layers', '-'))}</td>"
            f"<td>{_e(s.get('device', '-'))}</td><td>{_e(s.get('world_size', '-'))}</td>"
            f"<td>{_e(s.get('parallel', s.get('precision', '-')))}</td>"
            f"<td>{_rate(_num(s, f'{item}_per_s'))}</td><td>{_rate(_num(s, f'{item}_per_s_per_device'))}</td>"
            f"<td>{_per_rank_text(s, item)}</td><td>{_fmt(_num(s, 'samples_per_s'), ',.2f')}</td>"
            f"<td>{_fmt(_step_p50(s), '.4f')}</td><td>{_fmt(_num(s, 'model_tflops_per_s'), ',.3f')}</td>"
            f"<td>{100 * s['mfu']:.2f}</td>"
            f"<td title='{_e(kind)}'>{_fmt(None if mem is None else mem / 2**30, ',.2f')}</td>"
            f"<td>{_fmt(loss, '.3f')} ({_fmt(guess, '.3f')})</td></tr>"
        )
    rows.append("</table>")
    kinds = sorted({s["peak_memory_kind"] for s in runs if isinstance(s.get("peak_memory_kind"), str)})
    if kinds:
        rows.append(f"<p>peak memory: {_e('; '.join(kinds))}</p>")
    return "\n".join(rows)


def _rate(v) -> str:
    """A rate with the digits that matter: whole numbers from 100 up, three significant ones below."""
    return "-" if v is None else f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


# The three panels of a benchmark's synth chart, left to right: each quantity on its own axis, with its unit.
_PANELS = ((0.0, 0.28), (0.36, 0.64), (0.72, 1.0))


def _synth_figure(bench: str, runs: list[dict], item: str) -> dict:
    """Throughput, MFU and peak memory of each run of one benchmark, one panel each (they share no scale)."""
    labels = [plotly(_synth_label(s)) for s in runs]  # category ticks render Plotly markup too
    unit = plotly(item)
    mem = [
        None if _num(s, "peak_memory_bytes") is None else _round(s["peak_memory_bytes"] / 2**30) for s in runs
    ]
    panels = [
        (
            "throughput",
            [_num(s, f"{item}_per_s") for s in runs],
            f"throughput ({unit}/s)",
            f"%{{y:,.0f}} {unit}/s",
        ),
        ("MFU", [_round(100 * s["mfu"]) for s in runs], "MFU (% of the device's peak)", "MFU %{y:.2f}%"),
        ("peak memory", mem, "peak memory (GiB)", "%{y:,.2f} GiB"),
    ]
    data, layout = [], {}
    for k, ((name, ys, title, hover), domain) in enumerate(zip(panels, _PANELS, strict=True)):
        x, y = ("x", "y") if k == 0 else (f"x{k + 1}", f"y{k + 1}")
        data.append({"type": "bar", "name": name, "x": labels, "y": ys, "xaxis": x, "yaxis": y,
                     "hovertemplate": f"%{{x}}<br>{hover}<extra></extra>"})  # fmt: skip
        layout["xaxis" + x[1:]] = {"domain": list(domain), "anchor": y, "automargin": True}
        layout["yaxis" + y[1:]] = {"title": {"text": title}, "anchor": x, "rangemode": "tozero"}
    layout.update(
        {
            "title": {"text": plotly(f"ttt synth {bench}: throughput, MFU and peak memory per run")},
            "showlegend": False,
            "margin": {"b": 40, "t": 50},
        }
    )
    return {"data": data, "layout": layout}


def _synth_section(summaries: list[dict]) -> tuple[str, dict[str, dict]]:
    """Per benchmark: a table of its synth runs (units in the headers) and a chart of three panels."""
    if not summaries:
        return "", {}
    by_bench: dict[str, list[dict]] = {}
    for s in summaries:
        by_bench.setdefault(s["benchmark"], []).append(s)
    parts = [
        "<h2 id='throughput'>Throughput (ttt synth)</h2>",
        "<p>Random weights and random data: throughput and memory, no quality. MFU is the model's FLOPs "
        "against the device's peak (each run's source of the peak is in its summary).</p>",
    ]
    figs = {}
    for bench, runs in by_bench.items():
        items = {str(s.get("item", "tokens")) for s in runs}
        item = items.pop() if len(items) == 1 else "items"
        cid = f"chart-synth-{_slug(bench)}"
        figs[cid] = _synth_figure(bench, runs, item)
        parts += [
            f"<h3 id='synth-{_e(_slug(bench))}'>{_e(bench)}</h3>",
            _synth_table(bench, runs, item),
            f"<div id='{cid}' class='chart synth'></div>",
        ]
    return "\n".join(parts), figs


def render(root: Path, ruleset: str = RULESET) -> str:
    summaries = synth_summaries(root)
    if not _has_results(root) and not summaries:
        raise UserError(
            f"no result_*.txt or `ttt synth` summary_*.json under {root}: pass the --logdir of `ttt run`"
        )
    groups = find_groups(Path(root)) if _has_results(root) else []
    figures: dict[str, dict] = {}
    body, rows, used = [], [], set()
    for g in groups:
        s = score_group(g, ruleset)
        anchor = _slug(g.benchmark, g.tier, g.submitter, g.system)
        while anchor in used:
            anchor += "_"
        used.add(anchor)
        rows.append((s, anchor))
        figures[f"chart-{anchor}"] = group_figure(g, s)
        training = training_figure(g)
        if training is not None:
            figures[f"chart-{anchor}-training"] = training
        body += [
            f"<h2 id='{anchor}'>{_e(g.benchmark)} ({_e(g.tier)}): {_e(g.submitter)} / {_e(g.system)}</h2>",
            f"<p>{_e(_rel(g.folder, Path(root)))}</p>",
            f"<div id='chart-{anchor}' class='chart'></div>",
            *([f"<div id='chart-{anchor}-training' class='chart training'></div>"] if training else []),
            _runs_table(g, s, ruleset, Path(root)),
            f"<p>{_e(rcp_line(s.rcp))}</p>",
            *(f"<p>{_e(n)}</p>" for n in s.notes),
        ]
    synth_html, synth_figs = _synth_section(summaries)
    figures.update(synth_figs)
    head = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>timetotrain results: {_e(root)}</title><style>{CSS}</style>",
        # plotly.js inlined: the page must open with no network. "</script" never occurs in it.
        f"<script>{get_plotlyjs()}</script></head><body>",
        f"<h1>Results under {_e(root)}</h1>",
        f"<p>Ruleset {_e(ruleset)}. Scores as the official result_summarizer computes them; RCP verdicts from "
        "the official rcp_checker (reference tiers) or timetotrain's RCP files (other tiers). Hover a curve "
        "for its values.</p>",
        _score_table(rows) if rows else "<p>No timed results (only synthetic ones).</p>",
    ]
    # Draw every chart, then mark the body, so a reader (or a test) knows when drawing has finished.
    script = (
        "<script>const FIGS = " + json.dumps(figures).replace("</", "<\\/") + ";\n"
        "Promise.all(Object.entries(FIGS).map(([id, f]) => Plotly.newPlot(id, f.data, f.layout, "
        "{responsive: true, displaylogo: false})))"
        ".then(() => { document.body.dataset.chartsDrawn = Object.keys(FIGS).length; });</script>"
    )
    return "\n".join(head + body + [synth_html, script, "</body></html>"])


def _rel(path: Path, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return str(path)


def _has_results(root: Path) -> bool:
    """Result files other than `ttt synth` logs (find_groups sets those aside, and refuses a tree of
    nothing else; the page still shows their summaries)."""
    files = [p for p in Path(root).rglob("result_*.txt") if p.is_file()]
    return len(files) > len(synthetic_logs(root))


def write_html(root: Path, path: Path, ruleset: str = RULESET) -> Path:
    path = Path(path)
    fileio.write_text(path, render(root, ruleset))
    return path
