"""`ttt report DIR --html`: one self-contained HTML page of a tree of results.

The page holds the score table, one interactive chart per system x benchmark (every run's eval curve with
hover values, the target and the RCP marks as their own traces), the compliance verdict of every log with
the official checker's message, and the throughput and MFU of `ttt synth` summaries found under DIR.
Charts are Plotly figures; plotly.js is inlined once, so the page needs no network and no server.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from timetotrain import fileio, trees
from timetotrain.errors import UserError
from timetotrain.markup import plotly
from timetotrain.mlperf.compliance import RULESET
from timetotrain.mlperf.results import ResultGroup, find_groups, official_compliance, synthetic_logs
from timetotrain.mlperf.score import Score, rcp_line, score_group
from timetotrain.report.plots import (
    RCP_MEAN_COLOR,
    RCP_MIN_COLOR,
    RUNS_COLOR,
    metric_label,
    point_label,
    target_of,
)
from timetotrain.report.summary import _slug
from timetotrain.suite import official

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.pass { color: #006400; font-weight: 600; } td.fail { color: #b00020; font-weight: 600; }
td.pending { color: #8a6d00; font-weight: 600; }
pre { white-space: pre-wrap; margin: 0; font-size: 0.85em; }
.chart { width: 100%; height: 520px; }
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


def _score_table(rows: list[tuple[Score, str]]) -> str:
    out = [
        "<table id='scores'><tr><th>submitter</th><th>system</th><th>benchmark</th><th>tier</th>"
        "<th>runs converged</th><th>compliant runs</th><th>score (min)</th><th>samples to converge</th>"
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
            f"<td>{_fmt(s.score_minutes, '.4f')}</td><td>{_fmt(s.samples_to_converge, ',.1f')}</td>"
            f"<td class='{cls}'>{_e(rcp)}</td><td>{_fmt(s.rcp.rcp_mean, ',.1f')}</td>"
            f"<td>{_fmt(s.rcp.rcp_min, ',.1f')}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def _runs_table(group: ResultGroup, s: Score, ruleset: str, root: Path) -> str:
    out = [
        "<table class='runs'><tr><th>log</th><th>seed</th><th>minutes</th><th>status</th>"
        "<th>samples to converge</th><th>compliance (official checker)</th></tr>"
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
            f"<td>{_e(r.status or '-')}</td><td>{_fmt(r.samples_to_converge, ',.0f')}</td>{verdict}</tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def synth_summaries(root: Path) -> list[dict]:
    """Every per-run `summary_<k>.json` of `ttt synth` under root (summary.json repeats the latest)."""
    found = []
    for p in sorted(Path(root).rglob("summary_*.json")):
        trees.check_inside(p, root, "copy the summary into the tree if it belongs there")
        try:
            doc = json.loads(p.read_text())
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


def _synth_section(summaries: list[dict]) -> tuple[str, dict | None]:
    if not summaries:
        return "", None
    rows = [
        "<h2 id='throughput'>Throughput (ttt synth)</h2><table id='synth'><tr><th>benchmark</th><th>tier</th>"
        "<th>layers</th><th>device</th><th>precision</th><th>items/s</th><th>samples/s</th>"
        "<th>model TFLOP/s</th><th>MFU</th><th>peak memory (GiB)</th><th>summary</th></tr>"
    ]
    labels, items, mfus = [], [], []
    for s in summaries:
        item = s.get("item", "tokens")
        per_s = s.get(f"{item}_per_s")
        label = f"{s['benchmark']}/{s['tier']}" + (f" {s['layers']}L" if "layers" in s else "")
        label += f" {s.get('precision', '')} ({Path(s['_path']).stem})"
        labels.append(plotly(label))  # category ticks render Plotly markup too
        items.append(per_s)
        mfus.append(100 * s["mfu"])
        rows.append(
            f"<tr><td>{_e(s['benchmark'])}</td><td>{_e(s['tier'])}</td><td>{_e(s.get('layers', '-'))}</td>"
            f"<td>{_e(s.get('device', '-'))}</td><td>{_e(s.get('precision', '-'))}</td>"
            f"<td>{_fmt(per_s, ',.0f')} {_e(item)}/s</td><td>{_fmt(s.get('samples_per_s'), ',.2f')}</td>"
            f"<td>{_fmt(s.get('model_tflops_per_s'), ',.3f')}</td><td>{100 * s['mfu']:.2f}%</td>"
            f"<td>{_fmt(s.get('peak_memory_bytes', 0) / 2**30, ',.2f')}</td><td>{_e(s['_path'])}</td></tr>"
        )
    rows.append("</table><div id='chart-synth' class='chart'></div>")
    # Two panels, each with its own axes: items/s and MFU % share no scale, so bars of both on one axis
    # pair read as one quantity. The items differ per benchmark (tokens, images, ...): the hover says which.
    item_names = [plotly(str(s.get("item", "tokens"))) for s in summaries]  # from the files: text only
    fig = {
        "data": [
            {"type": "bar", "name": "throughput", "x": labels, "y": items, "xaxis": "x", "yaxis": "y",
             "customdata": item_names, "hovertemplate": "%{x}<br>%{y:,.0f} %{customdata}/s<extra></extra>"},
            {"type": "bar", "name": "MFU", "x": labels, "y": mfus, "xaxis": "x2", "yaxis": "y2",
             "hovertemplate": "%{x}<br>MFU %{y:.2f}%<extra></extra>"},
        ],
        "layout": {
            "title": {"text": "ttt synth: throughput (left) and model FLOPs utilization (right), per run"},
            "xaxis": {"domain": [0, 0.46], "anchor": "y"},
            "yaxis": {"title": {"text": "items/s (" + ", ".join(sorted(set(item_names))) + ")"}, "anchor": "x"},
            "xaxis2": {"domain": [0.54, 1], "anchor": "y2"},
            "yaxis2": {"title": {"text": "MFU (% of the device's peak)"}, "anchor": "x2", "rangemode": "tozero"},
            "showlegend": False,
            "margin": {"b": 160},
        },
    }  # fmt: skip
    return "\n".join(rows), fig


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
        body += [
            f"<h2 id='{anchor}'>{_e(g.benchmark)} ({_e(g.tier)}): {_e(g.submitter)} / {_e(g.system)}</h2>",
            f"<p>{_e(_rel(g.folder, Path(root)))}</p>",
            f"<div id='chart-{anchor}' class='chart'></div>",
            _runs_table(g, s, ruleset, Path(root)),
            f"<p>{_e(rcp_line(s.rcp))}</p>",
            *(f"<p>{_e(n)}</p>" for n in s.notes),
        ]
    synth_html, synth_fig = _synth_section(summaries)
    if synth_fig is not None:
        figures["chart-synth"] = synth_fig
    from plotly.offline import get_plotlyjs

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
