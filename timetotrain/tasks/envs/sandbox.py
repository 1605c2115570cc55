"""A code environment: run a completion against unit tests in a contained subprocess; reward 1 when they pass.

A completion is untrusted model output. Each run gets a fresh scratch directory (its cwd, HOME and TMPDIR),
and these guards, the OS ones where this host allows them (`containment()` says which are active):

- time: a wall-clock limit (the whole process group, and under a PID namespace every process the run made,
  is killed at it) and RLIMIT_CPU per process;
- memory: RLIMIT_AS; output: stdout and stderr go to files in the scratch directory and RLIMIT_FSIZE caps
  every file the run writes (a flood ends in SIGXFSZ); RLIMIT_NOFILE; no core files;
- processes: RLIMIT_NPROC. The kernel counts it per real user and does not apply it to root, so when we
  run as root the child drops to the unprivileged `nobody` user (setpriv), whose count is then bounded;
- network: a new, empty network namespace (`unshare --net`: only a loopback that is down, so no
  connection leaves, not even to this host's 127.0.0.1);
- PID namespace (`unshare --pid --fork --kill-child`): the runner is PID 1 of its own namespace, so when it
  ends or is killed the kernel kills every process the completion started, even one that left the process
  group with setsid;
- a Python audit hook installed before the completion runs: it refuses writes outside the scratch
  directory, sockets, and starting processes (fork, exec, subprocess) and ctypes. It is a guard at the Python
  level only (native code could pass it), so it is the only guard against writes outside the scratch
  directory where the files are writable by the user the child runs as (e.g. /tmp); running as `nobody`
  keeps the rest of the file system read-only to it.

Where `unshare` is not permitted (no root and no unprivileged user namespaces) the network and PID guards
are the audit hook alone, which `containment()` reports. Either way, before `score` returns, every process
still carrying the run's scratch directory as HOME is killed (a process that called setsid is outside the
group; the namespace's processes die asynchronously after its PID 1).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from timetotrain.tasks.envs.base import Environment, Outcome, Problem

NOBODY = 65534

# Runs inside the child: the audit hook first, then the completion and its tests in one namespace.
_BOOTSTRAP = r"""
import os, sys
ROOT = os.path.realpath(os.getcwd())
BLOCKED = ("socket.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "subprocess.Popen", "ctypes.", "os.kill", "os.killpg", "pty.spawn")
MOVES = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown",
         "os.symlink", "os.link", "os.utime", "shutil.rmtree", "shutil.move", "os.chdir", "os.chroot")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def inside(p):
    try:
        p = os.fsdecode(p)
    except TypeError:
        return isinstance(p, int)
    real = os.path.realpath(os.path.join(ROOT, p))
    return real == ROOT or real.startswith(ROOT + os.sep)
def hook(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError("sandbox: " + event + " is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (flags or 0) & WRITE_FLAGS or (isinstance(mode, str) and any(c in mode for c in "wax+"))
        if writing and not inside(path):
            raise PermissionError("sandbox: writing outside the scratch directory")
    elif event in MOVES:
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                raise PermissionError("sandbox: " + event + " outside the scratch directory")
if sys.argv[1] == "1":
    sys.addaudithook(hook)
with open("solution.py") as f:
    solution = f.read()
with open("tests.py") as f:
    tests = f.read()
scope = {"__name__": "__main__"}
exec(compile(solution, "solution.py", "exec"), scope)
exec(compile(tests, "tests.py", "exec"), scope)
"""


# `unshare --fork` passes its child's death by a signal on by raising that signal on itself; for SIGKILL
# and SIGXCPU (the CPU, memory and file-size limits) that step fails with this line and exit 1 instead.
_UNSHARE_SIGNALLED = "unshare: sigprocmask unblock failed"
LIMIT_KILL = "killed by a resource limit (CPU time, memory or file size)"


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    processes: int = 16
    file_bytes: int = 1 << 20  # any one file, stdout and stderr included
    open_files: int = 64
    python_guard: bool = True  # the audit hook; off only to test the OS guards alone


@functools.cache
def _unshare() -> tuple[str, ...] | None:
    """The namespace prefix this host permits, or None."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    base = (exe, "--net", "--pid", "--fork", "--kill-child")
    tries = [base] if os.geteuid() == 0 else [(exe, "--user", "--map-root-user", *base[1:])]
    for prefix in tries:
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return prefix
    return None


@functools.cache
def _drop_to_nobody() -> tuple[str, ...] | None:
    """setpriv to `nobody` when we are root (so that RLIMIT_NPROC applies and the file system is read-only
    to the child), or None."""
    exe = shutil.which("setpriv")
    if os.geteuid() != 0 or exe is None:
        return None
    return (exe, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--")


@functools.cache
def _python() -> str:
    """An interpreter the child's user can run: ours, else the system's (ours may live in a home
    directory `nobody` cannot enter)."""
    for exe in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.path.exists(exe):
            continue
        cmd = [*(_drop_to_nobody() or ()), exe, "-I", "-c", "pass"]
        try:
            if subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0:
                return exe
        except (OSError, subprocess.TimeoutExpired):
            continue
    return sys.executable


def containment() -> dict[str, str]:
    """Which guards are active on this host, for the log and the docs."""
    ns = _unshare() is not None
    return {
        "network": "network namespace" if ns else "python audit hook only",
        "processes": "pid namespace + RLIMIT_NPROC" if ns else "process group + RLIMIT_NPROC",
        "user": "nobody" if _drop_to_nobody() else f"uid {os.geteuid()}",
        "writes": "scratch dir (audit hook), RLIMIT_FSIZE"
        + (", read-only fs as nobody" if _drop_to_nobody() else ""),
    }


def _user_processes(uid: int) -> int:
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                n += p.stat().st_uid == uid
            except OSError:
                pass
    return n


def _limiter(limits: Limits, nproc: int):
    def apply() -> None:  # in the child, between fork and exec
        for what, value in (
            (resource.RLIMIT_CPU, limits.cpu_s),
            (resource.RLIMIT_AS, limits.memory_bytes),
            (resource.RLIMIT_FSIZE, limits.file_bytes),
            (resource.RLIMIT_NOFILE, limits.open_files),
            (resource.RLIMIT_NPROC, nproc),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(what, (value, value))

    return apply


@dataclass
class RunResult:
    returncode: int | None  # None: killed at the wall-clock limit
    stdout: str
    stderr: str
    seconds: float


def run_python(solution: str, tests: str, limits: Limits = Limits()) -> RunResult:
    """Run `solution` then `tests` in a contained child; never raises for what they contain."""
    drop = _drop_to_nobody()
    scratch = Path(tempfile.mkdtemp(prefix="ttt-sandbox-"))
    try:
        (scratch / "solution.py").write_text(solution, errors="replace")
        (scratch / "tests.py").write_text(tests)
        if drop:
            for p in (scratch, scratch / "solution.py", scratch / "tests.py"):
                os.chown(p, NOBODY, NOBODY)
        # The kernel counts RLIMIT_NPROC over all processes of the child's user: as `nobody`, few; as
        # ourselves, every process we already have, so the allowance is added to that count.
        nproc = limits.processes + (_user_processes(NOBODY) if drop else _user_processes(os.getuid()))
        cmd = [*(_unshare() or ()), *(drop or ()), _python(), "-I", "-S", "-B", "-c", _BOOTSTRAP]
        cmd.append("1" if limits.python_guard else "0")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LC_ALL": "C.UTF-8"}
        out_path, err_path = scratch / "stdout", scratch / "stderr"
        t0 = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True, preexec_fn=_limiter(limits, nproc),
            )  # fmt: skip
            try:
                code = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _kill_group(proc)
                _sweep(scratch)
        seconds = time.monotonic() - t0
        return RunResult(
            code, _head(out_path, limits.file_bytes), _head(err_path, limits.file_bytes), seconds
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (the runner, and under the PID namespace's --kill-child everything it
    started dies with it), then reap the runner."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _sweep(scratch: Path, wait_s: float = 5.0) -> None:
    """Kill whatever of the run is still alive, found by its HOME (the scratch directory, unique to the
    run), until nothing is: the namespace's processes die asynchronously after its PID 1, and without a
    PID namespace a process that called setsid is outside the group. Returns once none is left."""
    marker = f"HOME={scratch}\0".encode()
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    if marker in (p / "environ").read_bytes():  # a zombie's reads empty: it is gone
                        alive.append(int(p.name))
                except OSError:
                    pass
        if not alive or time.monotonic() > deadline:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _head(path: Path, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(min(cap, 64 << 10)).decode("utf-8", "replace")


class CodeRunner(Environment):
    """Reward 1 when the completion, run with the problem's unit tests after it, exits 0 within the limits."""

    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self.timeout_s = limits.wall_s

    def score(self, problem: Problem, completion: str) -> Outcome:
        if problem.tests is None:
            raise ValueError("CodeRunner needs problems with tests")
        res = run_python(completion, problem.tests, self.limits)
        if res.returncode == 0:
            return Outcome(1.0, "", res.seconds)
        if res.returncode is None:
            why = "timeout"
        elif res.returncode < 0:
            why = f"killed by {signal.Signals(-res.returncode).name}"
        elif _UNSHARE_SIGNALLED in res.stderr:
            why = LIMIT_KILL
        else:
            why = f"exit {res.returncode}: {res.stderr.strip().splitlines()[-1][:200] if res.stderr.strip() else ''}"
        return Outcome(0.0, why, res.seconds)
