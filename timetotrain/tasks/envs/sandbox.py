"""A code environment: a completion and then its unit tests run in a bubblewrap sandbox; reward 1 when the
test harness reports, over a channel of its own, that both ran to the end.

A completion is untrusted model output. The boundary is the operating system's (bwrap.py: namespaces, a
read-only root, a fresh uid, seccomp.py: a syscall filter; harness.py: rlimits and no exec), never Python.
The parent never opens a path the run could have replaced: the job (completion, tests, the run's nonce)
goes in as a memfd, the seccomp program as another, and stdout, stderr and the verdict come back through
pipes the parent made, read with a cap each and drained together, so a flood neither fills memory nor
blocks. The reward is the harness's verdict line, which must carry the nonce; never the exit code.
At the wall-clock limit the run is killed whole (as root: every process of its fresh uid; else its process
group, and with it the sandbox's PID namespace), and as root score returns only once none of it is left.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from timetotrain.errors import UserError
from timetotrain.tasks.envs import bwrap, seccomp
from timetotrain.tasks.envs.base import Environment, Outcome, Problem

_VERDICT_BYTES = 4096
_STOP_S = 2.0


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5  # RLIMIT_CPU of each process
    memory_bytes: int = 1 << 30  # RLIMIT_AS of each process
    processes: int = 16  # RLIMIT_NPROC over the run's user namespace: bwrap's init and the harness count
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: any one file the run writes
    scratch_bytes: int = 16 << 20  # the size of the run's /tmp (a tmpfs: memory)
    open_files: int = 64
    output_bytes: int = 64 << 10  # what is kept of stdout and of stderr; past it that pipe is closed

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_CPU": self.cpu_s,
            "RLIMIT_AS": self.memory_bytes,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_FSIZE": self.file_bytes,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
        }


@dataclass
class RunResult:
    passed: bool
    reason: str  # why not, when not passed
    stdout: str
    stderr: str
    seconds: float


def run_python(solution: str, tests: str, limits: Limits = Limits()) -> RunResult:
    """Run `solution` then `tests` in the sandbox; never raises for what they contain (UserError where the
    sandbox cannot start on this host)."""
    tool, py, arch = _host()
    nonce = secrets.token_hex(16)
    job = {
        "solution": solution, "tests": tests, "nonce": nonce, "limits": limits.rlimits(),
        "no_exec": seccomp.program(seccomp.NO_EXEC_RULES, arch).hex(),
    }  # fmt: skip
    job_fd = _memfd("ttt-job", json.dumps(job).encode())
    rules_fd = _memfd("ttt-seccomp", seccomp.program(seccomp.SANDBOX_RULES, arch))
    (verdict_r, verdict_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
    uid = bwrap.fresh_uid() if os.geteuid() == 0 else None
    harness = ["-c", _harness_source(), str(job_fd), str(verdict_w)]
    argv = bwrap.command(tool, py, uid, scratch_bytes=limits.scratch_bytes, seccomp_fd=rules_fd, argv=harness)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, pass_fds=(job_fd, rules_fd, verdict_w),
            start_new_session=True, env={}, cwd="/",
        )  # fmt: skip
    finally:
        for fd in (job_fd, rules_fd, verdict_w, out_w, err_w):
            os.close(fd)
    caps = {out_r: limits.output_bytes, err_r: limits.output_bytes, verdict_r: _VERDICT_BYTES}
    exited = False  # until the pidfd says so: a failure in between stops the run as at the deadline
    try:
        kept, exited = _collect(proc, caps, t0 + limits.wall_s)
    finally:
        _end(proc, uid, exited)
    stdout, stderr = (kept[fd].decode("utf-8", "replace") for fd in (out_r, err_r))
    passed, reason = _verdict(kept[verdict_r], nonce)
    if passed is None:
        passed, reason = False, _no_verdict(exited, proc.returncode, stderr)
    return RunResult(passed, reason, stdout, stderr, time.monotonic() - t0)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)  # the child shares this offset and reads from the start
    return fd


@functools.cache
def _harness_source() -> str:
    return Path(__file__).with_name("harness.py").read_text()


def _collect(proc: subprocess.Popen, caps: dict[int, int], deadline: float) -> tuple[dict[int, bytes], bool]:
    """Read every pipe up to its cap until all are closed and the run has exited, or the deadline; close the
    pipes. Returns (what was kept per fd, whether the run exited in time). The run is not reaped here (a
    pidfd says it exited), so its process group id stays its own until `_end`."""
    pidfd = os.pidfd_open(proc.pid)
    kept = {fd: bytearray() for fd in caps}
    exited = False
    open_fds = {*caps, pidfd}
    sel = selectors.DefaultSelector()
    try:
        for fd in open_fds:
            sel.register(fd, selectors.EVENT_READ)
        while open_fds and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                if key.fd == pidfd:
                    exited = True
                else:
                    chunk = os.read(key.fd, 1 << 16)
                    room = caps[key.fd] - len(kept[key.fd])
                    kept[key.fd] += chunk[:room]
                    if chunk and len(chunk) < room:
                        continue
                # exited, or the pipe closed or full: a writer past the cap gets EPIPE, so nothing blocks
                sel.unregister(key.fd)
                os.close(key.fd)
                open_fds.discard(key.fd)
    finally:
        sel.close()
        for fd in open_fds:
            os.close(fd)
    return {fd: bytes(v) for fd, v in kept.items()}, exited


def _end(proc: subprocess.Popen, uid: int | None, exited: bool) -> None:
    """Stop the run and reap it. As root, SIGKILL every process of the run's uid (the outer bwrap's PID 1
    among them: its namespace's processes are killed and reaped by the kernel, then the outer bwrap reaps it
    and exits), so nothing is left to be reparented; as a user, or if that did not end it, SIGKILL the
    process group (the PID namespaces die with their PID 1)."""
    if uid is not None and not exited:
        _kill_all(uid)
    try:
        proc.wait(timeout=_STOP_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group id is still ours: the bwrap was not reaped before
    except ProcessLookupError:
        pass
    proc.wait()
    if uid is not None:
        deadline = time.monotonic() + _STOP_S
        while _kill_all(uid) and time.monotonic() < deadline:
            time.sleep(0.01)


def _kill_all(uid: int) -> bool:
    """SIGKILL every process of `uid`; whether there was one."""
    found = bwrap.processes_of(uid)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return bool(found)


def _verdict(raw: bytes, nonce: str) -> tuple[bool | None, str]:
    """(passed, why not) from the verdict pipe's bytes; None when the harness wrote nothing."""
    if not raw:
        return None, ""
    head = nonce.encode() + b" "
    if not (raw.startswith(head) and raw.endswith(b"\n") and raw.count(b"\n") == 1):
        return False, "bad verdict: the verdict pipe held more or other than the harness's one line"
    body = raw[len(head) : -1].decode("utf-8", "replace")
    if body == "pass":
        return True, ""
    return False, body.removeprefix("fail ")


def _no_verdict(exited: bool, code: int | None, stderr: str) -> str:
    if not exited:
        return "timeout"
    if code is not None and code > 128 and code - 128 in signal.valid_signals():
        how = f"killed by {signal.Signals(code - 128).name}"  # bwrap passes a signal on as 128 + its number
    elif code is not None and code < 0:
        how = f"killed by {signal.Signals(-code).name}"
    else:
        how = f"exit {code}"
    last = stderr.strip().splitlines()[-1][:200] if stderr.strip() else ""
    return f"no verdict: the run ended before its tests finished ({how})" + (f": {last}" if last else "")


def _host() -> tuple[bwrap.Tool, bwrap.Interpreter, seccomp.Arch]:
    """What a run needs from this host, or UserError in one line naming what to install."""
    try:
        arch = seccomp.host_arch()
    except ValueError as e:
        raise UserError(f"CodeRunner: {e}: run the code rewards on one of those") from None
    tool, py = bwrap.find_bwrap(), bwrap.interpreter()
    if os.geteuid() == 0:
        bwrap.setpriv()
    return tool, py, arch


@functools.cache
def _refusal() -> str:
    """'' when a trivial job passes in the sandbox here, else the one line that says why it cannot."""
    try:
        res = run_python("", "")
    except UserError as e:
        return str(e)
    if res.passed:
        return ""
    return (
        f"CodeRunner's sandbox does not start on this host ({res.reason}); most often the host forbids user "
        "namespaces: allow them (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0) or run as root"
    )


def ready() -> None:
    """Raise UserError (one line) unless the sandbox works on this host; tried once per process."""
    if why := _refusal():
        raise UserError(why)


def containment(limits: Limits = Limits()) -> dict[str, str]:
    """The guards a run gets on this host, for the log and the docs."""
    if why := _refusal():
        return {"sandbox": f"refused: {why}"}
    tool, py, _ = _host()
    root = os.geteuid() == 0
    return {
        "sandbox": f"{bwrap.bwrap_version(tool.exe)} ({tool.exe})",
        "user": ("a fresh host uid per run (setpriv from root)" if root else f"host uid {os.getuid()}")
        + f"; {bwrap.SANDBOX_UID} in a new user namespace, no capabilities, no-new-privs",
        "namespaces": "user (no nested ones), mount, pid, network (loopback only), ipc, uts, cgroup",
        "files": f"read-only: {py.prefix} and the system library folders; writable: a private tmpfs /tmp "
        f"of {limits.scratch_bytes} bytes; nothing else of the host",
        "syscalls": "seccomp: EPERM for ptrace, process_vm_*, mount and the new mount API, unshare, setns, bpf, "
        "perf_event_open, io_uring, keys, modules, kexec, userfaultfd, personality, sockets other than "
        "AF_UNIX, namespace flags on clone, TIOCSTI; ENOSYS for clone3; exec once the harness is up",
        "limits": f"per process: {limits.cpu_s} s CPU, {limits.memory_bytes} bytes of address space, "
        f"{limits.file_bytes} bytes a file, {limits.open_files} fds, no core; {limits.processes} processes "
        f"in the run; {limits.wall_s} s wall clock, then the whole run is killed",
        "verdict": "the harness's line with the run's nonce, over a pipe; not the exit code",
    }


class CodeRunner(Environment):
    """Reward 1 when the harness reports that the completion, and then the problem's unit tests, ran to the end
    within the limits."""

    def __init__(self, limits: Limits = Limits()):
        ready()
        self.limits = limits
        self.timeout_s = limits.wall_s

    def score(self, problem: Problem, completion: str) -> Outcome:
        if problem.tests is None:
            raise ValueError("CodeRunner needs problems with tests")
        res = run_python(completion, problem.tests, self.limits)
        return Outcome(1.0 if res.passed else 0.0, res.reason, res.seconds)
