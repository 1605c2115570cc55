"""MLPerf result logs written through the official `mlperf_logging.mllog`.

One new file per run, `result_<k>.txt`, created exclusively: an existing result is never overwritten or
appended to (appending breaks the compliance checker's EXACTLY_ONE keys).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from mlperf_logging.mllog.mllog import MLLogger

from timetotrain.errors import UserError

_RESULT_RE = re.compile(r"result_(\d+)\.txt$")


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
    import tempfile

    return tempfile.mkstemp(prefix=".ttt-probe-", dir=directory)


def next_result_path(directory: Path) -> Path:
    taken = [int(m.group(1)) for p in directory.iterdir() if (m := _RESULT_RE.match(p.name))]
    return directory / f"result_{max(taken) + 1 if taken else 0}.txt"


class _EchoFilter(logging.Filter):
    """Per-step keys go to the file only; the console would drown in them."""

    QUIET = {"train_loss", "tracked_stats"}

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(f'"key": "{k}"' in msg for k in self.QUIET)


class ResultLog:
    """An MLLOG writer bound to one fresh result file (or to nothing on non-zero ranks)."""

    def __init__(self, directory: Path | None, echo: bool = False):
        self.path: Path | None = None
        self._file = None
        logger = logging.getLogger(f"timetotrain.mllog.{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        if directory is not None:
            for _ in range(100):  # another process may take the same index between listdir and open
                path = next_result_path(directory)
                try:
                    self._file = open(path, "x", encoding="utf-8")  # noqa: SIM115 - closed in close()
                    break
                except FileExistsError:
                    continue
                except OSError as e:
                    raise UserError(f"cannot create {path} ({e.strerror}): check --logdir") from e
            else:
                raise UserError(f"could not claim a new result file in {directory}")
            self.path = path
            handler = logging.StreamHandler(self._file)
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            if echo:
                out = logging.StreamHandler(sys.stdout)
                out.addFilter(_EchoFilter())
                logger.addHandler(out)
        else:
            logger.addHandler(logging.NullHandler())
        self._logger = logger
        # stack offset 2: the caller of event()/start()/end() below is the line recorded in metadata.
        self._ml = MLLogger(logger=logger, default_stack_offset=2, root_dir=_package_root())

    def event(self, key, value=None, metadata=None, **kw):
        self._ml.event(key=key, value=value, metadata=metadata, **kw)

    def start(self, key, value=None, metadata=None, **kw):
        self._ml.start(key=key, value=value, metadata=metadata, **kw)

    def end(self, key, value=None, metadata=None, **kw):
        self._ml.end(key=key, value=value, metadata=metadata, **kw)

    def close(self) -> None:
        for h in list(self._logger.handlers):
            h.flush()
            self._logger.removeHandler(h)
        if self._file is not None:
            self._file.close()
            self._file = None


def _package_root() -> str:
    # mllog strips "<root_dir>/" from caller paths, so metadata reads "timetotrain/train/loop.py".
    return str(Path(__file__).resolve().parents[2])
