"""Atomic file writes, and bounded reads of the files a user names.

Writes: every file ttt writes (manifests, token counts, summaries, RCP files, package and
report outputs) goes through `atomic_write`, so a reader, a crash or a full disk never leaves a half-written
file under the final name: the data goes to a temporary file in the same folder (same filesystem, so the
rename is atomic), is fsynced, and only then replaces the target; the folder is fsynced so the rename
itself survives a power loss. On any error the temporary file is removed and the target is untouched.

The live MLPerf result log is the exception (it grows during the run): see mlperf/logger.py.

Reads: a file a user names (a --config, a manifest, a metadata file, a log) is read through `read_bounded`,
so /dev/zero, a device or a wrong file of gigabytes is one line, not a MemoryError traceback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from timetotrain.errors import UserError
from timetotrain.interrupt import deferred

TMP_SUFFIX = ".tmp"
# Bounds of `read_bounded` and `bounded_lines`: a description (JSON, TOML, a metadata or checksum list, a
# tokenizer file), a large file read whole, and one line. The largest of ours: a 405B checkpoint's index (~100 kB), a Llama 3 tokenizer (2.2 MB), a
# result log of 10,000 evals (a few MB).
SMALL_FILE = 64 << 20
LARGE_FILE = 512 << 20  # a result log, a DCP checkpoint's .metadata
LINE = 64 << 20  # one line of a JSON-lines file (a GovReport record: a report of ~300 kB)
# Final paths that Staged sets have put in place, and final paths whose staged new version was dropped
# (an error or a signal before its commit), in this command: after a signal, the CLI says "stopped" only
# when nothing was put in place, and that the new output is complete when nothing was dropped.
COMPLETED: list[Path] = []
DISCARDED: list[Path] = []


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


class Staged:
    """Several outputs that must appear together or not at all (a prepared split: .bin, .idx, token counts,
    manifest). Each is written under a temporary dot-name next to its final name; leaving the `with` block
    normally fsyncs them all and renames them into place in the order they were added, with SIGTERM/SIGINT
    deferred so a signal cannot split the set; leaving it by an exception (or a signal) removes them, so an
    interrupted command leaves nothing half-written and the previous outputs untouched."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Path, Path]] = []

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()

    def add(self, tmp: str | os.PathLike, final: str | os.PathLike) -> None:
        """`tmp` (written by someone else, e.g. IndexedWriter) becomes `final` at commit."""
        self._pairs.append((Path(tmp), Path(final)))

    def path(self, final: str | os.PathLike) -> Path:
        """A temporary name for `final`, in the same folder, renamed to it at commit."""
        final = Path(final)
        tmp = final.parent / f".{final.name}.{os.getpid()}{TMP_SUFFIX}"
        self.add(tmp, final)
        return tmp

    def current(self, final: str | os.PathLike) -> Path:
        """Where `final`'s content is now: its temporary name until commit."""
        final = Path(final)
        return next((t for t, f in self._pairs if f == final), final)

    def open(self, final: str | os.PathLike, mode: str = "wb") -> IO:
        if mode not in ("w", "wb"):
            raise ValueError(f"Staged.open mode must be 'w' or 'wb', not {mode!r}")
        return open(self.path(final), mode, **({"encoding": "utf-8"} if mode == "w" else {}))  # noqa: SIM115

    def write_text(self, final: str | os.PathLike, text: str) -> None:
        with self.open(final, "w") as f:
            f.write(text)

    def commit(self) -> None:
        """fsync every temporary, then rename them all into place. A signal or an error while fsyncing
        removes the temporaries (the previous outputs stay as they were); the renames run with SIGTERM/SIGINT
        deferred, so a signal never splits the set, and one that arrived meanwhile is raised after the last
        rename, with the set recorded in COMPLETED."""
        pairs, self._pairs = self._pairs, []
        try:
            for tmp, _ in pairs:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException:
            self._pairs = pairs
            self.discard()
            raise
        done = 0
        try:
            with deferred():
                for tmp, final in pairs:
                    os.replace(tmp, final)
                    done += 1
                for folder in {final.parent for _, final in pairs}:
                    fsync_dir(folder)
                COMPLETED.extend(final for _, final in pairs)
        except BaseException:
            if done < len(pairs):  # a failed rename: the rest stays unwritten, its temporaries removed
                self._pairs = pairs[done:]
                self.discard()
            raise

    def discard(self) -> None:
        for tmp, final in self._pairs:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            DISCARDED.append(final)
        self._pairs = []


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of `path`, at most `limit`: a file larger than any of its kind (or endless, /dev/zero) is a
    one-line UserError naming it (`what`: the flag or the kind of file) rather than read whole into memory.
    An OSError (missing, unreadable) is the caller's to word."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError(
            f"{what} {path} holds more than {_size(limit)}, more than any such file: pass the right file"
        )
    return data


def bounded_lines(f: IO, limit: int, what: str) -> Iterator:
    """The lines of an open file (binary: bytes, text: characters, its newline translation kept), each of
    at most `limit`: a longer one (no newline in sight, /dev/zero or a binary file) is a one-line UserError
    naming `what` and the line number, not read on until memory runs out."""
    n = 0
    while line := f.readline(limit + 1):
        n += 1
        if len(line) > limit and line[-1:] not in (b"\n", "\n"):
            raise UserError(f"{what}:{n} is a line of more than {_size(limit)}: not a text file of records")
        yield line


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def folders_under(out: Path) -> set[Path]:
    """The folders under `out` (and `out` itself) that exist now."""
    if not out.is_dir():
        return set()
    return {out, *(p for p in out.rglob("*") if p.is_dir())}


def remove_new_empty_folders(out: Path, before: set[Path]) -> None:
    """Remove the folders under `out` (and `out`) made since `before` (`folders_under(out)` then) that hold
    no file, deepest first: what a stopped command made and left empty once its staged files were gone."""
    made = folders_under(out) - before
    for folder in sorted(made, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty: it holds a fetched source, kept for the next call
            folder.rmdir()
