"""RCPs: our implementation of the checker's algorithm against the official code and the MLPerf training rules'
numbers; the official checker on real v5.1 logs; RCP records built from tier runs."""

import itertools
import json
import math
import shutil
from types import SimpleNamespace

import pytest
from conftest import require_file, shared_data_dir
from fakelogs import rcp_only_log, tiny_runs

from timetotrain.errors import UserError
from timetotrain.mlperf.rcp import (
    RcpTable,
    build_rcp_json,
    check_reference,
    check_tier,
    min_acceptable_mean,
    official_rcp_path,
)
from timetotrain.mlperf.results import captured_logging, parse_log, result_files

pytestmark = pytest.mark.parity

RUNS = {
    "llama31_8b": 10,
    "gpt_oss_20b": 10,
    "deepseekv3_671b": 3,
    "llama31_405b": 3,
    "llama2_70b_lora": 10,
    "flux1": 10,
    "dlrm_dcnv2": 10,
    "rgat": 10,
    "bert": 10,
    "retinanet": 5,
}


def official_checker(bench, ruleset):
    from mlperf_logging.rcp_checker import rcp_checker

    with captured_logging():
        return rcp_checker.RCP_Checker("training", ruleset, bench, False)


def table(bench, ruleset="6.0.0"):
    return RcpTable.load(official_rcp_path(bench, ruleset), bench, RUNS[bench])


CASES = [
    (b, "6.0.0")
    for b in (
        "llama31_8b",
        "gpt_oss_20b",
        "deepseekv3_671b",
        "llama31_405b",
        "llama2_70b_lora",
        "flux1",
        "dlrm_dcnv2",
    )
]
CASES += [(b, "5.1.0") for b in ("llama31_8b", "llama2_70b_lora", "flux1", "rgat", "retinanet")]


@pytest.mark.parametrize("bench,ruleset", CASES)
def test_records_and_pruning_equal_the_official_checker(bench, ruleset):
    ours = table(bench, ruleset)
    theirs = official_checker(bench, ruleset)
    by_bs = {r["BS"]: r for r in theirs.rcp_data.values()}
    assert len(ours.records) == len(by_bs)
    for r in ours.records:
        o = by_bs[r.bs]
        # Same arithmetic, so the same bits: a submission on the boundary gets the same verdict.
        assert (r.mean, r.stdev, r.min_mean) == (o["RCP Mean"], o["RCP Stdev"], o["Min Epochs"])
    assert [r.bs for r in ours.pruned] == sorted(r["BS"] for r in theirs.pruned_rcp_data.values())
    # Interpolation at every midpoint between kept records.
    kept = sorted(theirs.pruned_rcp_data.values(), key=lambda r: r["BS"])
    for lo, hi in itertools.pairwise(kept):
        bs = (lo["BS"] + hi["BS"]) // 2
        how, rec = ours.lookup(bs)
        with captured_logging():
            _, o = theirs._create_interp_rcp(bs, lo, hi)
        assert how == "interpolated"
        assert (rec.mean, rec.stdev, rec.min_mean) == (o["RCP Mean"], o["RCP Stdev"], o["Min Epochs"])


# Spec §5.1 (ruleset 6.0.0): (benchmark, BS, how, RCP mean, minimum acceptable mean); the spec rounds
# to 0.1 or to whole samples.
SPEC = [
    ("llama31_8b", 16, "found", 161_109.3, 157_919.5),
    ("llama31_8b", 32, "found", 178_858.7, 173_649.8),
    ("llama31_8b", 128, "found", 344_746.7, 327_042.9),
    ("llama31_8b", 48, "interpolated", 202_752.0, 196_405.7),
    ("gpt_oss_20b", 32, "interpolated", 230_058.7, 222_720.8),  # its own record is pruned
    ("gpt_oss_20b", 48, "interpolated", 265_557.3, 256_614.1),
    ("deepseekv3_671b", 17_408, "interpolated", 813_824.0, 786_251.5),
    ("llama31_405b", 2_304, "found", 368_640.0, 340_640.1),
    ("llama2_70b_lora", 32, "interpolated", 5_065.1, 4_727.5),
    ("llama2_70b_lora", 64, "interpolated", 7_131.4, 6_705.4),
    ("flux1", 1_024, "interpolated", 8_247_827.0, 8_008_403.7),
    ("flux1", 3_072, "interpolated", 12_837_774.0, 12_409_091.9),
]


@pytest.mark.parametrize("bench,bs,how,mean,low", SPEC)
def test_spec_table(bench, bs, how, mean, low):
    got_how, rec = table(bench).lookup(bs)
    assert got_how == how
    assert rec.mean == pytest.approx(mean, abs=0.5)
    assert rec.min_mean == pytest.approx(low, abs=0.5)


def test_spec_missing_and_smaller_batch_cases():
    assert table("llama31_8b").lookup(256) == ("above", None)
    assert table("gpt_oss_20b").lookup(128) == ("above", None)
    how, rec = table("llama31_8b").lookup(8)
    assert how == "smaller-bs" and rec.bs == 16
    assert "gpt_oss_20b_ref_32" not in [r.name for r in table("gpt_oss_20b").pruned]


def test_min_acceptable_mean_is_the_t_test_boundary():
    from scipy import stats

    m = min_acceptable_mean(1000.0, 50.0, 18, 8)
    t, p = stats.ttest_ind_from_stats(m, 50.0, 18, 1000.0, 50.0, 8)
    assert t < 0 and p / 2 == pytest.approx(0.05, abs=1e-4)
    assert min_acceptable_mean(1000.0, 0.0, 18, 8) == 1000.0


# (BS, convergence points): each set lands in a different branch of the checker.
VERDICT_CASES = [
    (32, [178_858] * 10),  # found, pass, no normalization
    (32, [175_000] * 10),  # found, pass, normalized
    (32, [160_000] * 10),  # found, fail
    (48, [199_000] * 10),  # interpolated, pass
    (48, [150_000] * 10),  # interpolated, fail
    (8, [170_000] * 10),  # below the smallest RCP, slower: pass
    (8, [100_000] * 10),  # below the smallest RCP, faster: missing
    (512, [400_000] * 10),  # above the largest RCP: missing
    (32, [180_000] * 9 + [None]),  # one run failed: still comparable
    (32, [180_000] * 8 + [None, None]),  # two failed: insufficient convergence
]


@pytest.mark.parametrize("bs,points", VERDICT_CASES)
def test_verdicts_equal_the_official_check_directory(tmp_path, bs, points):
    from mlperf_logging.rcp_checker import rcp_checker

    for i, p in enumerate(points):
        rcp_only_log(tmp_path / f"result_{i}.txt", "llama31_8b", bs, p)
    logs = [parse_log(f) for f in result_files(tmp_path)]
    rcp_file = official_rcp_path("llama31_8b", "6.0.0")
    ours = check_tier("llama31_8b", "reference", logs, 10, rcp_file=rcp_file)
    with captured_logging(), open(rcp_file) as f:
        ok, msg, norm = rcp_checker.check_directory(
            str(tmp_path), "training", "6.0.0", False, False, rcp_file=f, rcp_pass="pruned_rcps"
        )
    assert ours.passed == ok
    assert ours.message == msg
    assert ours.norm_factor == norm
    # And the reference path (the official code itself) reads the same folder the same way.
    ref = check_reference(tmp_path, logs, "6.0.0")
    assert (ref.verdict, ref.message, ref.norm_factor) == (ours.verdict, ours.message, ours.norm_factor)
    if ours.rcp_mean is not None and ref.rcp_mean is not None:
        assert (ref.rcp_mean, ref.rcp_min) == (ours.rcp_mean, ours.rcp_min)


def test_official_checker_on_the_v51_amd_logs(tmp_path):
    src = require_file(
        shared_data_dir()
        / "mlperf_results_v5.1"
        / "AMD"
        / "results"
        / "MI355X_EPYC_9575F_pytorch"
        / "llama31_8b"
    )
    folder = tmp_path / "llama31_8b"
    shutil.copytree(src, folder)
    (folder / "scaling.json").unlink()
    logs = [parse_log(f) for f in result_files(folder)]
    res = check_reference(folder, logs, "5.1.0")
    assert res.verdict == "Pass" and res.message == "RCP found" and res.bs == 32
    assert res.rcp_mean == pytest.approx(178_858.67, abs=0.01)
    assert res.rcp_min == pytest.approx(173_649.76, abs=0.01)
    assert res.submission_mean == 178_144
    # The normalization factor the review committee wrote into scaling.json for this submission.
    assert res.norm_factor == json.loads((src / "scaling.json").read_text())["scaling_factor"]
    assert not (folder / "scaling.json").exists()  # the check wrote nothing


def test_build_rcp_json_round_trips_through_the_official_loader(tmp_path):
    from mlperf_logging.rcp_checker import rcp_checker

    files = tiny_runs(tmp_path / "runs", n=10)
    data = build_rcp_json("llama31_8b", "tiny", files)
    assert list(data) == ["llama31_8b_tiny_16"]
    rec = data["llama31_8b_tiny_16"]
    assert rec["Benchmark"] == "llama31_8b" and rec["BS"] == 16 and rec["Tier"] == "tiny"
    assert sorted(rec["Epochs to converge"]) == sorted(parse_log(f).converge_point for f in files)
    assert rec["Hyperparams"] == {
        "opt_base_learning_rate": 3e-3,
        "opt_learning_rate_warmup_samples": 20 * 16,
        "gradient_accumulation_steps": 1,
    }
    assert rec["Precision"] == "FP32" and rec["Platform"] == "test-box" and len(set(rec["Seeds"])) == 10
    path = tmp_path / "llama31_8b_tiny.json"
    path.write_text(json.dumps(data, indent=2))
    # The official checker loads our record like its own files.
    with captured_logging(), open(path) as f:
        official = rcp_checker.RCP_Checker("training", "6.0.0", "llama31_8b", False, rcp_file=f)
    ours = RcpTable.load(path, "llama31_8b", 10)
    (o,) = official.rcp_data.values()
    assert (ours.records[0].mean, ours.records[0].min_mean) == (o["RCP Mean"], o["Min Epochs"])
    # Runs like those the RCP came from pass it; runs converging much faster fail it.
    logs = [parse_log(f) for f in files]
    res = check_tier("llama31_8b", "tiny", logs, 10, rcp_file=path)
    assert res.verdict == "Pass" and res.rcp_mean == ours.records[0].mean
    fast_logs = [parse_log(f) for f in files]
    for lg in fast_logs:
        lg.converge_point = 960
    assert check_tier("llama31_8b", "tiny", fast_logs, 10, rcp_file=path).verdict == "Fail"


def test_build_rcp_json_refuses_bad_inputs(tmp_path):
    files = tiny_runs(tmp_path / "a", n=4, aborted=(1,))
    with pytest.raises(UserError, match="did not converge"):
        build_rcp_json("llama31_8b", "tiny", files)
    good = [files[0], files[2], files[3]]
    with pytest.raises(UserError, match="not llama31_8b tier reference"):
        build_rcp_json("llama31_8b", "reference", good)
    with pytest.raises(UserError, match="repeats seed"):
        build_rcp_json("llama31_8b", "tiny", good + [files[0]])
    with pytest.raises(UserError, match="at least 3"):
        build_rcp_json("llama31_8b", "tiny", good[:2])
    assert math.isfinite(build_rcp_json("llama31_8b", "tiny", good)["llama31_8b_tiny_16"]["BS"])


def test_tier_without_rcp_file_is_missing(tmp_path):
    logs = [parse_log(f) for f in tiny_runs(tmp_path, n=3)]
    res = check_tier("llama31_8b", "tiny", logs, 10, rcp_file=tmp_path / "none.json")
    assert res.verdict == "Missing" and "none.json" in res.message


def test_llama31_405b_allowance_in_the_official_path(tmp_path):
    # Spec §5.1: from ruleset 5.0.0 the 405b threshold is lowered by 46,080 samples (285,344.1 -> 239,264.1).
    for i, p in enumerate([250_000, 260_000, 270_000]):
        rcp_only_log(tmp_path / f"result_{i}.txt", "llama31_405b", 1152, p)
    logs = [parse_log(f) for f in result_files(tmp_path)]
    res = check_reference(tmp_path, logs, "6.0.0")
    assert res.verdict == "Pass" and res.submission_mean == 260_000  # the median of 3 runs
    assert res.rcp_min == pytest.approx(239_264.1, abs=0.05)


@pytest.mark.parametrize("bench", ["llama31_8b", "gpt_oss_20b"])
def test_shipped_tiny_rcp_is_official_format_and_judges_like_the_official_checker(bench):
    """The RCP files `ttt rcp build BENCH --tier tiny --runs 10` produced, as the package ships them."""
    from mlperf_logging.rcp_checker import rcp_checker

    from timetotrain.mlperf.rcp import rcp_path

    path = rcp_path(bench, "tiny")
    (rec,) = json.loads(path.read_text()).values()
    assert rec["BS"] == 16 and len(rec["Epochs to converge"]) == 10 and len(set(rec["Seeds"])) == 10
    with captured_logging(), open(path) as f:
        official = rcp_checker.RCP_Checker("training", "6.0.0", bench, False, rcp_file=f)
    (o,) = official.rcp_data.values()
    ours = RcpTable.load(path, bench, 10)
    assert (ours.records[0].mean, ours.records[0].min_mean) == (o["RCP Mean"], o["Min Epochs"])


def test_rcp_build_writes_to_the_working_folder_never_into_the_package(tmp_path, monkeypatch, capsys):
    """`ttt rcp build` without --out writes ./<bench>_<tier>_rcp.json (the runs here are fabricated logs put
    in place of the real ones), leaves the package's shipped RCP untouched, and refuses before any run to
    overwrite that file on a second call."""
    from fakelogs import tier_log

    from timetotrain import cli
    from timetotrain.cli import run as run_cli
    from timetotrain.mlperf.rcp import rcp_path

    shipped = rcp_path("llama31_8b", "tiny")
    before = shipped.read_bytes()
    made = []

    def fake_run_set(args, seeds, **fixed):
        made.append(seeds)
        out = []
        for i, seed in enumerate(seeds):
            log = tier_log(tmp_path / "logs" / f"result_{i}.txt", seed, 3200 + 320 * (i % 3), 1.0)
            out.append((seed, SimpleNamespace(status="success", log_path=log, exit_code=0)))
        return out

    monkeypatch.setattr(run_cli, "run_set", fake_run_set)
    monkeypatch.chdir(tmp_path)
    argv = ["rcp", "build", "llama31_8b", "--runs", "3", "--seed", "1", "--data", "d", "--logdir", "logs"]
    assert cli.main(argv) == 0
    written = tmp_path / "llama31_8b_tiny_rcp.json"
    doc = json.loads(written.read_text())
    assert [rec["BS"] for rec in doc.values()] == [16] and str(written) in capsys.readouterr().out
    assert shipped.read_bytes() == before
    assert cli.main(argv) == 2 and len(made) == 1  # refused before running anything
    assert "exists: pass --out FILE" in capsys.readouterr().err
    other = tmp_path / "elsewhere" / "x.json"
    assert cli.main([*argv, "--out", str(other)]) == 0 and other.is_file()
