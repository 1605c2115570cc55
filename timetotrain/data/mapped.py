"""Memory-mapped .npy files that a run reads during the timed part, and the check that they did not change
under it.

Reading a page of a mapping beyond the end of a file that shrank raises SIGBUS, which kills the process with
no log line; a file rewritten in place serves a mix of old and new values. Each map here is made from an
open file object, so `check_unchanged` fstat()s the very inode that is mapped (about a microsecond a file),
whatever the name points to later: a file *replaced* by a rename, as every ttt writer does, is harmless and
not flagged. Readers call it before each batch's reads; IndexedDataset watches its .bin/.idx with it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from timetotrain.data.manifest import RECOPY
from timetotrain.errors import UserError

__all__ = ["DataChangedError", "MappedFiles"]


class DataChangedError(UserError):
    """A file a live run maps was truncated or rewritten in place: the run aborts with this one line."""


class MappedFiles:
    """The .npy files one reader maps, each with the size and mtime it had when opened."""

    def __init__(self) -> None:
        self._files: list[tuple[Path, object, tuple[int, int]]] = []

    def watch(self, path: str | os.PathLike):
        """Open `path` for mapping, keep it open and remember its size and mtime: map from the returned file
        object, so `check_unchanged` fstat()s the inode that is mapped, whatever the name points to later."""
        path = Path(path)
        try:
            f = open(path, "rb")  # noqa: SIM115 - open as long as the map: check_unchanged fstat()s it
        except OSError as e:
            raise UserError(f"{path} cannot be read ({e.strerror}): {RECOPY}") from e
        st = os.fstat(f.fileno())
        self._files.append((path, f, (st.st_size, st.st_mtime_ns)))
        return f

    def load(self, path: str | os.PathLike) -> np.ndarray:
        """`np.load(path, mmap_mode="r")`, mapped from a file object this keeps open and watches."""
        path = Path(path)
        f = self.watch(path)
        try:
            shape, dtype, order, offset = _header(f, path)
            st = os.fstat(f.fileno())
            need = offset + math.prod(shape) * dtype.itemsize
            if st.st_size < need:
                raise UserError(f"{path} is truncated ({st.st_size} bytes, its header says {need}): {RECOPY}")
            if math.prod(shape) == 0:  # numpy refuses to map nothing
                arr = np.empty(shape, dtype, order=order)
            else:
                arr = np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)
        except BaseException:
            self._files.pop()
            f.close()
            raise
        return arr

    def check_unchanged(self) -> None:
        """Raise DataChangedError if a mapped file was truncated or rewritten in place since it was opened.
        The reads that follow a check can still fault if the file is cut in the microseconds between them."""
        for path, f, (size, mtime) in self._files:
            st = os.fstat(f.fileno())
            if st.st_size != size or st.st_mtime_ns != mtime:
                change = "truncated" if st.st_size < size else "modified"
                raise DataChangedError(
                    f"{path} was {change} while this run was reading it ({size} bytes when opened, now "
                    f"{st.st_size}): never write over data a run is using; {RECOPY}"
                )

    def close(self) -> None:
        for _, f, _ in self._files:
            f.close()
        self._files = []


def _header(f, path: Path) -> tuple[tuple[int, ...], np.dtype, str, int]:
    """(shape, dtype, order, data offset) of the .npy file open as `f`."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:  # 3.0 only differs for non-latin-1 field names, which no ttt file has
            raise ValueError(f"unsupported .npy format version {version}")
    except ValueError as e:
        raise UserError(f"{path} is not a readable .npy file ({e}): {RECOPY}") from e
    if dtype.hasobject:
        raise UserError(f"{path} holds Python objects, not numbers: {RECOPY}")
    return tuple(shape), dtype, "F" if fortran else "C", f.tell()
