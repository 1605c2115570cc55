"""`ttt report`: one PNG per benchmark (runs, target, RCP marks) and the markdown score table."""

import json
import shutil

import numpy as np
import pytest
from conftest import require, require_file, shared_data_dir
from fakelogs import tiny_runs, ttt_main

from timetotrain import report
from timetotrain.mlperf import rcp


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
    with pytest.raises(SystemExit):
        ttt_main(["report", str(tmp_path / "logs")])  # --out is required
