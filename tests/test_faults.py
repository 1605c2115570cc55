"""Faults from outside: a signal or SIGKILL, a full disk, data changing under a live run. Each must leave
either a complete output or a clearly unfinished one (never a half-written file under a final name), and
end with one line saying what happened, not a traceback or a SIGBUS."""

import gzip
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ttt_command


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
            lambda: any(p.name not in before and p.stat().st_size > 0 for p in out.iterdir()),
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
