"""Faults from outside: a signal or SIGKILL, a full disk, data changing under a live run. Each must leave
either a complete output or a clearly unfinished one (never a half-written file under a final name), and
end with one line saying what happened, not a traceback or a SIGBUS."""

import gzip
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ttt_command
from test_e2e_tiny import tiny

pytestmark = pytest.mark.e2e


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc: no psutil needed)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- ttt data prepare under SIGTERM / SIGINT --


@pytest.fixture(scope="module")
def big_c4_src(c4_src, tmp_path_factory) -> Path:
    """The shared train sample repeated, so tokenizing takes seconds: long enough to be interrupted."""
    out = tmp_path_factory.mktemp("bigc4")
    raw = gzip.decompress(next(c4_src.glob("c4-train.*.json.gz")).read_bytes())
    with gzip.open(out / "c4-train.00000-of-00001.json.gz", "wb", compresslevel=1) as f:
        for _ in range(8):
            f.write(raw)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_prepare_interrupted_stops_workers_and_removes_temporaries(big_c4_src, c4_prepared, tmp_path, sig):
    out = tmp_path / "out"
    out.mkdir()
    # A previous prepare of the split: an interrupted one must leave it exactly as it was.
    old = sorted(c4_prepared.glob("c4-train*"))
    for f in old:
        shutil.copy(f, out / f.name)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    proc = subprocess.Popen(
        ttt_command("data", "prepare", "c4", "--src", str(big_c4_src), "--split", "train", "--out", str(out),
                    "--workers", "2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Tokens are being written (a new file is growing): the workers are busy.
        wait_for(
            lambda: any(p.name not in before and _size(p) > 0 for p in out.iterdir()),
            60,
            "the prepare to write tokens",
        )
        workers = child_pids(proc.pid)
        assert workers, "expected tokenizer worker processes"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("ttt:")]
    assert lines == [f"ttt: interrupted by {signal.Signals(sig).name}: stopped, temporary files removed"], err
    wait_for(lambda: not any(alive(w) for w in workers), 10, "the workers to exit")
    after = {f.name: f.read_bytes() for f in out.iterdir()}
    assert sorted(after) == sorted(before)  # no temporary left, nothing new under a final name
    assert after == before


# -- result logs: SIGKILL, a full disk --


def start_tiny(data, logdir, *extra) -> tuple[subprocess.Popen, Path]:
    """A tiny run in a subprocess, returned once its live log has a train_loss line (it is training)."""
    proc = subprocess.Popen(
        ttt_command(*tiny(data, logdir, "--seed", "3", *extra)),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    live = logdir / "llama31_8b" / "tiny" / "result_0.txt.partial"
    try:
        wait_for(lambda: live.exists() and '"train_loss"' in live.read_text(), 120, "the first train_loss")
    except BaseException:
        proc.kill()
        raise
    return proc, live


@pytest.mark.slow
def test_sigkill_leaves_only_the_partial_log(c4_prepared, tmp_path, capsys):
    from fakelogs import ttt_main

    proc, live = start_tiny(c4_prepared, tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in live.parent.iterdir()) == ["result_0.txt.partial"]
    assert '"run_stop"' not in live.read_text()
    # Not a result: scoring finds none, and says why.
    assert ttt_main(["score", str(tmp_path)]) == 2
    assert "only 1 unfinished result_*.txt.partial" in capsys.readouterr().err


def test_full_disk_ends_the_run_within_one_step(c4_prepared, tmp_path, monkeypatch, capsys):
    import errno

    from timetotrain.cli import main
    from timetotrain.mlperf import logger
    from timetotrain.train import step

    real_write, real_step = logger._write_all, step.Training.step
    steps, failed_at = [], []

    def full_disk(fd, data):
        if b'"step_num": 3,' in data:  # the third train_loss line: the disk is full from here on
            failed_at.append(3)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(fd, data)

    def counted(self, *args, **kwargs):
        steps.append(1)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(logger, "_write_all", full_disk)
    monkeypatch.setattr(step.Training, "step", counted)
    code = main(tiny(c4_prepared, tmp_path, "--seed", "5", "--max-steps", "50"))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("ttt:")]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "the run is stopped" in lines[0], err
    assert failed_at == [3]
    # train_loss of step 3 is written after step 4 ran (read one step late): nothing after that.
    assert len(steps) <= 4
    folder = tmp_path / "llama31_8b" / "tiny"
    assert sorted(p.name for p in folder.iterdir()) == ["result_0.txt.partial"]  # never a result file
    assert '"step_num": 2,' in (folder / "result_0.txt.partial").read_text().splitlines()[-1]


# -- the training data changing under a live run --


def test_reader_detects_truncation_and_in_place_writes_not_renames(tmp_path):
    from timetotrain.data.indexed import IndexedDataError, IndexedDataset, IndexedWriter

    def write(prefix, docs):
        with IndexedWriter(prefix) as w:
            for d in docs:
                w.add_document(d)

    prefix = tmp_path / "d"
    write(prefix, [list(range(1000))] * 4)
    ds = IndexedDataset(prefix)
    ds.check_unchanged()
    write(prefix, [list(range(5))])  # what `ttt data prepare` does: new files renamed into place
    ds.check_unchanged()  # the map still holds the old inode: nothing to flag
    ds = IndexedDataset(prefix)
    binf = Path(f"{prefix}.bin")
    st = binf.stat()
    with open(binf, "r+b") as f:  # same size, new bytes: a copy over the file in place
        f.write(b"\x01\x02")
    os.utime(binf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # coarse-mtime file systems
    with pytest.raises(IndexedDataError, match=r"d\.bin was modified while this run was reading it"):
        ds.check_unchanged()
    ds = IndexedDataset(prefix)
    os.truncate(f"{prefix}.idx", 40)
    with pytest.raises(IndexedDataError, match=r"d\.idx was truncated"):
        ds.check_unchanged()


@pytest.mark.slow
def test_truncated_train_bin_under_a_live_run_aborts_not_sigbus(c4_prepared, tmp_path):
    data = tmp_path / "c4"
    shutil.copytree(c4_prepared, data)
    proc, live = start_tiny(data, tmp_path / "logs")
    binf = data / "c4-train_text_document.bin"
    os.truncate(binf, binf.stat().st_size // 2)  # in place: the run has this inode mapped
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (proc.returncode, err[-2000:])  # -7 would be SIGBUS
    assert "Traceback" not in err and "Bus error" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("ttt:")]
    assert (
        len(lines) == 1
        and "c4-train_text_document.bin was truncated while this run was reading it" in lines[0]
    )
    log = live.with_name("result_0.txt")  # run_stop was written, so the log is a (failed) result
    last = [ln for ln in log.read_text().splitlines() if ":::MLLOG" in ln][-1]
    assert '"run_stop"' in last and '"status": "aborted"' in last


# --- issue 22: result files, kills, locks ---


def _toy_suite(tmp_path, *extra_env: tuple[str, str]):
    """`ttt suite` of the toy benchmark (tests/toy_benchmark.py), one run of seed 7, into tmp_path/out."""
    from test_suite import _env, suite_cmd

    return suite_cmd(tmp_path, 1), {**_env(tmp_path), **dict(extra_env)}


def _start_slow_suite(tmp_path) -> tuple[subprocess.Popen, int, Path]:
    """A suite whose `ttt run` child is training (its live log has a train_loss line), with every toy
    step slowed so the run is surely still training when it is signalled. Returns (suite, child, folder)."""
    cmd, env = _toy_suite(tmp_path, ("TOY_STEP_SECONDS", "0.5"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = tmp_path / "out" / "toy_classify" / "tiny"
    live = folder / "result_0.txt.partial"
    try:
        wait_for(lambda: live.exists() and '"train_loss"' in live.read_text(), 120, "the run to train")
        (child,) = child_pids(proc.pid)
    except BaseException:
        proc.kill()
        raise
    return proc, child, folder


def group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_suite_sigterm_sets_the_run_aside_and_a_second_suite_is_refused(tmp_path):
    proc, child, folder = _start_slow_suite(tmp_path)
    # A second suite on the same --out is refused, naming the lock and its holder.
    cmd, env = _toy_suite(tmp_path)
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("ttt:")]
    assert second.returncode == 2, second.stderr[-2000:]
    assert len(lines) == 1 and f"pid {proc.pid}" in lines[0] and "suite.lock" in lines[0], second.stderr
    assert "Traceback" not in second.stderr
    # SIGTERM: passed on to the run, which logs its stop; the suite sets that log aside at once.
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert (
        "result_0.txt (seed 7) was stopped by SIGTERM: kept as result_0.txt.signalled, not scored; seed 7 "
        "runs again when the suite resumes" in err
    ), err[-2000:]
    assert sorted(p.name for p in folder.iterdir()) == ["result_0.txt.signalled"]  # no result counts it
    assert not alive(child)


@pytest.mark.slow
def test_sigkill_of_the_suite_stops_its_run_and_the_resumed_suite_reruns_that_seed(tmp_path):
    import json

    from timetotrain.cli.suite_driver import finished_seeds
    from timetotrain.mlperf.results import parse_log

    proc, child, folder = _start_slow_suite(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    # The run got SIGTERM when the suite died (PR_SET_PDEATHSIG): it logged its stop and exited, with
    # nothing of its process group left.
    wait_for(lambda: not alive(child) and not group_members(child), 30, "the suite's run to exit")
    (log,) = folder.glob("result_*.txt")
    lg = parse_log(log)
    assert lg.status == "aborted" and lg.keys["ttt_stop_signal"] == "SIGTERM"
    # Resumed: that log is set aside (kept, not scored), the seed runs again under a new index.
    cmd, env = _toy_suite(tmp_path)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        "result_0.txt (seed 7) was stopped by SIGTERM: kept as result_0.txt.signalled, not scored; seed 7 "
        "runs again" in res.stderr
    ), res.stderr[-2000:]
    assert sorted(p.name for p in folder.iterdir()) == ["result_0.txt.signalled", "result_1.txt"]
    assert list(finished_seeds(folder)) == [7]
    (row,) = json.loads((tmp_path / "out" / "scorecard.json").read_text())["benchmarks"]
    assert row["runs"] == 1 and row["converged"] == 1, row


def test_an_abort_before_run_start_leaves_no_result_file(tmp_path, monkeypatch):
    """An error during init (a bad checkpoint, say) or a signal before run_start: no result_<k>.txt, and
    no .partial either (mlperf/logger.py says why)."""
    from toy_benchmark import make_data

    from timetotrain.errors import Interrupted, UserError
    from timetotrain.train import loop, prepare
    from timetotrain.train.abort import Aborter

    monkeypatch.setenv("TTT_EXTRA_BENCHMARKS", "toy_benchmark")
    make_data(tmp_path / "data")
    folder = tmp_path / "logs" / "toy_classify" / "tiny"

    def opts(**kw):
        return loop.RunOptions(
            "toy_classify", "tiny", tmp_path / "data", tmp_path / "logs", seed=1, echo=False, **kw
        )

    real_build = prepare.build

    def bad_checkpoint(prep):
        real_build(prep)
        raise UserError("--init-checkpoint X: shapes do not match")

    monkeypatch.setattr(prepare, "build", bad_checkpoint)
    with pytest.raises(UserError, match="shapes do not match"):
        loop.run(opts())
    assert list(folder.iterdir()) == []
    monkeypatch.setattr(prepare, "build", real_build)
    signalled = Aborter()  # as if SIGINT had come during preflight or init: the watcher has caught it
    signalled.caught = signal.SIGINT
    with pytest.raises(Interrupted) as e:
        loop.run(opts(aborter=signalled))
    assert e.value.signum == signal.SIGINT and "no result file" in e.value.outcome
    assert list(folder.iterdir()) == []
    res = loop.run(opts(max_steps=2))  # the same run, not stopped: a result file, aborted by the rules
    assert res.status == "aborted" and sorted(p.name for p in folder.iterdir()) == ["result_0.txt"]


@pytest.mark.slow
def _size(path: Path) -> int:
    """A file's size, 0 for one gone since its folder was listed (the writability probe lives a moment)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_sigkill_of_a_prepare_leaves_no_worker_and_no_temporary(big_c4_src, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ttt_command("data", "prepare", "c4", "--src", str(big_c4_src), "--split", "train", "--out", str(out),
                    "--workers", "2"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    kids = []
    try:
        wait_for(lambda: out.is_dir() and any(_size(p) > 0 for p in out.iterdir()), 60, "tokens")
        kids = child_pids(proc.pid)  # two tokenizer workers and the guardian of the temporaries
        assert len(kids) == 3, kids
        assert any(".tmp" in p.name for p in out.iterdir())
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not any(alive(k) for k in kids), 10, "the workers and the guardian to exit")
        assert list(out.iterdir()) == []
    finally:  # on a failure, nothing of this test stays behind either
        for pid in [proc.pid, *kids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.parametrize("where", ["fsync", "rename", "second set"])
def test_a_signal_during_staged_commit_leaves_no_temporary_and_a_consistent_output(
    tmp_path, monkeypatch, where
):
    """A signal while the set is fsynced: the old outputs stay, the temporaries go, "stopped". A signal
    during the renames: raised after the last one, the new outputs all in place, and the line says so.
    A signal in a second set after a first one went in place: the line says the output is partly new."""
    from timetotrain import fileio
    from timetotrain.cli import _outcome
    from timetotrain.errors import Interrupted
    from timetotrain.interrupt import raise_on_signals

    sets = [["a.bin", "a.idx", "a.manifest.json"]] + (
        [["b.bin", "b.manifest.json"]] if where == "second set" else []
    )
    names = sorted(n for names in sets for n in names)
    for n in names:
        (tmp_path / n).write_text("old")
    patched = "replace" if where == "rename" else "fsync"
    real = getattr(os, patched)
    # The call SIGTERM arrives at: the first; or the second set's first fsync, after the first set's
    # three and its folder's.
    at = len(sets[0]) + 2 if where == "second set" else 1
    calls = []

    def signalled(*args):
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(os, patched, signalled)
    monkeypatch.setattr(fileio, "COMPLETED", [])
    monkeypatch.setattr(fileio, "DISCARDED", [])
    with pytest.raises(Interrupted) as e, raise_on_signals():
        for one in sets:
            with fileio.Staged() as staged:
                for n in one:
                    staged.write_text(tmp_path / n, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no temporary in any case
    texts = {n: (tmp_path / n).read_text() for n in names}
    if where == "fsync":
        assert set(texts.values()) == {"old"} and _outcome(e.value) == "stopped, temporary files removed"
    elif where == "rename":
        assert len(calls) == len(names) and set(texts.values()) == {"new"}  # the signal after every rename
        assert _outcome(e.value).startswith("the new output is complete")
    else:
        assert texts == {n: "new" if n.startswith("a.") else "old" for n in names}  # whole sets only
        assert _outcome(e.value).startswith("the output is partly new")


def test_sigterm_while_synth_graph_writes_leaves_no_file_and_no_folder(tmp_path, monkeypatch, capsys):
    """`ttt data synth-graph` stopped half-way: its staged files and the folders it made are gone, so the
    same command can run again (it refuses a non-empty --out)."""
    from timetotrain.cli import main
    from timetotrain.data import npy

    real_save, saved = npy.save, []

    def save(*args, **kwargs):
        saved.append(1)
        if len(saved) == 3:  # a few arrays are written: SIGTERM comes now
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(npy, "save", save)
    out = tmp_path / "graph"
    assert main(["data", "synth-graph", "--scale", "tiny", "--out", str(out)]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "ttt: interrupted by SIGTERM: stopped, temporary files removed"
    assert len(saved) == 3 and not out.exists()
