"""ttt's own checks of a log (mlperf/structure.py), beside the official engine's verdict: logs no submitter
would send, which the engine passes, FAIL `ttt check` with a finding naming the file and line; the
official verdict is still shown; real logs and the logs `ttt run` writes pass both."""

import json

import pytest
from conftest import require_file, shared_data_dir
from fakelogs import tier_log, tiny_runs, ttt_main

from timetotrain.cli import main
from timetotrain.mlperf.structure import check_structure
from timetotrain.spec import registry


def _records(path):
    return [json.loads(ln.split(":::MLLOG ", 1)[1]) for ln in path.read_text().splitlines()]


def _write(path, recs):
    path.write_text("".join(":::MLLOG " + json.dumps(r) + "\n" for r in recs))
    return path


def _index(recs, key):
    return next(i for i, r in enumerate(recs) if r["key"] == key)


def _status(rec, status):
    return dict(rec, metadata=dict(rec["metadata"], status=status))


# Each malformed log: how it is made from a good one (records -> records, and the index of the line the
# finding names, 0-based) and what the finding says.
def _second_run_start(recs):
    i = _index(recs, "run_start")
    return recs[: i + 1] + [dict(recs[i], time_ms=recs[i]["time_ms"] + 1)] + recs[i + 1 :], i + 1


def _second_run_stop(recs):
    stop = recs[-1]
    return recs + [_status(dict(stop, time_ms=stop["time_ms"] + 5), "aborted")], len(recs)


def _misspelt_status(recs):
    return recs[:-1] + [_status(recs[-1], "sucess")], len(recs) - 1


def _aborted_at_target(recs):
    return recs[:-1] + [_status(recs[-1], "aborted")], len(recs) - 1


def _insert_after(key, value):
    def make(recs):
        i = _index(recs, key)
        return recs[: i + 1] + [dict(recs[i], value=value)] + recs[i + 1 :], i + 1

    return make


CASES = {
    "second_run_start": (_second_run_start, "run_start again (first at line {first})"),
    "second_run_stop": (_second_run_stop, "run_stop again (first at line {first})"),
    "misspelt_status": (_misspelt_status, "run_stop status 'sucess' is not one of success, aborted"),
    "aborted_at_target": (_aborted_at_target, "run_stop status 'aborted', but eval_accuracy 4.8 at line"),
    "second_seed": (_insert_after("seed", 2), "seed 2 contradicts 1 at line {first}"),
    # micro_batch_size is not EXACTLY_ONE in the rules, so the engine passes a repeat of any value
    "conflicting_key": (
        _insert_after("micro_batch_size", 8),
        "micro_batch_size 8 contradicts 16 at line {first}",
    ),
}


@pytest.fixture
def good(tmp_path):
    return tier_log(tmp_path / "good" / "result_0.txt", 1, 640, 2.0)


@pytest.mark.parametrize("case", list(CASES))
def test_a_log_no_submitter_would_send_fails_ttt_check_beside_the_official_pass(tmp_path, capsys, good, case):
    make, needle = CASES[case]
    recs, at = make(_records(good))
    path = _write(tmp_path / "result_0.txt", recs)
    code = main(["check", str(path)])
    out = capsys.readouterr().out.rstrip().splitlines()
    assert code == 1
    finding, summary = out[-2:]
    first = at  # the line the repeat repeats (1-based: the record before the inserted one)
    assert finding.startswith(f"{path}:{at + 1}: " + needle.format(first=first)), finding
    assert summary == (
        f"FAIL: {path} (official mlperf_logging engine: PASS, rules: "
        f"{registry.get('llama31_8b').rules_dir / 'llama31_8b_tiny.yaml'}; ttt's own checks: FAIL, 1 finding)"
    )


def test_check_json_shows_both_verdicts_and_the_finding_lines(tmp_path, capsys, good):
    recs, at = _insert_after("seed", 2)(_records(good))
    path = _write(tmp_path / "result_0.txt", recs)
    assert main(["check", str(path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["verdict"], doc["ok"], doc["official_verdict"], doc["ttt_verdict"]) == (
        "FAIL",
        False,
        "PASS",
        "FAIL",
    )
    assert doc["ttt_findings"] == [
        {"line": at + 1, "what": f"seed 2 contradicts 1 at line {at}: a run has one seed"}
    ]


# The tiers whose logs fakelogs writes as the loop would (token windows, a falling metric); the logs of real
# runs of the others pass `ttt check` in their end-to-end tests (test_dlrm_dcnv2_tiny, test_rgat_tiny, ...).
FAKEABLE = [
    (b, t)
    for b in registry.names()
    for t, v in registry.get(b).tiers.items()
    if hasattr(v.data, "seq_len") and not registry.get(b).task.metric.higher_is_better
]


@pytest.mark.parametrize("bench,tier", FAKEABLE)
@pytest.mark.parametrize("converged", [True, False])
def test_the_logs_ttt_run_writes_pass(tmp_path, bench, tier, converged):
    t = registry.get(bench).tiers[tier]
    log = tier_log(
        tmp_path / "result_0.txt",
        1,
        3 * t.eval_every_samples if converged else None,
        1.0,
        benchmark=bench,
        tier=tier,
    )
    assert check_structure(log) == []


def test_published_results_pass():
    root = require_file(shared_data_dir() / "mlperf_results_v5.1")
    logs = sorted(root.rglob("result_*.txt"))
    assert len(logs) >= 20
    assert {str(p): check_structure(p) for p in logs} == {str(p): [] for p in logs}


def test_success_needs_the_target_and_stops_at_the_first_eval_meeting_it(tmp_path):
    # Converged at the second of three evals: the third is past the target, run_stop then claims nothing new.
    late = tier_log(tmp_path / "late.txt", 1, 960, 1.0, curve=lambda k, n: [5.0, 4.7, 4.6][k])
    evals = [i for i, r in enumerate(_records(late)) if r["key"] == "eval_accuracy"]
    (f,) = check_structure(late)
    assert (f.line, f.what) == (
        evals[2] + 1,
        f"eval_accuracy after the target was met at line {evals[1] + 1} (4.7 <= 4.8): "
        "a run stops at the first eval that meets its target",
    )
    # success, though no eval meets the target
    recs = _records(tier_log(tmp_path / "never.txt", 1, None, 1.0))
    path = _write(tmp_path / "claims.txt", recs[:-1] + [_status(recs[-1], "success")])
    (f,) = check_structure(path)
    assert f.line == len(recs) and f.what.startswith(
        "run_stop says success, but no eval_accuracy meets the target <= 4.8"
    )


def test_a_target_set_with_ttt_set_is_the_target(tmp_path):
    """`--set target=4.9` (logged in `ttt_set`): a success at 4.85 is a success; the same log without the
    key claims a success the tier's 4.8 does not grant."""
    recs = _records(tier_log(tmp_path / "a.txt", 1, 640, 1.0, curve=lambda k, n: [5.0, 4.85][k]))
    i = _index(recs, "ttt_tier")
    sets = dict(recs[i], key="ttt_set", value=["target=4.9"])
    path = _write(tmp_path / "set.txt", recs[: i + 1] + [sets] + recs[i + 1 :])
    assert check_structure(path) == []
    plain = _write(tmp_path / "plain.txt", recs)
    assert [f.what.split(",")[0] for f in check_structure(plain)] == ["run_stop says success"]


def test_fail_is_a_status_only_where_the_reference_logs_it(tmp_path):
    """llama2_70b_lora's reference ends an exhausted run with status "fail"; llama31_8b's never."""
    recs = _records(tier_log(tmp_path / "a.txt", 1, None, 1.0, curve=lambda k, n: 6.0))
    for bench, ok in (("llama2_70b_lora", True), ("llama31_8b", False)):
        relabelled = [dict(r, value=bench) if r["key"] == "submission_benchmark" else r for r in recs[:-1]]
        path = _write(tmp_path / f"{bench}.txt", relabelled + [_status(recs[-1], "fail")])
        assert (check_structure(path) == []) == ok, bench


def test_score_scores_as_the_summarizer_and_warns_what_ttt_check_fails(tmp_path, capsys):
    folder = tmp_path / "logs"
    logs = tiny_runs(folder, n=3)
    recs, at = _insert_after("seed", 2)(_records(logs[0]))
    seed = recs[at - 1]["value"]
    _write(logs[0], recs)
    capsys.readouterr()
    assert ttt_main(["score", str(folder), "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"ttt: warning: {logs[0]}: fails ttt's checks: line {at + 1}: seed 2 contradicts {seed} at line {at}: "
        "a run has one seed\n"
    )
    (s,) = json.loads(out)["results"]
    assert [r["compliant"] for r in s["runs"]] == [True, True, True]  # the official engine's verdict
