"""`ttt report DIR --html`: one self-contained page, opened in headless Chromium with the network off.

The screenshot is kept as a test artifact: $TTT_TEST_ARTIFACTS/report-html.png (default
build/test-artifacts/report-html.png in the repository, which git ignores).
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO
from fakelogs import T0, grpo_steps, tier_log, tiny_runs, ttt_main

from timetotrain.report import html as report_html

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
GRPO = "chart-qwen35_397b_grpo-tiny-timetotrain-test_box"
# No network at all: every host resolves to nothing and any proxy use fails.
NO_NET = ["--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9", "--no-proxy-server=false"]


def artifacts_dir() -> Path:
    d = Path(os.environ.get("TTT_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def two_benchmarks(root: Path) -> None:
    """10 llama31_8b and 10 gpt_oss_20b tiny runs (one aborted, so one log fails compliance), 3
    qwen35_397b_grpo tiny runs with per-step lines (train_loss, the rollouts' reward), and two `ttt synth`
    summaries: llama31_8b (tokens) and flux1 (images, 2 ranks)."""
    tiny_runs(root / "llama31_8b" / "tiny", n=10, aborted=(2,))
    for i in range(10):
        tier_log(
            root / "gpt_oss_20b" / "tiny" / f"result_{i}.txt",
            300 + i,
            320 * (10 + (i * 3) % 5),
            1.0 + 0.03 * i,
            benchmark="gpt_oss_20b",
            start_ms=T0 + i * 600_000,
        )
    for i in range(3):
        tier_log(
            root / "qwen35_397b_grpo" / "tiny" / f"result_{i}.txt", 500 + i, 640, 0.5, benchmark="qwen35_397b_grpo",
            start_ms=T0 + i * 600_000, steps=grpo_steps(i),
        )  # fmt: skip
    synth = root / "synth" / "llama31_8b" / "tiny"
    synth.mkdir(parents=True)
    doc = {"benchmark": "llama31_8b", "tier": "tiny", "item": "tokens", "tokens_per_s": 12345.6,
           "samples_per_s": 48.2, "model_tflops_per_s": 0.12, "mfu": 0.081, "device": "cpu",
           "precision": "fp32", "peak_memory_bytes": 2**30}  # fmt: skip
    (synth / "summary_0.json").write_text(json.dumps(doc))
    flux = root / "synth" / "flux1" / "tiny"
    flux.mkdir(parents=True)
    doc = {"benchmark": "flux1", "tier": "tiny", "item": "images", "images_per_s": 20.5, "samples_per_s": 20.5,
           "model_tflops_per_s": 0.02, "mfu": 0.2, "device": "cpu", "precision": "fp32", "world_size": 2,
           "peak_memory_bytes": 3 * 2**29, "step_time_s": {"p50": 0.8},
           "per_rank": [{"rank": 0, "images_per_s": 10.0}, {"rank": 1, "images_per_s": 10.5}]}  # fmt: skip
    (flux / "summary_0.json").write_text(json.dumps(doc))


def chromium(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *NO_NET]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)


def chart_segments(dom: str) -> dict[str, str]:
    """The DOM text of each chart div, from its opening tag to the next chart's."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'<div id="(chart-[^"]+)"', dom)]
    return {
        cid: dom[pos : (starts[k + 1][0] if k + 1 < len(starts) else len(dom))]
        for k, (pos, cid) in enumerate(starts)
    }


def page_figures(text: str) -> dict:
    return json.loads(re.search(r"const FIGS = (.*?);\n", text).group(1).replace("<\\/", "</"))


def test_page_is_self_contained_and_small(tmp_path, capsys):
    two_benchmarks(tmp_path / "logs")
    page = tmp_path / "report.html"
    assert ttt_main(["report", str(tmp_path / "logs"), "--html", str(page)]) == 0
    assert "html:" in capsys.readouterr().out
    text = page.read_text()
    size = page.stat().st_size
    print(f"report.html for 2 benchmarks x 10 runs: {size:,} bytes")
    assert size < 5_000_000
    # Nothing is fetched: no script or stylesheet from elsewhere.
    assert not re.search(r"<script[^>]+src=", text) and "<link" not in text
    assert text.count("Plotly.newPlot") == 1 and "FAIL" in text and "PASS" in text
    figs = page_figures(text)
    assert set(figs) == {"chart-llama31_8b-tiny-timetotrain-test_box", "chart-gpt_oss_20b-tiny-timetotrain-test_box",
                         GRPO, GRPO + "-training", "chart-synth-llama31_8b", "chart-synth-flux1"}  # fmt: skip
    llama = figs["chart-llama31_8b-tiny-timetotrain-test_box"]["data"]
    names = [t["name"] for t in llama]
    assert sum(n.startswith("result_") for n in names) == 10
    assert any(n.startswith("target ") for n in names)  # no RCP shipped for a fabricated tier: none drawn


def test_report_html_without_results_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert ttt_main(["report", str(tmp_path / "empty"), "--html"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ttt: error:") and len(err.splitlines()) == 1


@pytest.mark.slow
def test_page_draws_in_headless_chromium_without_network(tmp_path):
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{CHROMIUM} missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} missing (apt-get install -y chromium)")
    two_benchmarks(tmp_path / "logs")
    page = report_html.write_html(tmp_path / "logs", tmp_path / "report.html")
    url = page.resolve().as_uri()
    figs = page_figures(page.read_text())
    # --virtual-time-budget lets the page's scripts run to the end before the DOM is dumped.
    dumped = chromium("--virtual-time-budget=20000", "--dump-dom", url)
    dom = dumped.stdout
    assert 'data-charts-drawn="6"' in dom, dumped.stderr[-2000:]
    charts = chart_segments(dom)
    for cid in ("chart-llama31_8b-tiny-timetotrain-test_box", "chart-gpt_oss_20b-tiny-timetotrain-test_box"):
        seg = charts[cid]
        assert seg.count('class="main-svg"') >= 2, cid  # plotly drew its SVG layers
        # One drawn scatter trace per run, the target line and each RCP mark the figure holds.
        expected = len(figs[cid]["data"])
        assert expected >= 11 and seg.count("trace scatter") == expected, cid
        assert len(re.findall(r'class="legendtext"[^>]*>result_\d+ \(seed', seg)) == 10, cid
        assert "target " in seg
    # GRPO's per-step chart: train_loss and the reward side by side, a line per run in each.
    seg = charts[GRPO + "-training"]
    assert seg.count("trace scatter") == 2 * 3 and len(figs[GRPO + "-training"]["data"]) == 6
    assert "train_loss" in seg and "reward (mean over" in seg
    assert len(re.findall(r'class="legendtext"[^>]*>result_\d+ \(seed', seg)) == 3  # one entry per run
    for cid in (
        "chart-synth-llama31_8b",
        "chart-synth-flux1",
    ):  # three panels: three bar traces, three y titles
        assert charts[cid].count("trace bars") == 3, cid
    assert (
        "throughput (images/s)" in charts["chart-synth-flux1"]
        and "peak memory (GiB)" in charts["chart-synth-flux1"]
    )
    shot = artifacts_dir() / "report-html.png"
    shot.unlink(missing_ok=True)
    chromium("--virtual-time-budget=20000", "--window-size=1400,2400", f"--screenshot={shot}", url)
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    shutil.copy(page, artifacts_dir() / "report.html")


def test_synth_section_per_benchmark_with_units_on_their_own_axes(tmp_path):
    """Per benchmark a table and a chart of three panels (throughput in its item/s, MFU %, peak memory GiB):
    quantities that share no scale are never bars on one axis pair."""
    two_benchmarks(tmp_path)
    text, figs = report_html._synth_section(report_html.synth_summaries(tmp_path))
    assert set(figs) == {"chart-synth-llama31_8b", "chart-synth-flux1"}
    flux = figs["chart-synth-flux1"]
    per_s, mfu, mem = flux["data"]
    assert [(t["xaxis"], t["yaxis"]) for t in flux["data"]] == [("x", "y"), ("x2", "y2"), ("x3", "y3")]
    lay = flux["layout"]
    assert (
        lay["xaxis"]["domain"][1]
        < lay["xaxis2"]["domain"][0]
        < lay["xaxis2"]["domain"][1]
        < lay["xaxis3"]["domain"][0]
    )
    assert not any("overlaying" in lay[f"yaxis{k}"] for k in ("", "2", "3"))
    titles = [lay[f"yaxis{k}"]["title"]["text"] for k in ("", "2", "3")]
    assert titles == ["throughput (images/s)", "MFU (% of the device's peak)", "peak memory (GiB)"]
    assert (per_s["y"], mfu["y"], mem["y"]) == ([20.5], [20.0], [1.5])
    assert figs["chart-synth-llama31_8b"]["layout"]["yaxis"]["title"]["text"] == "throughput (tokens/s)"
    # The tables: one per benchmark, units in the headers, the spread over ranks where there are several.
    assert text.count("<table class='synth'") == 2 and "<th>throughput (images/s)</th>" in text
    assert "10 to 10.5 images/s over 2 ranks" in text and "<th>peak memory (GiB)</th>" in text


def test_verdict_cells_take_the_vocabulary_colour(tmp_path):
    """One run: "not enough runs (1 of >= 3)" in the pending colour, neither the pass nor the fail one."""
    tiny_runs(tmp_path / "llama31_8b" / "tiny", n=1)
    text = report_html.render(tmp_path)
    assert "<td class='pending'>not enough runs (1 of &gt;= 3)</td>" in text
    colours = dict(re.findall(r"td\.(pass|fail|pending) \{ color: (#[0-9a-f]+)", text))
    assert len(set(colours.values())) == 3, colours
