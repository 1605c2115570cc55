"""One RCP verdict vocabulary in ttt score, ttt report (markdown, PNG title, HTML) and ttt suite: fewer than 3
runs have no olympic mean to compare, which is "not enough runs (N of >= 3)" everywhere, coloured as neither
a pass nor a fail; never a Fail of a NaN mean."""

import warnings

import pytest
from fakelogs import rcp_only_log, tiny_runs

from timetotrain.cli.suite_driver import score_row
from timetotrain.markup import md
from timetotrain.mlperf.rcp import NOT_ENOUGH_RUNS, check_reference, official_rcp_path
from timetotrain.mlperf.results import captured_logging, parse_log, result_files
from timetotrain.mlperf.score import format_text, score_tree
from timetotrain.report import summary_markdown
from timetotrain.report.html import render
from timetotrain.spec import registry


@pytest.mark.parametrize("n", [1, 2])
def test_fewer_than_three_runs_read_the_same_everywhere(tmp_path, n):
    folder = tmp_path / "llama31_8b" / "tiny"
    tiny_runs(folder, n=n)
    (s,) = score_tree(tmp_path)
    want = f"not enough runs ({n} of >= 3)"
    assert (s.rcp.verdict, s.rcp.text(), s.rcp.kind, s.rcp.runs) == (NOT_ENOUGH_RUNS, want, "pending", n)
    assert s.rcp.rcp_mean is not None and s.rcp.submission_mean is None  # the RCP is there; the mean is not
    text = format_text([s])
    assert f"RCP: {want} - " in text and "Fail" not in text and "nan" not in text
    summary = summary_markdown([s], [tmp_path / "p.png"])
    assert f"| {md(want)} |" in summary and "Fail" not in summary
    page = render(tmp_path)
    assert f"<td class='pending'>not enough runs ({n} of &gt;= 3)</td>" in page
    row = score_row(registry.get("llama31_8b"), folder)
    assert row.rcp == want and "Fail" not in row.note


def test_three_runs_get_a_real_verdict(tmp_path):
    tiny_runs(tmp_path / "llama31_8b" / "tiny", n=3)
    (s,) = score_tree(tmp_path)
    assert s.rcp.verdict in ("Pass", "Fail") and s.rcp.runs == 3 and s.rcp.submission_mean is not None
    assert s.rcp.kind == s.rcp.verdict.lower()
    assert f"<td class='{s.rcp.kind}'>{s.rcp.text(short=True)}</td>" in render(tmp_path)


def test_reference_tier_one_run_is_not_enough_where_the_official_checker_says_fail(tmp_path):
    from mlperf_logging.rcp_checker import rcp_checker

    rcp_only_log(tmp_path / "result_0.txt", "llama31_8b", 32, 180_000)  # an RCP at BS 32 exists
    with captured_logging(), open(official_rcp_path("llama31_8b", "6.0.0")) as f, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's, of its mean of one run
        ok, msg, _ = rcp_checker.check_directory(
            str(tmp_path), "training", "6.0.0", False, False, rcp_file=f, rcp_pass="pruned_rcps"
        )
    assert (ok, msg) == (False, "RCP found")  # its verdict on a NaN mean
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = check_reference(tmp_path, [parse_log(p) for p in result_files(tmp_path)], "6.0.0")
    assert (res.verdict, res.runs, res.submission_mean) == (NOT_ENOUGH_RUNS, 1, None)
    assert res.rcp_mean is not None and "at least 3 runs" in res.message
    assert not caught  # numpy's warning about the NaN mean does not reach the user
