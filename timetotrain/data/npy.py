"""`save`: an array into an open (staged) file as `.npy`, the bytes `np.save` writes, through `f.write`;
`load_small`: a small `.npy` a user names (token counts, empty-prompt encodings), read with a bound.

For a real file numpy writes with `ndarray.tofile`, which reports a short write on a full disk as
`OSError: 32768 requested and 16352 written`, with no errno: the CLI cannot tell that from a bug and showed
a traceback (`ttt data prepare govreport` on a full disk, issue 37). Through `f.write` the OS's own error
(ENOSPC, EDQUOT, EFBIG) reaches the caller, which words it in one line.
"""

from __future__ import annotations

import io
import os
from typing import IO

import numpy as np

from timetotrain import fileio


class _Writes:
    """Only `write` of a file: numpy then takes its chunked path (16 MiB at a time) instead of tofile."""

    def __init__(self, f: IO[bytes]):
        self.write = f.write


def save(f: IO[bytes], arr) -> None:
    np.lib.format.write_array(_Writes(f), np.asanyarray(arr), allow_pickle=False)


def load_small(path: str | os.PathLike, what: str, limit: int | None = None) -> np.ndarray:
    """A `.npy` of at most `limit` bytes, no pickles: a larger or endless file (a FIFO, /dev/zero, a
    mislabelled dataset) is one line naming it, not an unbounded read (`fileio.read_bounded`). OSError and
    numpy's ValueError for a malformed file are the caller's to word."""
    data = fileio.read_bounded(path, limit or fileio.SMALL_FILE, what)
    return np.load(io.BytesIO(data), allow_pickle=False)
