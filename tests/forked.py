"""Processes started from a fork server that has imported torch, its distributed packages and ttt: `ttt`
commands (`run_ttt`) and a test file's worker on N gloo ranks as torchrun would launch it (`run_ranks`),
without a fresh interpreter each.

Why: a fresh interpreter spends about 3.5 s importing torch, its distributed packages and ttt before it
does anything, more than most of the commands the suite runs take, and the suite runs hundreds; N ranks on
2 cores pay it N / 2 times over, plus torchrun's own start. Why a fork server and not a fork of the test
process: the test process has run OpenMP parallel regions, and a child forked from it hangs in its first
one (libgomp's thread pool does not survive a fork); the server (`multiprocessing`'s forkserver, started
once per session) only imports (`PRELOAD`), so each child starts its own threads as a fresh process would.
Each child is made to look fresh (`_fresh`): the environment it is given (os.environ replaced), the
intra-op threads its OMP_NUM_THREADS names, SIGINT and SIGTERM at their defaults, no exit handlers but its
own, its own stdout and stderr files; it ends through those handlers and `os._exit`. What a fresh
interpreter would still do differently (import-time side effects, the `python -m timetotrain` entry) the
tests that need a real process keep: `conftest.ttt_command` with `subprocess` (tests/test_bad_input.py's
real process, the signal tests of tests/test_faults.py and tests/test_e2e_tiny.py, and every
multi-process `ttt run` under torchrun).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from timetotrain.cli import main

# What the server imports before it forks anything: what every `ttt` command and rank worker would import
# (the commands' modules load lazily in `ttt`, so they are named here), and this module, the children's
# entry point.
PRELOAD = [
    "forked", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.pipelining",
    "timetotrain.cli.run", "timetotrain.cli.results", "timetotrain.cli.data", "timetotrain.cli.suite",
    "timetotrain.train.loop", "timetotrain.train.synth", "timetotrain.train.simulate",
]  # fmt: skip
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(PRELOAD)


def _fresh(env: dict[str, str], stdout: str, stderr: str) -> None:
    """Make a just-forked child look like a fresh process (module docstring)."""
    out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if stderr == stdout else os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    atexit._clear()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _child(job: tuple, env: dict[str, str], stdout: str, stderr: str) -> None:
    """The child's entry: fresh state, the job (`ttt` ARGV in CWD, or SCRIPT ARGS as `__main__`), exit
    handlers, `os._exit` with its code; never returns."""
    code = 1
    try:
        _fresh(env, stdout, stderr)
        if job[0] == "ttt":
            _, argv, cwd = job
            if cwd is not None:
                os.chdir(cwd)
            sys.argv = ["ttt", *argv]
            code = main(list(argv))
        else:
            _, script, args = job
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
            code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _start(job: tuple, env: dict[str, str], stdout: Path, stderr: Path):
    proc = _SERVER.Process(target=_child, args=(job, env, str(stdout), str(stderr)))
    proc.start()
    return proc


def _wait(procs: list, timeout: float) -> list[int]:
    """Exit codes, in order; stops at the first failure (the others would wait on it); past `timeout`, or
    after a failure, the rest are killed (code -9)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes) or any(c for c in codes if c is not None):
            break
        time.sleep(0.02)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join()
    return [p.exitcode for p in procs]


def run_ttt(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 600, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    """`ttt ARGV` in a child of the fork server (module docstring), as `subprocess.run(...,
    capture_output=True, text=True)` would report it: returncode, stdout, stderr. Past `timeout` the child
    is killed and the call raises `subprocess.TimeoutExpired`."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="ttt-run-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        job = ("ttt", list(argv), None if cwd is None else str(cwd))
        proc = _start(job, env, out, err)
        (code,) = _wait([proc], timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if code == -signal.SIGKILL:
        raise subprocess.TimeoutExpired(["ttt", *argv], timeout, stdout, stderr)
    return subprocess.CompletedProcess(["ttt", *argv], code, stdout, stderr)


def run_ranks(script: str, args: list[str], nproc: int, port: int, timeout: float = 300) -> None:
    """Fork `nproc` ranks of `script ARGS` run as `__main__` with torchrun's variables (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, ...) and one thread each, as the workers ran under torchrun; wait for all. On a
    failure or past `timeout`, the rest are killed and the call fails with each failed rank's output tail
    (the ranks' output lies in a temporary folder, kept only then)."""
    logs = Path(tempfile.mkdtemp(prefix="ttt-ranks-"))
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.update({k: str(rank) for k in ("RANK", "LOCAL_RANK", "ROLE_RANK")}, GROUP_RANK="0")
        env.update({k: str(nproc) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")})

        log = logs / f"rank{rank}.log"
        procs.append(_start(("script", script, list(args)), env, log, log))
    failed = [(r, c) for r, c in enumerate(_wait(procs, timeout)) if c != 0]
    if failed:
        tails = "\n".join(
            f"--- rank {r} (exit {c}):\n{(logs / f'rank{r}.log').read_text()[-3000:]}" for r, c in failed
        )
        raise AssertionError(f"{Path(script).name} on {nproc} ranks failed (output in {logs}):\n{tails}")
    shutil.rmtree(logs)
