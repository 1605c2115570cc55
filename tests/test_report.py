"""`ttt report`: one PNG per benchmark (runs, target, RCP marks) and the markdown score table."""

import json
import shutil

import numpy as np
import pytest
from conftest import require, require_file, shared_data_dir
from fakelogs import curve_log, grpo_steps, rcp_only_log, tier_log, tiny_runs, ttt_main

from timetotrain import report
from timetotrain.mlperf import rcp
from timetotrain.mlperf.results import find_groups, parse_log
from timetotrain.report import html
from timetotrain.spec import official, registry


def color_pixels(png, hex_color: str, tol: float = 0.04) -> int:
    """How many pixels of the image have (nearly) this color."""
    img = require("matplotlib.image").imread(png)[..., :3]
    rgb = np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - rgb).max(axis=-1) < tol).sum())


def test_report_of_the_v51_results(tmp_path, capsys):
    src = require_file(shared_data_dir() / "mlperf_results_v5.1")
    tree = tmp_path / "v51"
    shutil.copytree(src, tree)
    out = tmp_path / "report"
    assert ttt_main(["report", str(tree), "--out", str(out), "--ruleset", "5.1.0"]) == 0
    assert "summary:" in capsys.readouterr().out
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["llama2_70b_lora-reference.png", "llama31_8b-reference.png"]
    png = out / "llama31_8b-reference.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # RCP mean and minimum are drawn (their colors are outside the runs' color cycle), and the runs' mean.
    assert color_pixels(png, report.RCP_MEAN_COLOR) > 100
    assert color_pixels(png, report.RCP_MIN_COLOR) > 50
    assert color_pixels(png, report.RUNS_COLOR, tol=0.1) > 200  # dashed and antialiased
    md = (out / "summary.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| AMD |"))
    assert "| llama31_8b | reference | 10/10 | 99.7085 |" in row and "| Pass |" in row and "178,858.7" in row
    assert "Pass (interp.)" in md and "![llama31_8b-reference.png](llama31_8b-reference.png)" in md
    scores = json.loads((out / "scores.json").read_text())
    assert {r["benchmark"] for r in scores["results"]} == {"llama31_8b", "llama2_70b_lora"}


def test_tiny_report_with_and_without_an_rcp(tmp_path, monkeypatch):
    logs = tmp_path / "logs" / "llama31_8b" / "tiny"
    files = tiny_runs(logs, n=10, aborted=(2,))
    monkeypatch.setattr(rcp, "_RCP_DIR", tmp_path / "rcps")
    first = report.make_report(tmp_path / "logs", tmp_path / "r1")
    (s,) = first.scores
    assert s.rcp.verdict == "Missing" and s.score_minutes is not None
    assert color_pixels(first.plots[0], report.RCP_MEAN_COLOR) == 0  # nothing to mark
    # Ship an RCP for the tier (built from other seeds' runs) and the same runs get a verdict and marks.
    ref = tiny_runs(tmp_path / "ref", n=12, start_seed=900)
    (tmp_path / "rcps").mkdir()
    rcp.rcp_path("llama31_8b", "tiny").write_text(json.dumps(rcp.build_rcp_json("llama31_8b", "tiny", ref)))
    second = report.make_report(tmp_path / "logs", tmp_path / "r2")
    (s,) = second.scores
    assert s.rcp.verdict == "Pass" and s.rcp.rcp_mean is not None
    assert color_pixels(second.plots[0], report.RCP_MEAN_COLOR) > 100
    md = second.summary.read_text()
    assert "| timetotrain | test-box | llama31_8b | tiny | 9/10 |" in md
    assert "no: Failed checks for eval_accuracy" in md
    assert len(files) == 10


def test_report_out_must_be_a_folder(tmp_path, capsys):
    tiny_runs(tmp_path / "logs", n=3)
    (tmp_path / "file").write_text("x")
    assert ttt_main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "file")]) == 2
    assert "--out" in capsys.readouterr().err
    assert ttt_main(["report", str(tmp_path / "logs")]) == 2  # --out is required, unless --html
    assert "--out is required" in capsys.readouterr().err


def _summarizer_benchmarks() -> set[str]:
    from mlperf_logging.benchmark_meta import get_allowed_benchmarks

    return {b for rs in ("5.0.0", "5.1.0", "6.0.0") for b in get_allowed_benchmarks("training", rs)}


def test_reference_plots_have_a_target_line_for_every_benchmark_the_summarizer_knows():
    for b in _summarizer_benchmarks():
        target = report.target_of(b, "reference")
        if b == "stable_diffusion":  # FID and CLIP together: no single line to draw
            assert target is None
            continue
        assert target is not None and target == official.get(b).target, b
    assert report.target_of("retinanet", "reference") == 0.34
    assert report.target_of("retinanet", "tiny") is None  # a closed target says nothing of other tiers
    assert report.target_of("llama31_8b", "tiny") == registry.get("llama31_8b").tiers["tiny"].target


def test_legend_numbers_are_rounded_by_magnitude():
    assert report.point_label(0.7888888) == "0.7889"  # an epoch RCP mean, not "1"
    assert report.point_label(4.0) == "4"
    assert report.point_label(345.678) == "345.7"
    assert report.point_label(178_858.7) == "178,859"
    assert report.point_label(3_840) == "3,840"


def test_every_benchmark_has_a_descriptive_y_label():
    for b in _summarizer_benchmarks() | set(official.names()):
        label = report.metric_label(b)
        facts = official.get(b)
        assert label.startswith("eval_accuracy: ") and facts.metric_label in label, b
        if facts.target is not None:
            assert label.endswith("higher is better" if facts.higher_is_better else "lower is better")
    assert report.metric_label("stable_diffusion") == "eval_accuracy: FID (<= 90) and CLIP score (>= 0.15)"
    assert "log perplexity" in report.metric_label("llama31_8b")
    assert report.metric_label("retinanet") == "eval_accuracy: mAP, higher is better"
    assert report.metric_label("not_a_benchmark") == "eval_accuracy"


def test_epoch_benchmark_plot_shows_target_and_unrounded_rcp_marks(tmp_path, monkeypatch):
    """rgat counts convergence in epochs (RCP mean 0.7889 at BS 4096, ruleset 5.1.0): the plot of its
    runs gets the 0.72 target line, legend values to 4 digits and epoch/accuracy axis labels."""
    import matplotlib.figure

    folder = tmp_path / "logs" / "rgat"
    for i in range(10):
        rcp_only_log(folder / f"result_{i}.txt", "rgat", 4096, 0.78 + 0.01 * (i % 5), key="epoch_num")
    figs = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (figs.append(fig), save(fig, *a, **k))[1]
    )
    (s,) = report.make_report(tmp_path / "logs", tmp_path / "r", "5.1.0").scores
    assert s.rcp.verdict == "Pass" and 0.78 < s.rcp.rcp_mean < 0.79
    (fig,) = figs
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "target 0.72" in labels
    assert f"RCP mean {s.rcp.rcp_mean:.4g}" in labels and "RCP mean 1" not in labels
    assert any(lb.startswith("RCP min 0.") for lb in labels)
    assert any(lb.startswith("runs' olympic mean 0.") for lb in labels)
    full = fig.axes[0]
    assert full.get_xlabel() == "training epochs"
    assert full.get_ylabel() == "eval_accuracy: node classification accuracy, higher is better"
    assert any(
        len(set(line.get_ydata())) == 1 and line.get_ydata()[0] == 0.72 for line in full.get_lines()
    )  # the target is drawn, not only listed
    # The tables count in epochs too: a run's 0.78 epochs is not "1" and the RCP mean is not "0.8".
    from timetotrain.report.html import render

    first = s.runs[0].samples_to_converge
    assert 0.7 < first < 0.9
    for text in ((tmp_path / "r" / "summary.md").read_text(), render(tmp_path / "logs", "5.1.0")):
        assert f"{first:.3f} epochs" in text and f"{s.rcp.rcp_mean:.4f} epochs" in text
        assert f"{s.samples_to_converge:.4f} epochs" in text and "samples to converge" not in text


def _drawn_figures(monkeypatch) -> list:
    import matplotlib.figure

    figs = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (figs.append(fig), save(fig, *a, **k))[1]
    )
    return figs


def _touching_labels(ax) -> list[tuple[str, str]]:
    """Neighbouring x tick labels, among those inside the axis limits, whose boxes touch or overlap."""
    lo, hi = sorted(ax.get_xlim())
    shown = [
        t
        for t, x in zip(ax.get_xticklabels(), ax.get_xticks(), strict=True)
        if t.get_text() and lo <= x <= hi
    ]
    shown.sort(key=lambda t: t.get_window_extent().x0)
    return [
        (a.get_text(), b.get_text())
        for a, b in zip(shown, shown[1:], strict=False)
        if a.get_window_extent().x1 >= b.get_window_extent().x0
    ]


@pytest.mark.parametrize(
    "bench,gbs,every,first,target",
    [
        ("flux1", 1024, 262_144, 31, 0.586),  # ~8.4 M samples: 9-10 digit labels in the narrow zoom panel
        ("llama31_405b", 1152, 46_080, 6, 5.6),
    ],
)
def test_tick_labels_do_not_overlap(tmp_path, monkeypatch, bench, gbs, every, first, target):
    for i in range(10):  # convergence spread over a few eval points, as real runs are
        curve_log(
            tmp_path / "logs" / f"result_{i}.txt", bench, gbs, every, every * (first + (i * 3) % 7), target
        )
    figs = _drawn_figures(monkeypatch)
    report.make_report(tmp_path / "logs", tmp_path / "r", "5.1.0")
    (fig,) = figs
    fig.canvas.draw()
    for ax in fig.axes:
        assert len([t for t in ax.get_xticklabels() if t.get_text()]) >= 3
        assert _touching_labels(ax) == [], ax.get_xlabel()


def test_systems_sharing_a_benchmark_get_plots_named_by_system(tmp_path):
    """The names depend on the groups, not on which folder sorts first."""
    for folder, box in (("z", "box-a"), ("a", "box-b")):
        for log in tiny_runs(tmp_path / "logs" / folder, n=3):
            log.write_text(log.read_text().replace('"test-box"', f'"{box}"'))
    tier_log(tmp_path / "logs" / "gpt" / "result_0.txt", 1, 640, 2.0, benchmark="gpt_oss_20b")
    rep = report.make_report(tmp_path / "logs", tmp_path / "r")
    assert sorted(p.name for p in rep.plots) == [
        "gpt_oss_20b-tiny.png",  # alone: the short name
        "llama31_8b-tiny-timetotrain-box_a.png",
        "llama31_8b-tiny-timetotrain-box_b.png",
    ]
    assert {s.system: p.name for s, p in zip(rep.scores, rep.plots, strict=True)}["box-a"].endswith(
        "box_a.png"
    )


def test_a_grpo_run_gets_its_reward_curve_beside_train_loss(tmp_path):
    """GRPO logs carry a per-step `ttt_rollout_stats` beside `train_loss`: the report draws both, per run,
    in `<name>-training.png` and in the HTML page's training chart, with the values the logs hold."""
    logs = tmp_path / "logs" / "qwen35_397b_grpo" / "tiny"
    gbs = registry.get("qwen35_397b_grpo").tier("tiny").global_batch_size
    for i in range(2):
        tier_log(
            logs / f"result_{i}.txt", 100 + i, 640, 0.4, benchmark="qwen35_397b_grpo", steps=grpo_steps(i)
        )
    tiny_runs(tmp_path / "logs" / "llama31_8b" / "tiny", n=1)  # no per-step lines: no training plot
    rep = report.make_report(tmp_path / "logs", tmp_path / "r")
    by_bench = {s.benchmark: t for s, t in zip(rep.scores, rep.training_plots, strict=True)}
    assert by_bench["llama31_8b"] is None
    png = by_bench["qwen35_397b_grpo"]
    assert png.name == "qwen35_397b_grpo-tiny-training.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"![{png.name}]({png.name})" in rep.summary.read_text()
    # Two panels, each with both runs' lines: the default cycle's first colour (run 0) in each half,
    # above the legend.
    img = require("matplotlib.image").imread(png)[:-80, :, :3]
    half = img.shape[1] // 2
    rgb = np.array([0x1F, 0x77, 0xB4]) / 255
    hits = np.abs(img - rgb).max(axis=-1) < 0.04
    assert hits[:, :half].sum() > 200 and hits[:, half:].sum() > 200
    # The parsed series are the logged values, at their samples_count.
    steps = parse_log(logs / "result_1.txt").steps
    assert steps["reward"] == [(float(s), f["reward"]) for s, _, f in grpo_steps(1)]
    assert steps["train_loss"] == [(float(s), loss) for s, loss, _ in grpo_steps(1)]
    assert steps["zero_std_groups"][0] == (float(gbs), 0.25)
    # The page's training chart (tests/test_report_html.py draws it): train_loss and reward side by side,
    # one trace per run in each.
    groups = {g.benchmark: g for g in find_groups(tmp_path / "logs")}
    assert html.training_figure(groups["llama31_8b"]) is None
    fig = html.training_figure(groups["qwen35_397b_grpo"])
    lay = fig["layout"]
    assert "train_loss" in lay["yaxis"]["title"]["text"] and "reward" in lay["yaxis2"]["title"]["text"]
    assert lay["xaxis"]["domain"][1] < lay["xaxis2"]["domain"][0]
    rewards = [t for t in fig["data"] if t["yaxis"] == "y2"]
    assert [t["name"] for t in rewards] == [f"result_{i} (seed {100 + i})" for i in range(2)]
    assert rewards[1]["y"] == [f["reward"] for _, _, f in grpo_steps(1)]
    assert rewards[1]["x"] == [s for s, _, _ in grpo_steps(1)]
