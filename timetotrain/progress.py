"""A live status line on a terminal; sparse plain lines when output is a file or a pipe."""

from __future__ import annotations

import sys
import time


class LiveLine:
    def __init__(self, stream=None, min_interval: float = 0.25, plain_interval: float = 30.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.min_interval = min_interval if self.tty else plain_interval
        self._last = 0.0
        self._width = 0

    def update(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        self._last = now
        if self.tty:
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
