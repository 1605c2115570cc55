"""Atomic file writes: every file ttt writes (manifests, token counts, summaries, RCP files, package and
report outputs) goes through `atomic_write`, so a reader, a crash or a full disk never leaves a half-written
file under the final name: the data goes to a temporary file in the same folder (same filesystem, so the
rename is atomic), is fsynced, and only then replaces the target; the folder is fsynced so the rename
itself survives a power loss. On any error the temporary file is removed and the target is untouched.

The live MLPerf result log is the exception (it grows during the run): see mlperf/logger.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

TMP_SUFFIX = ".tmp"


def fsync_dir(directory: Path) -> None:
    """Persist a rename or a new name in `directory`; some filesystems cannot open a folder, which is fine."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    # Reading the umask through os.umask() sets it for a moment, which races with other threads creating
    # files; Linux reports it in /proc instead.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", perms: int | None = None) -> Iterator[IO]:
    """`with atomic_write(p) as f: f.write(...)`: `p` holds all of it once the block ends, or is untouched.
    `mode` is "w" (text, UTF-8) or "wb"; `perms` sets the file mode (default: 0o666 less the umask, as
    `open` gives)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    # A dot name: `ls` and the result globs (result_*.txt) never see a temporary file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with open(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            # mkstemp makes 0o600; a manifest or a report should read like any other file the user writes.
            os.fchmod(f.fileno(), 0o666 & ~_umask() if perms is None else perms)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_text(path: str | os.PathLike, text: str, perms: int | None = None) -> None:
    with atomic_write(path, "w", perms) as f:
        f.write(text)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy `src` to `dst` through `atomic_write` (shutil.copyfile writes in place and never fsyncs)."""
    with open(src, "rb") as s, atomic_write(dst, "wb") as d:
        shutil.copyfileobj(s, d, 1 << 20)
