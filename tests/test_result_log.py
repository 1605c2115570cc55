"""Result files are crash-safe: `.partial` while live, renamed only after run_stop; indices reserved
atomically; a failed write stops the run; readers of result trees skip `.partial` logs with a note."""

import errno
import os
import threading

import pytest
from fakelogs import tiny_runs, ttt_main

from timetotrain.errors import UserError
from timetotrain.mlperf import logger
from timetotrain.mlperf.logger import ResultLog


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_partial_while_live_renamed_after_run_stop(tmp_path):
    log = ResultLog(tmp_path)
    log.start("init_start")
    assert names(tmp_path) == ["result_0.txt.partial"]
    assert log.live_path.read_text().count(":::MLLOG") == 1  # every line is in the file at once
    log.start("run_start")
    log.end("run_stop", metadata={"status": "aborted"})
    assert names(tmp_path) == ["result_0.txt.partial"]  # renamed by close, after the fsync
    log.close()
    log.close()  # twice is harmless (the abort watcher and the loop may both close)
    assert names(tmp_path) == ["result_0.txt"] and log.path == tmp_path / "result_0.txt"
    assert '"run_stop"' in log.path.read_text()


def test_without_run_stop_the_log_stays_partial(tmp_path):
    log = ResultLog(tmp_path)
    log.start("init_start")
    log.start("run_start")
    log.close()  # e.g. the run raised before it could log run_stop
    assert names(tmp_path) == ["result_0.txt.partial"]


def test_a_log_that_never_reached_run_start_is_removed(tmp_path):
    log = ResultLog(tmp_path)
    log.start("init_start")
    log.end("run_stop", metadata={"status": "aborted"})  # an init that failed: no clock ever ran
    log.close()
    assert names(tmp_path) == []


def test_index_counts_finished_and_unfinished_logs(tmp_path):
    (tmp_path / "result_0.txt").write_text("")
    (tmp_path / "result_3.txt.partial").write_text("")  # a killed run keeps its index reserved
    (tmp_path / "result_5.txt.signalled").write_text("")  # and so does one `ttt suite` set aside
    log = ResultLog(tmp_path)
    assert log.path.name == "result_6.txt"
    log.close()


def test_stale_listing_never_takes_a_finished_runs_name(tmp_path, monkeypatch):
    # Run A lists the folder, run B claims index 0, finishes and renames to result_0.txt, then A creates
    # result_0.txt.partial (free again): A must see result_0.txt and move on rather than later rename over it.
    (tmp_path / "result_0.txt").write_text("run B")
    real = logger.next_result_path
    stale = iter([tmp_path / "result_0.txt"])
    monkeypatch.setattr(logger, "next_result_path", lambda d: next(stale, None) or real(d))
    log = ResultLog(tmp_path)
    assert log.path.name == "result_1.txt"
    assert names(tmp_path) == ["result_0.txt", "result_1.txt.partial"]
    log.close()


def test_runs_started_together_never_share_an_index(tmp_path):
    n = 16
    barrier = threading.Barrier(n)
    paths, errors = [], []

    def one():
        try:
            barrier.wait()
            log = ResultLog(tmp_path)
            log.start("run_start")
            log.end("run_stop", metadata={"status": "success"})
            log.close()
            paths.append(log.path.name)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(paths) == sorted(f"result_{k}.txt" for k in range(n))
    assert names(tmp_path) == sorted(paths)


def test_write_error_stops_at_once_and_leaves_partial(tmp_path, monkeypatch):
    log = ResultLog(tmp_path)
    log.start("init_start")
    log.start("run_start")
    real = logger._write_all
    attempts = []

    def full_disk(fd, data):
        attempts.append(data)
        if b'"train_loss"' in data:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(logger, "_write_all", full_disk)
    with pytest.raises(
        UserError, match=r"result_0\.txt\.partial \(No space left on device\): the run is stopped"
    ):
        log.event("train_loss", 1.0)
    log.end("run_stop", metadata={"status": "aborted"})  # the run's own error path: no second error
    log.close()
    assert len(attempts) == 1  # nothing written after the failure (no gap in the log)
    assert names(tmp_path) == ["result_0.txt.partial"]  # never a result file without its lines


def test_score_package_report_skip_partial_logs_with_a_note(tmp_path, capsys, monkeypatch):
    import types

    import timetotrain.report
    from timetotrain.mlperf.results import find_groups

    def report_without_plots(root, out, ruleset):
        # The report finds its logs as score and package do (run for real below); its plots would only
        # add seconds. What is checked for the report is the note.
        find_groups(root)
        return types.SimpleNamespace(
            plots=[], training_plots=[], summary="summary.md", scores_json="scores.json"
        )

    monkeypatch.setattr(timetotrain.report, "make_report", report_without_plots)
    root = tmp_path / "logs"
    tiny_runs(root / "llama31_8b" / "tiny", n=3)
    killed = root / "llama31_8b" / "tiny" / "result_3.txt.partial"
    killed.write_text(":::MLLOG {broken")  # a killed run: parsing it would be an error
    note = f"note: skipped 1 unfinished run log(s), not results (no run_stop: the run was killed or is still running): {killed}"
    for argv in (
        ["score", str(root), "--json"],
        ["report", str(root), "--out", str(tmp_path / "report")],
        [
            "package",
            "--org",
            "Org",
            "--system",
            "box",
            "--results",
            str(root),
            "--out",
            str(tmp_path / "pkg"),
        ],
    ):
        ttt_main(argv)
        err = capsys.readouterr().err
        assert note in err.splitlines(), (argv, err)
    assert sorted(p.name for p in (tmp_path / "pkg" / "results" / "box" / "llama31_8b").iterdir()) == [
        "result_0.txt", "result_1.txt", "result_2.txt",
    ]  # fmt: skip


def test_only_partial_logs_is_an_error_naming_them(tmp_path, capsys):
    (tmp_path / "result_0.txt.partial").write_text("")
    assert ttt_main(["score", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no result_*.txt files" in err and "only 1 unfinished result_*.txt.partial" in err
