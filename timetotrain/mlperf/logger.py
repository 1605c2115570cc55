"""MLPerf result logs written through the official `mlperf_logging.mllog`.

One new file per run, `result_<k>.txt`: an existing result is never overwritten or appended to
(appending breaks the compliance checker's EXACTLY_ONE keys).

Crash safety. While the run is live its log is `result_<k>.txt.partial`; only once `run_start` and then
`run_stop` are written and fsynced is it renamed to `result_<k>.txt`. So a result file is always a run
that ran: its clock started and it stopped (success, or aborted by the rules). A run that stops before
`run_start` (an error or a signal during init) removes its `.partial`: no clock ran, nothing in it is a
measurement, the reason is on stderr, and a kept file would read as a killed run. A run that was killed
(SIGKILL, OOM killer, power loss) leaves only a `.partial`, which `ttt score`/`package`/`report` skip with
a note. The index k is reserved by creating the `.partial` exclusively (O_CREAT|O_EXCL), with k above
every existing `result_<k>.txt`, `.partial` and `.signalled`, so runs started together never share an
index and a killed or set-aside run's k is never reused.

A run stopped by a signal logs `ttt_stop_signal` (the signal's name) just before its `run_stop aborted`:
`ttt suite` sets such logs aside as `result_<k>.txt.signalled` (not a result: the glob `result_*.txt`
never matches it) and runs the seed again. A failed write (a full disk: ENOSPC) stops the run at once with a
UserError: a log missing lines is not a result, and training on would only waste the allocation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from pathlib import Path

from mlperf_logging.mllog.mllog import MLLogger

from timetotrain.errors import UserError
from timetotrain.fileio import fsync_dir

PARTIAL = ".partial"
SIGNALLED = ".signalled"  # a result a signal stopped, set aside by `ttt suite` (cli/suite_driver.py)
_RESULT_RE = re.compile(r"result_(\d+)\.txt(?:\.partial|\.signalled)?$")


def check_writable(directory: Path, flag: str = "--logdir") -> Path:
    """Create the directory if needed and prove we can create a file in it. Fast: no model, no data."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = _mkstemp(directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(
            f"{flag} {directory} is not writable ({e.strerror}): pass a directory you can write to"
        ) from e
    return directory


def _mkstemp(directory: Path):
    return tempfile.mkstemp(prefix=".ttt-probe-", dir=directory)


def next_index(directory: Path) -> int:
    """One above every result index in `directory`: finished (`.txt`), live or killed (`.txt.partial`) or
    set aside (`.txt.signalled`)."""
    taken = [int(m.group(1)) for p in directory.iterdir() if (m := _RESULT_RE.match(p.name))]
    return max(taken) + 1 if taken else 0


def next_result_path(directory: Path) -> Path:
    return directory / f"result_{next_index(directory)}.txt"


def reserve(directory: Path, attempts: int = 100) -> tuple[Path, int]:
    """Claim a fresh index: (final path, fd of its new `.partial`)."""
    for _ in range(attempts):
        final = next_result_path(directory)
        partial = final.with_name(final.name + PARTIAL)
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue  # another run took this index between our listing and our create
        except OSError as e:
            raise UserError(f"cannot create {partial} ({e.strerror}): check --logdir") from e
        if final.exists():
            # Our listing was stale: that run finished (renamed its .partial) before our create. The name
            # is its; give the index back and look again.
            os.close(fd)
            os.unlink(partial)
            continue
        return final, fd
    raise UserError(f"could not claim a new result file in {directory}")


def _write_all(fd: int, data: bytes) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


class _FileHandler(logging.Handler):
    """Each record straight to the file (one write, as the stream handler's per-record flush did). Unlike
    logging's own handlers, a write error is not printed and forgotten: it is kept for ResultLog to raise,
    and nothing more is written (a line after a gap would be worse than no line)."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd
        self.error: OSError | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is not None or self.fd < 0:
            return
        try:
            _write_all(self.fd, (self.format(record) + "\n").encode("utf-8"))
        except OSError as e:
            self.error = e


class _EchoFilter(logging.Filter):
    """Per-step keys go to the file only; the console would drown in them."""

    QUIET = {"train_loss", "tracked_stats", "ttt_rollout_stats"}

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(f'"key": "{k}"' in msg for k in self.QUIET)


class ResultLog:
    """An MLLOG writer bound to one fresh result file (or to nothing on non-zero ranks). `path` is the
    final name; `live_path` the `.partial` written while the run is live."""

    def __init__(self, directory: Path | None, echo: bool = False):
        self.path: Path | None = None
        self.live_path: Path | None = None
        self._handler: _FileHandler | None = None
        self.started = False  # run_start is in the file: the clock ran
        self._stopped = False  # run_stop is in the file
        self._raised = False
        self._close_lock = threading.Lock()
        # Called with (key, value, metadata) after each record: experiment trackers (train/trackers.py)
        # see the values the log holds, with no read of their own.
        self.listeners: list = []
        logger = logging.getLogger(f"timetotrain.mllog.{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        if directory is not None:
            self.path, fd = reserve(directory)
            self.live_path = self.path.with_name(self.path.name + PARTIAL)
            self._handler = _FileHandler(fd)
            self._handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(self._handler)  # first: a failed write stops the record before the echo
            if echo:
                out = logging.StreamHandler(sys.stdout)
                out.addFilter(_EchoFilter())
                logger.addHandler(out)
        else:
            logger.addHandler(logging.NullHandler())
        self._logger = logger
        # stack offset 3: the caller of event()/start()/end() below is the line recorded in metadata.
        self._ml = MLLogger(logger=logger, default_stack_offset=3, root_dir=_package_root())

    def event(self, key, value=None, metadata=None, **kw):
        self._log(self._ml.event, key, value, metadata, kw)

    def start(self, key, value=None, metadata=None, **kw):
        self._log(self._ml.start, key, value, metadata, kw)

    def end(self, key, value=None, metadata=None, **kw):
        self._log(self._ml.end, key, value, metadata, kw)

    def _log(self, fn, key, value, metadata, kw) -> None:
        fn(key=key, value=value, metadata=metadata, **kw)
        for listen in self.listeners:
            listen(key, value, metadata)
        h = self._handler
        if h is None:
            return
        if h.error is not None:
            if not self._raised:  # once: the run's own error path then writes nothing more
                self._raised = True
                e = h.error
                raise UserError(
                    f"cannot write the result log {self.live_path} ({e.strerror or e}): the run is stopped; "
                    "free space (or fix the file system) and run again"
                ) from e
        elif key == "run_start":
            self.started = True
        elif key == "run_stop":
            self._stopped = True

    def close(self) -> None:
        """Flush and close; after a written run_start and run_stop, fsync and rename `.partial` ->
        `result_<k>.txt`; a log that never reached run_start is removed. Safe to call twice and from the
        abort watcher thread."""
        with self._close_lock:
            for h in list(self._logger.handlers):
                h.flush()
                self._logger.removeHandler(h)
            h = self._handler
            if h is None or h.fd < 0:
                return
            with h.lock:  # no record is being written while the file goes away
                fd, h.fd = h.fd, -1
            if not self.started:  # stopped during init: not a run (see the module docstring)
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(self.live_path)
                return
            finished = self._stopped and h.error is None
            try:
                os.fsync(fd)  # also for an unfinished log: whatever was written is worth keeping
            except OSError:
                finished = False
            finally:
                os.close(fd)
            if finished:
                try:
                    os.rename(self.live_path, self.path)
                except OSError as e:
                    raise UserError(
                        f"cannot rename {self.live_path} to {self.path.name} ({e.strerror}): the run finished; "
                        "rename it by hand"
                    ) from e
                fsync_dir(self.path.parent)


def _package_root() -> str:
    # mllog strips "<root_dir>/" from caller paths, so metadata reads "timetotrain/train/loop.py".
    return str(Path(__file__).resolve().parents[2])
