"""`ttt package`: the tree the official package checker reads; the v5.1 AMD results pass it."""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import require_file, shared_data_dir
from fakelogs import T0, tier_log, ttt_main

from timetotrain.mlperf.package import REQUIRED_FIELDS, TODO, check_package
from timetotrain.mlperf.results import parse_log

pytestmark = pytest.mark.e2e

AMD_SYSTEM = "MI355X_EPYC_9575F_pytorch"


@pytest.mark.slow
def test_amd_v51_package_passes_the_official_checker(tmp_path, capsys):
    amd = require_file(shared_data_dir() / "mlperf_results_v5.1" / "AMD")
    out = tmp_path / "AMD"
    argv = ["package", "--org", "AMD", "--system", AMD_SYSTEM, "--results", str(amd / "results")]
    argv += ["--out", str(out), "--system-json", str(amd / "systems" / f"{AMD_SYSTEM}.json")]
    assert ttt_main(argv + ["--check", "--ruleset", "5.1.0"]) == 0, capsys.readouterr().out[-3000:]
    printed = capsys.readouterr().out
    assert "official package checker (5.1.0): PASS" in printed
    files = sorted(p.name for p in (out / "results" / AMD_SYSTEM / "llama31_8b").glob("result_*.txt"))
    assert files == [f"result_{i}.txt" for i in range(10)]
    assert json.loads((out / "systems" / f"{AMD_SYSTEM}.json").read_text()) == json.loads(
        (amd / "systems" / f"{AMD_SYSTEM}.json").read_text()
    )
    # Copied in run_start order, so the seeds of run_and_time.sh follow the same order.
    logs = [parse_log(out / "results" / AMD_SYSTEM / "llama31_8b" / f) for f in files]
    starts = [lg.run_start_ms for lg in logs]
    assert starts == sorted(starts)
    script = (
        out / "benchmarks" / "llama31_8b" / "implementations" / "timetotrain" / "run_and_time.sh"
    ).read_text()
    assert "for SEED in " + " ".join(str(lg.seed) for lg in logs) + ";" in script
    assert "ttt run llama31_8b --tier reference" in script and "--set global_batch_size=32" in script
    ok, output = check_package(out, "5.1.0")
    print("\n".join(output.splitlines()[-6:]))
    assert ok


def _tiny_logs(folder, n=10):
    # Written newest first, so the package has to reorder them by run_start.
    return [
        tier_log(folder / f"result_{i}.txt", 300 + i, 320 * 12, 1.0 + i / 10, start_ms=T0 - i * 600_000)
        for i in range(n)
    ]


def test_host_filled_package_of_tiny_logs(tmp_path, capsys):
    from mlperf_logging.system_desc_checker.system_desc_checker import check_system_desc

    from timetotrain.mlperf.results import captured_logging

    _tiny_logs(tmp_path / "logs" / "llama31_8b" / "tiny")
    out = tmp_path / "pkg" / "ttt"
    argv = [
        "package",
        "--org",
        "ttt",
        "--system",
        "cpu_box",
        "--results",
        str(tmp_path / "logs"),
        "--out",
        str(out),
    ]
    assert ttt_main(argv) == 0
    printed = capsys.readouterr().out
    desc_path = out / "systems" / "cpu_box.json"
    desc = json.loads(desc_path.read_text())
    assert set(REQUIRED_FIELDS) <= set(desc)
    assert desc["submitter"] == "ttt" and desc["division"] == "open" and desc["system_name"] == "cpu_box"
    assert int(desc["host_processor_vcpu_count"]) >= 1 and desc["framework"].startswith("PyTorch ")
    todo = [k for k, v in desc.items() if str(v).startswith(TODO)]
    assert "status" in todo and "cooling" in todo
    for k in todo:
        assert f"  {k}\n" in printed  # every field left to the user is listed
    assert "not closed MLPerf results" in printed
    # The official system description checker rejects the TODO status, and accepts a chosen one.
    with captured_logging():
        assert not check_system_desc(str(desc_path), "training", "6.0.0")[0]
        desc["status"] = "Research, Development, or Internal (RDI)"
        desc_path.write_text(json.dumps(desc))
        assert check_system_desc(str(desc_path), "training", "6.0.0")[0]
    results = out / "results" / "cpu_box" / "llama31_8b"
    seeds = [parse_log(results / f"result_{i}.txt").seed for i in range(10)]
    assert seeds == list(range(309, 299, -1))  # oldest run first
    impl = out / "benchmarks" / "llama31_8b" / "implementations" / "timetotrain"
    script = impl / "run_and_time.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "for SEED in " + " ".join(map(str, seeds)) + ";" in text
    assert "ttt run llama31_8b --tier tiny" in text and "--set" not in text
    assert "run_and_time.sh" in (impl / "README.md").read_text()


def test_tiny_package_fails_the_official_checker_as_documented(tmp_path):
    _tiny_logs(tmp_path / "logs")
    out = tmp_path / "ttt"
    assert (
        ttt_main(
            [
                "package",
                "--org",
                "ttt",
                "--system",
                "box",
                "--results",
                str(tmp_path / "logs"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    ok, output = check_package(out, "6.0.0")
    assert not ok
    # docs/submission.md: open_llama31_8b.yaml's placeholder target rejects every file, and the TODO status.
    assert "Failed checks for eval_accuracy : v['value'] < 1.0" in output
    assert "10 files do not comply" in output
    assert "Field status contains a non valid value" in output


def test_never_overwrites_and_rejects_ambiguous_results(tmp_path, capsys):
    _tiny_logs(tmp_path / "logs" / "a" / "llama31_8b" / "tiny", n=3)
    _tiny_logs(tmp_path / "logs" / "b" / "llama31_8b" / "tiny", n=3)
    out = tmp_path / "out"
    out.mkdir()
    base = ["package", "--org", "o", "--system", "s", "--results", str(tmp_path / "logs")]
    assert ttt_main(base + ["--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert list(out.iterdir()) == []
    assert ttt_main(base + ["--out", str(tmp_path / "new")]) == 2
    assert "point --results at one of them" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert ttt_main(base + ["--out", str(tmp_path / "x"), "--tier", "small"]) == 2
    assert "no result files of tier 'small'" in capsys.readouterr().err
    assert (
        ttt_main(
            [
                "package",
                "--org",
                "o",
                "--system",
                "s",
                "--results",
                str(tmp_path / "missing"),
                "--out",
                str(tmp_path / "y"),
            ]
        )
        == 2
    )


@pytest.mark.parametrize("flag,value", [("--org", "a/b"), ("--system", "")])
def test_names_must_be_folder_names(tmp_path, capsys, flag, value):
    _tiny_logs(tmp_path / "logs", n=3)
    argv = {"--org": "o", "--system": "s"}
    argv[flag] = value
    cmd = [
        "package",
        "--org",
        argv["--org"],
        "--system",
        argv["--system"],
        "--results",
        str(tmp_path / "logs"),
        "--out",
        str(tmp_path / "o"),
    ]
    assert ttt_main(cmd) == 2
    assert flag in capsys.readouterr().err


def test_check_with_a_relative_out(tmp_path, capsys, monkeypatch):
    """The official checker runs in a temporary cwd; a relative OUT must still reach it."""
    _tiny_logs(tmp_path / "logs", n=3)
    monkeypatch.chdir(tmp_path)
    base = ["package", "--org", "o", "--system", "s", "--results", "logs", "--out", "pkg/o", "--check"]
    assert ttt_main(base) == 1  # tiny logs fail it, as documented
    out = capsys.readouterr().out
    assert "No such file or directory" not in out and "Traceback" not in out
    assert "3 files do not comply" in out  # it read pkg/o/results/s/llama31_8b
    assert "official package checker (6.0.0): FAIL" in out


def _damage(folder, how):
    """Three good tiny logs and a fourth result_3.txt damaged as `how` says."""
    logs = _tiny_logs(folder, n=3)
    text = logs[0].read_text()
    bad = folder / "result_3.txt"
    if how == "foreign":
        bad.write_text("loss 2.31 at step 10\nloss 2.05 at step 20\n")
    elif how == "other_benchmark":
        other = tier_log(folder / "x.txt", 7, 320 * 12, 1.0, benchmark="gpt_oss_20b")
        other.rename(bad)
    elif how == "truncated":
        bad.write_text(text[: text.index('"key": "run_start"') + 200].rsplit("\n", 1)[0] + "\n")
    elif how == "two_run_starts":  # as logs that write run_start once per rank
        lines = text.splitlines()
        i = next(k for k, ln in enumerate(lines) if '"key": "run_start"' in ln)
        bad.write_text("\n".join(lines[: i + 1] + lines[i:]) + "\n")
    elif how == "second_run":  # two runs' logs in one file
        lines = text.splitlines()
        i = next(k for k, ln in enumerate(lines) if '"key": "run_start"' in ln)
        bad.write_text("\n".join(lines + lines[i:]) + "\n")
    return bad


@pytest.mark.parametrize(
    "how,needle,refused",
    [
        ("foreign", "holds no :::MLLOG lines: not an MLPerf result log", True),
        ("other_benchmark", "names 'gpt_oss_20b', but", True),
        ("truncated", "has no run_stop: the log is truncated", False),
        ("two_run_starts", "logs run_start 2 times, before its run_stop (one per rank?)", False),
        ("second_run", "logs run_start 2 times, one after a run_stop: two runs in one file", False),
    ],
)
def test_a_result_file_that_cannot_count_is_named_before_the_checker(tmp_path, capsys, how, needle, refused):
    bad = _damage(tmp_path / "logs", how)
    out = tmp_path / "pkg"
    argv = ["package", "--org", "o", "--system", "s", "--results", str(tmp_path / "logs"), "--out", str(out)]
    code = ttt_main(argv + ["--check"])
    captured = capsys.readouterr()
    line = f"{bad}: {needle}"
    if refused:  # it cannot be placed: the benchmark folder would hold a file that is not its result
        assert code == 2 and not out.exists()
        assert captured.err.count("\n") == 1 and captured.err.startswith(f"ttt: error: {line}"), captured.err
    else:  # packaged as it is, and said first: the checker's verdict names a rule, not the file
        assert code == 1 and out.exists()
        assert captured.err.startswith(f"ttt: warning: {line}"), captured.err
        assert "Traceback" not in captured.out + captured.err


@pytest.mark.parametrize("how", ["foreign", "other_benchmark", "truncated", "two_run_starts", "second_run"])
def test_score_and_report_warn_naming_the_file(tmp_path, capsys, how):
    bad = _damage(tmp_path / "logs", how)
    ttt_main(["score", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert err.startswith(f"ttt: warning: {bad}: ") and err.count("\n") == 1, err
    assert ttt_main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"ttt: warning: {bad}: ") and err.count("\n") == 1, err


def test_a_tree_of_only_foreign_files_is_an_error(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "result_0.txt").write_text("epoch 1 loss 3.2\n")
    for argv in (
        ["score", str(tmp_path / "logs")],
        ["report", str(tmp_path / "logs"), "--out", str(tmp_path / "r")],
        [
            "package",
            "--org",
            "o",
            "--system",
            "s",
            "--results",
            str(tmp_path / "logs"),
            "--out",
            str(tmp_path / "p"),
        ],
    ):
        assert ttt_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "result_0.txt holds no :::MLLOG lines" in err, err
    assert not (tmp_path / "r").exists() and not (tmp_path / "p").exists()


def test_the_run_count_note_is_the_rounds_for_405b_tiny(tmp_path, capsys):
    """The audit's case: ten llama31_405b tiny logs (the tier's own RCP count) packaged; the package checker
    wants exactly 3 of llama31_405b whatever the tier (benchmark_meta), and the note said 10."""
    folder = tmp_path / "logs" / "llama31_405b" / "tiny"
    for i in range(10):
        tier_log(
            folder / f"result_{i}.txt",
            300 + i,
            None,
            1.0,
            benchmark="llama31_405b",
            start_ms=T0 - i * 600_000,
        )
    logs, out = str(tmp_path / "logs"), str(tmp_path / "p")
    # Made-up logs the compliance checker fails (aborted, no init_checkpoint_step): the count is the point.
    argv = ["package", "--org", "o", "--system", "s", "--results", logs, "--out", out, "--allow-noncompliant"]
    assert ttt_main(argv) == 0
    assert (
        "note: llama31_405b: 10 result files, the package checker wants exactly 3\n"
        in capsys.readouterr().out
    )


def test_the_run_count_note_is_benchmark_metas_for_every_benchmark_of_the_rounds():
    """One source: mlperf_logging's benchmark_meta, which the package checker counts by, for every benchmark
    of the rounds and every tier of ours (3 for llama31_405b, deepseekv3_671b, qwen35_397b_grpo)."""
    from types import SimpleNamespace

    from mlperf_logging.benchmark_meta import get_allowed_benchmarks, get_result_file_counts

    from timetotrain.mlperf.package import _group_notes
    from timetotrain.mlperf.results import ResultGroup
    from timetotrain.spec import official, registry

    counts = get_result_file_counts("training")
    rounds = {n for rs in official.RULESETS for n in get_allowed_benchmarks("training", rs)}
    assert {"llama31_405b", "llama31_8b", "deepseekv3_671b", "qwen35_397b_grpo"} <= rounds
    for name in sorted(rounds):
        tiers = ["reference", "tiny"] if registry.known(name) else ["reference"]  # every tier of ours
        for tier in tiers:
            log = SimpleNamespace(division="open")
            g = ResultGroup(Path("x"), [], [log] * 2, "o", "s", name, tier, "open", None)
            notes = _group_notes(g, {"division": "open"})
            assert f"{name}: 2 result files, the package checker wants exactly {counts[name]}" in notes, notes
            assert official.result_files(name) == counts[name]
    # the round's facts as mlperf_logging 4.1.68 states them, so the test above cannot pass on wrong data
    assert [counts[n] for n in ("llama31_405b", "deepseekv3_671b", "qwen35_397b_grpo", "llama31_8b")] == [
        3,
        3,
        3,
        10,
    ]


def test_a_reference_tier_runs_the_rounds_count():
    """The reference tiers declare the round's run count (what `ttt run --runs` and `ttt suite` default to):
    the same as benchmark_meta's, the one source `ttt package` and `ttt score` tell."""
    from timetotrain.spec import official, registry

    for name in registry.names():
        tiers = registry.get(name).tiers
        if "reference" not in tiers:  # no reference tier (a benchmark of no round): no round's count applies
            continue
        assert tiers["reference"].runs == official.result_files(name), name


def test_sigterm_during_package_leaves_nothing(tmp_path, capsys, monkeypatch):
    """A real SIGTERM to this process while `ttt package` copies the logs into its hidden staging folder
    beside --out: the staging folder (a copy of every log) is removed, no --out appears, and the exit is
    128 + 15. The signal is sent from inside the first copy, so the point is the same on every run; this
    test's own handler stands in for the default action (which would end pytest) where ttt installs none."""
    import os
    import signal

    from timetotrain import fileio
    from timetotrain.cli import main

    _tiny_logs(tmp_path / "logs" / "llama31_8b" / "tiny", n=3)
    copy = fileio.copy_file

    def copy_then_signal(src, dst):
        copy(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(fileio, "copy_file", copy_then_signal)
    caught = []
    old = signal.signal(signal.SIGTERM, lambda *a: caught.append(a))
    try:
        code = main(["package", "--org", "o", "--system", "s", "--results", str(tmp_path / "logs"),
                     "--out", str(tmp_path / "pkg")])  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, old)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM and "interrupted by SIGTERM" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # no .pkg.* staging folder, no pkg
    assert not caught  # ttt took the signal itself


def test_logs_the_official_checker_fails_are_listed_and_too_many_refused(tmp_path, capsys):
    """Each log the official compliance checker will fail is named with its first reason in a user's words;
    one per benchmark is packaged (the package checker accepts it under olympic scoring), two are refused
    with exit 2 and nothing written, unless --allow-noncompliant."""
    folder = tmp_path / "logs"
    _tiny_logs(folder, n=3)
    short = tier_log(folder / "result_3.txt", 7, None, 1.0)  # aborted at max steps, short of the target
    base = ["package", "--org", "o", "--system", "s", "--results", str(folder)]
    assert ttt_main([*base, "--out", str(tmp_path / "one")]) == 0
    err = capsys.readouterr().err
    assert err == (
        f"ttt: warning: {short}: this run stopped (aborted) at 1,920 samples after 6 evals without reaching "
        "its target <= 4.8 (best 4.9): not converged, which the rules' check of the last eval_accuracy fails; "
        "olympic scoring drops one such run as the slowest (the official compliance checker fails it)\n"
    )
    lines = tier_log(folder / "ok.txt", 8, 320 * 12, 1.0).read_text().splitlines()
    cut = folder / "result_4.txt"  # stopped (SIGTERM) before its first eval
    cut.write_text(
        "\n".join(ln for ln in lines if "block_stop" not in ln and "eval_" not in ln).replace(
            '"success"', '"aborted"'
        )
    )
    (folder / "ok.txt").unlink()
    out = tmp_path / "two"
    assert ttt_main([*base, "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert not out.exists() and not list(tmp_path.glob(".two.*"))
    assert err[0].startswith(f"ttt: {short}: this run stopped (aborted) at 1,920 samples")
    assert err[1].startswith(f"ttt: {cut}: this run stopped (aborted) at 3,840 samples before its first eval")
    assert err[2].startswith("ttt: error: 2 llama31_8b logs under ") and "--allow-noncompliant" in err[2]
    assert len(err) == 3
    assert ttt_main([*base, "--out", str(out), "--allow-noncompliant"]) == 0
    err = capsys.readouterr().err
    assert err.count("(the official compliance checker fails it)") == 2 and out.is_dir()
