"""Ending a run cleanly when it must end: signals, a stuck collective, a failed peer rank.

SIGTERM/SIGINT are taken by a dedicated thread (`sigwait`), not by a Python handler: a handler only runs
when the main thread returns to the interpreter, which never happens while it is blocked inside a
collective waiting for a rank that died. The thread sets a flag the training loop reads between steps; if
the loop has not finished within `grace` seconds, the thread writes `run_stop aborted` itself, flushes the
log and exits the process. torchrun SIGTERMs every worker when one fails and SIGKILLs them 30 s later, so
a grace below that keeps rank 0's log complete.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

WATCHED = (signal.SIGTERM, signal.SIGINT)
_WAKE = signal.SIGUSR2  # sent to our own thread to end it when the run is over


class Aborter:
    """Use as a context manager around the whole command, entered before torch starts any thread (the
    CLI does this first thing), so every later thread inherits the blocked signals."""

    def __init__(self, on_timeout: Callable[[int], None] | None = None, grace: float = 10.0):
        """`on_timeout(signum)` runs on the watcher thread when the loop did not stop in time; it should
        log run_stop and flush. The process then exits with 128 + signum."""
        self.caught: int | None = None
        self.grace = grace
        self.on_timeout = on_timeout
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_mask = None

    def __enter__(self) -> Aborter:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals only reach the main thread's process; nothing to arrange
        self._old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {*WATCHED, _WAKE})
        self._thread = threading.Thread(target=self._watch, name="ttt-abort", daemon=True)
        self._thread.start()
        return self

    def arm(self, on_timeout: Callable[[int], None] | None, grace: float) -> None:
        """A new run starts: this is what to do if it does not stop in time."""
        self.on_timeout, self.grace = on_timeout, grace
        self._done.clear()

    def _watch(self) -> None:
        sig = signal.sigwait({*WATCHED, _WAKE})
        if sig == _WAKE:
            return
        self.caught = sig
        if self._done.wait(self.grace):
            return
        try:
            if self.on_timeout is not None:
                self.on_timeout(sig)
        finally:
            os._exit(128 + sig)

    def finish(self) -> None:
        """The run has logged run_stop: nothing more for the watcher to do."""
        self._done.set()

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            if self._thread.is_alive():
                signal.pthread_kill(self._thread.ident, _WAKE)
                self._thread.join(timeout=5)
            signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)
