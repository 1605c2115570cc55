"""What a killed `ttt` leaves behind: no process, no temporary file.

A SIGKILL (the OOM killer, `kill -9`, a scheduler) gives the killed process no chance to clean up, so
the clean-up must live elsewhere:

- Child processes die with their parent: `die_with_parent()` runs in the child (after fork, before any
  work) and asks Linux for a signal when the parent dies (`prctl(PR_SET_PDEATHSIG)`). The request is
  tied to the thread that forked the child; every caller here forks from the main thread. Elsewhere
  (macOS, BSD) there is no such call: the children then notice the parent's death only through their
  pipes (a tokenizer worker's `recv` ends with EOF, data/workers.py) and `ttt suite`'s children keep
  running until they end on their own (documented in docs/reliability.md).
- Temporary outputs are removed by a guardian: `guard_temporaries(folder)` forks a small process that
  waits for its parent to go away (end of file on a pipe only the parent writes to) and then removes
  the parent's temporaries in that folder, the dot-names tagged with the parent's pid that `fileio.Staged`
  and `IndexedWriter` write (`.NAME.<pid>.tmp`, `.PREFIX.<pid>.bin`). After a normal exit or a caught
  signal the parent has removed or renamed them itself and the guardian finds nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once, in the parent: after a fork only this call is made (no dlopen in the child).
_PRCTL = _load_prctl()


def supported() -> bool:
    """Whether children can be told to die with their parent on this system."""
    return _PRCTL is not None


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """In a freshly forked child: receive `sig` when the parent dies. If the parent already died
    between the fork and this call (its pid is no longer our parent), exit at once: nobody waits for us."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(128 + int(sig))


def preexec(sig: int = signal.SIGTERM):
    """A `subprocess.Popen(preexec_fn=...)` that makes the child die with this process."""
    parent = os.getpid()

    def _child() -> None:
        die_with_parent(parent, sig)

    return _child


def _is_ours(name: str, pid: int) -> bool:
    return f".{pid}." in name and (name.startswith(".") or name.endswith(".tmp"))


def sweep(folder: Path, pid: int) -> list[Path]:
    """Remove `pid`'s temporaries directly in `folder` (see the module docstring); returns them."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if _is_ours(name, pid):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
                removed.append(Path(folder) / name)
    return removed


@contextlib.contextmanager
def guard_temporaries(folder: Path) -> Iterator[None]:
    """While the block runs, a guardian process removes this process's temporaries in `folder` if this
    process dies (SIGKILL included). Enter it before forking workers: they inherit the pipe's write end
    too, and die with us (die_with_parent), so the guardian sees end of file once all of us are gone."""
    if not hasattr(os, "fork"):
        yield
        return
    me = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the guardian: nothing but a read, a listing and unlinks, then _exit
        try:
            os.setpgid(0, 0)  # a SIGKILL to our parent's process group must not take us with it
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(s, signal.SIG_IGN)
            os.closerange(0, r)  # the terminal's and the parent's files are not ours to hold
            os.closerange(r + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
            while os.read(r, 64):
                pass
            sweep(Path(folder), me)
        finally:
            os._exit(0)
    os.close(r)
    try:
        yield
    finally:
        os.close(w)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
