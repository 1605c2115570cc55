"""A live status line on a terminal; sparse plain lines when output is a file or a pipe."""

from __future__ import annotations

import math
import os
import sys
import time


class LiveLine:
    """`quiet_s`: unforced updates stay silent for that long after the line is made, so work that is
    usually quick (a small checkpoint) prints nothing unless it turns out slow."""

    def __init__(
        self, stream=None, min_interval: float = 0.25, plain_interval: float = 30.0, quiet_s: float = 0.0
    ):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.min_interval = min_interval if self.tty else plain_interval
        self._last = -math.inf  # the first update prints, however recently the clock started
        self._width = 0
        self._quiet_until = time.monotonic() + quiet_s
        self.shown = False  # whether any update has printed

    def due(self) -> bool:
        """Whether an unforced update would print now: build a costly text (one that reads a loss off the
        device, a sync) only then."""
        now = time.monotonic()
        return now >= self._quiet_until and now - self._last >= self.min_interval

    def update(self, text: str, force: bool = False) -> None:
        if not force and not self.due():
            return
        self._last = time.monotonic()
        self.shown = True
        if self.tty:
            # One row: a line wider than the terminal wraps, and "\r" would rewrite only its last row.
            cols = _columns(self.stream)
            text = text[: max(20, cols - 1)] if cols else text
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def print(self, text: str) -> None:
        """A permanent line above the live one."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def _columns(stream) -> int:
    """The terminal's width (COLUMNS first, as shells set it), or 0 where unknown."""
    try:
        return int(os.environ.get("COLUMNS", "0")) or os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0
