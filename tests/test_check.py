"""`ttt check`: a log is judged by the rule file of the tier it claims (`ttt_tier`, none meaning
reference), so a log that names the wrong benchmark fails, and a log nothing can judge is a one-line
error naming it."""

import itertools

import pytest
import yaml
from conftest import strict_loads
from fakelogs import tier_log

from timetotrain.cli import main
from timetotrain.mlperf.compliance import hparam_violations, read_log_keys, rule_file
from timetotrain.mlperf.keys import config_keys, parallel_keys, submission_keys
from timetotrain.spec import registry

# Every tier of ours that has a rule file of ours.
TIERS = [(b, t) for b in registry.names() for t in registry.get(b).tiers if t != "reference"]


def check(capsys, path, *flags) -> tuple[int, str, str]:
    code = main(["check", str(path), *flags])
    out, err = capsys.readouterr()
    return code, out, err.strip()


def relabel(src, dst, benchmark):
    """The same log with another submission_benchmark, as a hand edit or a wrong launcher would make it."""
    old = f'"submission_benchmark", "value": "{read_log_keys(src)["submission_benchmark"]}"'
    text = src.read_text()
    assert old in text
    dst.write_text(text.replace(old, f'"submission_benchmark", "value": "{benchmark}"'))
    return dst


def logged(bench_name, tier_name, as_benchmark):
    bench = registry.get(bench_name)
    tier = bench.tiers[tier_name]
    keys = submission_keys(bench, tier, "org", "platform") + bench.hyperparameters(tier)
    # What every run logs after them (one process, fp32): required from 6.1 on (qwen35_397b_grpo tiny).
    keys += parallel_keys(None, tier.micro_batch_size) + config_keys(bench, tier)
    return [(k, as_benchmark if k == "submission_benchmark" else v) for k, v in keys]


@pytest.mark.parametrize("bench,tier", TIERS)
def test_each_tier_passes_its_own_rule_file(bench, tier):
    assert hparam_violations([rule_file(bench, tier)], logged(bench, tier, bench)) == []


@pytest.mark.parametrize("bench,tier", TIERS)
def test_each_rule_file_states_each_key_once(bench, tier):
    """The official engine keeps the last rule of a name and ignores the earlier ones: a second rule would
    be dead text that says something else (llama2_70b_lora tiny once held a stray eval_samples == 64)."""
    rules = yaml.safe_load(rule_file(bench, tier).read_text())
    names = [item["KEY"]["NAME"] for item in rules if "KEY" in item]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    assert all("REQ" in item["KEY"] for item in rules if "KEY" in item)


@pytest.mark.parametrize("src,dst", list(itertools.permutations(TIERS, 2)))
def test_a_tier_logged_as_another_benchmark_fails_that_rule_file(src, dst):
    """llama31_8b and gpt_oss_20b tiny log the same hyperparameters apart from the decay steps (which
    --set warmup_steps=0 makes equal too): `ttt_model` is what tells them apart."""
    (b_src, t_src), (b_dst, t_dst) = src, dst
    problems = hparam_violations([rule_file(b_dst, t_dst)], logged(b_src, t_src, b_dst))
    assert problems
    src_model = registry.get(b_src).model_key(registry.get(b_src).tiers[t_src])
    if src_model != registry.get(b_dst).model_key(registry.get(b_dst).tiers[t_dst]):
        # Each rule file requires its tier's ttt_model (test_rule_files.py names the one that does not).
        assert any(p.startswith("ttt_model") for p in problems), (
            f"{b_dst} {t_dst} checks no ttt_model",
            problems,
        )


def test_tiny_llama_log_claiming_gpt_oss_fails_its_rule_file(tmp_path, capsys):
    log = tier_log(tmp_path / "result_0.txt", 1, 640, 2.0)
    assert check(capsys, log)[0] == 0
    fake = relabel(log, tmp_path / "result_1.txt", "gpt_oss_20b")
    code, out, _ = check(capsys, fake)
    assert code == 1
    assert "gpt_oss_20b_tiny.yaml" in out  # judged by the rule file of the benchmark it claims
    assert "CHECK for 'ttt_model' failed" in out


def test_reference_log_claiming_another_benchmark_fails(tmp_path, capsys):
    """The official closed rules of llama31_8b and gpt_oss_20b differ only in the target (3.3 and
    3.34), so a converged llama31_8b log passes gpt_oss_20b's; the model it logged does not."""
    log = tier_log(tmp_path / "result_0.txt", 1, 3 * 12_288, 60.0, tier="reference")
    code, out, _ = check(capsys, log)
    assert code == 0, out
    fake = relabel(log, tmp_path / "result_1.txt", "gpt_oss_20b")
    code, out, _ = check(capsys, fake)
    assert code == 1
    finding, summary = out.rstrip().splitlines()[-2:]  # the official rules pass it; ttt's check does not
    assert finding.startswith(f"{fake}:") and "is not the gpt_oss_20b reference model" in finding
    assert "official mlperf_logging engine: PASS" in summary and summary.endswith(
        "ttt's own checks: FAIL, 1 finding)"
    )


@pytest.mark.parametrize(
    "claimed,tier,flags,needles",
    [
        ("foo", "tiny", [], ["submission_benchmark 'foo' of ttt_tier 'tiny' is not a timetotrain benchmark"]),
        ("foo", None, [], ["'foo' is not a benchmark of MLPerf Training 6.0.0"]),
        ("retinanet", None, [], ["'retinanet'", "--ruleset 5.1.0"]),
        (
            "gpt_oss_20b",
            None,
            ["--ruleset", "5.1.0"],
            ["'gpt_oss_20b' is not a benchmark of MLPerf Training 5.1.0"],
        ),
    ],
)
def test_a_benchmark_no_rule_file_covers_is_a_one_line_error(tmp_path, capsys, claimed, tier, flags, needles):
    log = tier_log(tmp_path / "result_0.txt", 1, 640, 2.0)
    text = relabel(log, tmp_path / "x.txt", claimed).read_text()
    if tier is None:  # no ttt_tier: a reference (official) log
        text = "".join(ln + "\n" for ln in text.splitlines() if '"ttt_tier"' not in ln)
    path = tmp_path / "result_9.txt"
    path.write_text(text)
    code, out, err = check(capsys, path, *flags)
    assert code == 2 and out == ""
    assert err.count("\n") == 0 and err.startswith(f"ttt: error: {path}"), err
    for n in needles:
        assert n in err


def test_a_tier_the_benchmark_lacks_is_a_one_line_error(tmp_path, capsys):
    log = tier_log(tmp_path / "result_0.txt", 1, 640, 2.0)
    log.write_text(
        log.read_text().replace('"key": "ttt_tier", "value": "tiny"', '"key": "ttt_tier", "value": "huge"')
    )
    code, _, err = check(capsys, log)
    assert (
        code == 2
        and err
        == f"ttt: error: {log}: ttt_tier 'huge' is not a tier of llama31_8b (its tiers: reference, tiny)"
    )


def test_a_relative_log_path_is_checked(tmp_path, capsys, monkeypatch):
    """The engine runs in a temporary folder: `ttt check out/.../result_0.txt` must still find the file."""
    tier_log(tmp_path / "out" / "result_0.txt", 5, 3200, 1.0)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "out/result_0.txt"]) == 0
    assert capsys.readouterr().out.startswith("PASS: out/result_0.txt")


def _cut(src, dst, keep, stop_status=None, signal=None):
    """`src`'s lines before the first line for which `keep` is False, then (with `stop_status`) a run_stop
    of that status, after a `ttt_stop_signal` line when `signal` is given: a run stopped early."""
    lines = src.read_text().splitlines()
    stop = next(ln for ln in lines if '"key": "run_stop"' in ln)
    head = list(itertools.takewhile(keep, lines))
    if signal:
        head.append(
            stop.replace('"key": "run_stop"', '"key": "ttt_stop_signal"').replace(
                '"value": null', f'"value": "{signal}"'
            )
        )
    if stop_status:
        head.append(stop.replace('"status": "success"', f'"status": "{stop_status}"'))
    dst.write_text("\n".join(head) + "\n")
    return dst


@pytest.mark.parametrize(
    "how,said",
    [
        (
            "before_eval",
            "this run stopped (aborted) at 3,840 samples before its first eval: no eval_accuracy",
        ),
        ("signal", "this run stopped (aborted, by SIGTERM) at 3,840 samples before its first eval"),
        ("truncated", "the log ends without run_stop (last record at line "),
        ("before_run_start", "the log ends before run_start: the run stopped during initialization"),
        (
            "short",
            "this run stopped (aborted) at 1,920 samples after 6 evals without reaching its target <= 4.8",
        ),
    ],
)
def test_a_run_that_stopped_early_is_said_in_user_terms_first(tmp_path, capsys, how, said):
    """The official engine says only which rule failed ("Required AT_LEAST_ONE occurrence of
    'eval_accuracy'"); `ttt check` says first how the run ended, then the engine's report."""
    ok = tier_log(tmp_path / "ok.txt", 5, 320 * 12, 1.0)
    path = tmp_path / "result_0.txt"
    no_eval = lambda ln: '"key": "block_stop"' not in ln  # noqa: E731
    if how == "before_eval":
        _cut(ok, path, no_eval, "aborted")
    elif how == "signal":
        _cut(ok, path, no_eval, "aborted", signal="SIGTERM")
    elif how == "truncated":
        _cut(ok, path, lambda ln: '"key": "run_stop"' not in ln)
    elif how == "before_run_start":
        _cut(ok, path, lambda ln: '"key": "run_start"' not in ln)
    else:
        tier_log(path, 5, None, 1.0)
    code, out, _ = check(capsys, path)
    assert code == 1
    assert out.startswith(f"{path}: {said}"), out
    if how in ("before_eval", "signal"):
        assert "Required AT_LEAST_ONE occurrence of 'eval_accuracy'" in out  # the engine's words, after ours
    code, out, _ = check(capsys, path, "--json")
    assert code == 1 and said in strict_loads(out)["run_ended"]


def test_a_converged_run_gets_no_stop_line(tmp_path, capsys):
    path = tier_log(tmp_path / "result_0.txt", 5, 320 * 12, 1.0)
    code, out, _ = check(capsys, path)
    assert code == 0 and out.startswith("PASS: ") and out.count("\n") == 1
    code, out, _ = check(capsys, path, "--json")
    assert strict_loads(out)["run_ended"] is None
