"""SIGTERM/SIGINT as an exception in the main thread, for commands that must clean up when stopped.

`ttt data prepare` runs under `raise_on_signals()`: a signal raises `Interrupted` wherever the main thread
is (waiting on tokenizer workers included), so the `with` blocks on the way out stop the workers and
remove the temporary outputs. Python's default SIGTERM action would end the process at once and leave
them behind. Sections that must not be split (renaming a set of outputs into place) run under
`deferred()`: a signal arriving there is raised when the section ends.

`ttt run` does not use this: training takes signals on a watcher thread (train/abort.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from timetotrain.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_state = {"depth": 0, "deferring": 0, "pending": None}


def _handler(signum, frame) -> None:
    if _state["deferring"]:
        _state["pending"] = _state["pending"] or signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def raise_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT raise `Interrupted` in the main thread (elsewhere: no effect,
    only the main thread can own signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _handler) for s in SIGNALS}
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal that arrives within the block is raised when it ends, not in the middle."""
    _state["deferring"] += 1
    try:
        yield
    finally:
        _state["deferring"] -= 1
        if not _state["deferring"] and _state["pending"] is not None:
            signum, _state["pending"] = _state["pending"], None
            if _state["depth"]:
                raise Interrupted(signum)
