"""`ttt score`: equal to the official result_summarizer on real v5.1 results; olympic rules; tier folders."""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import require, require_file, shared_data_dir
from fakelogs import tier_log, tiny_runs, ttt_main

from timetotrain.errors import UserError
from timetotrain.mlperf.score import olympic_score, score_tree

pytestmark = pytest.mark.parity

V51 = {"AMD": "llama31_8b", "NVIDIA": "llama2_70b_lora"}


@pytest.fixture(scope="module")
def v51_copy(tmp_path_factory):
    """A copy: the official summarizer rewrites scaling.json in the folders it checks."""
    src = require_file(shared_data_dir() / "mlperf_results_v5.1")
    dst = tmp_path_factory.mktemp("v51") / "mlperf_results_v5.1"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("summary.json"))
    return dst


def official_summary(org_dir, tmp_path):
    pd = require("pandas")
    out = tmp_path / "summary.csv"
    cmd = [
        sys.executable,
        "-m",
        "mlperf_logging.result_summarizer",
        str(org_dir),
        "training",
        "5.1.0",
        "--csv",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return pd.read_csv(out).iloc[0], pd.read_csv(tmp_path / "summary_detailed.csv").iloc[0]


@pytest.mark.parametrize("org", sorted(V51))
def test_score_equals_the_official_result_summarizer(v51_copy, tmp_path, org):
    bench = V51[org]
    ours = score_tree(v51_copy / org, "5.1.0")
    assert [(s.submitter, s.benchmark) for s in ours] == [(org, bench)]
    s = ours[0]
    row, detailed = official_summary(v51_copy / org, tmp_path)
    official = float(row[bench])
    print(f"{org} {bench}: ttt score {s.score_minutes!r}, official result_summarizer {official!r}")
    assert s.score_minutes == pytest.approx(official, rel=1e-9)
    assert s.global_batch_size == detailed[f"{bench}:GBS"]
    assert s.samples_to_converge == detailed[f"{bench}:samples_to_converge"]
    assert s.rcp.verdict == detailed[f"{bench}:RCP"] == "Pass"
    assert s.scaling_factor == detailed[f"{bench}:rcp_scaling_factor"]
    # The RCP factor the official check computes is the one the tree's scaling.json holds.
    assert s.rcp.norm_factor == pytest.approx(s.scaling_factor, rel=1e-12)
    assert all(r.compliant and r.converged for r in s.runs) and len(s.runs) == 10
    if org == "AMD":
        assert s.score_minutes == pytest.approx(99.70854353631518, rel=1e-12)  # data README


def test_json_output_and_nothing_written(v51_copy, capsys):
    before = sorted((p, p.stat().st_mtime_ns) for p in v51_copy.rglob("*"))
    assert ttt_main(["score", str(v51_copy), "--ruleset", "5.1.0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted(r["submitter"] for r in data["results"]) == ["AMD", "NVIDIA"]
    amd = next(r for r in data["results"] if r["submitter"] == "AMD")
    assert amd["system"] == "MI355X_EPYC_9575F_pytorch" and amd["benchmark"] == "llama31_8b"
    assert len(amd["runs"]) == 10 and {"minutes", "converged", "samples_to_converge", "seed"} <= set(
        amd["runs"][0]
    )
    assert amd["rcp"]["verdict"] == "Pass" and amd["rcp"]["rcp_mean"] == pytest.approx(178_858.67, abs=0.01)
    nv = next(r for r in data["results"] if r["submitter"] == "NVIDIA")
    assert nv["rcp"]["interpolated"] and nv["rcp"]["rcp_min"] == pytest.approx(6_705.4, abs=0.05)
    assert sorted((p, p.stat().st_mtime_ns) for p in v51_copy.rglob("*")) == before


def test_olympic_rules_equal_the_summarizer():
    from mlperf_logging.result_summarizer.result_summarizer import _compute_olympic_average

    times = [5.0, 3.0, 4.0, 9.0, 1.0, 2.0, 8.0, 7.0, 6.0, 10.0]
    assert olympic_score(times, 0) == 5.5
    assert (
        olympic_score(times[:9], 1) == _compute_olympic_average(times[:9], 1, 1) == 5.5
    )  # failed run = slowest
    assert olympic_score(times[:8], 2) is None
    assert olympic_score([3.0, 1.0, 2.0], 0) == 2.0  # 3-run benchmarks: the median
    assert olympic_score([3.0, 1.0], 1) == _compute_olympic_average([3.0, 1.0], 1, 1) == 3.0
    assert olympic_score([1.0, 2.0], 0) is None


def test_tiny_logdir_with_one_aborted_run(tmp_path, capsys):
    folder = tmp_path / "logs" / "llama31_8b" / "tiny"
    files = tiny_runs(folder, n=10, aborted=(4,))
    (s,) = score_tree(tmp_path / "logs")
    assert (s.benchmark, s.tier, s.system, s.division) == ("llama31_8b", "tiny", "test-box", "open")
    run4 = s.runs[4]
    assert not run4.compliant and not run4.converged and run4.samples_to_converge is None
    assert "eval_accuracy" in run4.problem
    minutes = sorted(r.minutes for r in s.runs if r.compliant)
    assert s.dropped == 1
    assert s.score_minutes == pytest.approx(sum(minutes[1:]) / 8, rel=1e-12)
    converged = [r.samples_to_converge for r in s.runs if r.converged]
    assert s.cv_samples == pytest.approx(
        __import__("numpy").std(converged, ddof=1) / __import__("numpy").mean(converged)
    )
    assert s.rcp.verdict in ("Missing", "Pass", "Fail")  # depends on whether the package ships a tiny RCP yet
    # A second failed run: no score, and the command says why.
    tier_log(files[5], 105, None, 1.0)
    (s,) = score_tree(tmp_path / "logs")
    assert s.score_minutes is None and any("at most 1" in n for n in s.notes)
    assert ttt_main(["score", str(tmp_path / "logs")]) == 1
    assert "score: none" in capsys.readouterr().out


def test_scaling_json_in_a_plain_folder(tmp_path):
    folder = tmp_path / "llama31_8b" / "tiny"
    tiny_runs(folder, n=10)
    (plain,) = score_tree(tmp_path)
    (folder / "scaling.json").write_text('{"scaling_factor": 1.25}')
    (scaled,) = score_tree(tmp_path)
    assert (
        scaled.score_minutes == plain.score_minutes * 1.25 and scaled.olympic_minutes == plain.olympic_minutes
    )


def test_bad_input_is_a_user_error(tmp_path, capsys):
    assert ttt_main(["score", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert ttt_main(["score", str(tmp_path)]) == 2
    assert "no result_*.txt" in capsys.readouterr().err
    with pytest.raises(UserError):
        score_tree(tmp_path)


def test_in_process_compliance_agrees_with_ttt_check(tmp_path):
    from timetotrain.mlperf.compliance import check_log
    from timetotrain.mlperf.results import official_compliance

    good, bad = tiny_runs(tmp_path, n=2, aborted=(1,))
    for path in (good, bad):
        ok, why = official_compliance(path, "6.0.0")
        assert ok == check_log(path).ok
        assert ok == (path == good) and (ok or "eval_accuracy" in why)


def test_rcp_line_prints_epochs_with_four_decimals_and_units():
    from timetotrain.mlperf.rcp import RcpResult
    from timetotrain.mlperf.score import rcp_line
    from timetotrain.spec import official

    epochs = RcpResult(
        "Pass",
        "RCP found",
        bs=256,
        rcp_mean=0.6920,
        rcp_min=0.6712,
        submission_mean=0.6875,
        unit=official.EPOCHS,
    )
    assert "runs 0.6875 vs RCP mean 0.6920, min 0.6712 epochs" in rcp_line(epochs)
    samples = RcpResult("Pass", "RCP found", bs=16, rcp_mean=1140.0, rcp_min=1083.6, submission_mean=1140.0)
    assert "runs 1,140.0 vs RCP mean 1,140.0, min 1,083.6 samples" in rcp_line(samples)
