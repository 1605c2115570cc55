"""`save`: an array into an open (staged) file as `.npy`, the bytes `np.save` writes, through `f.write`.

For a real file numpy writes with `ndarray.tofile`, which reports a short write on a full disk as
`OSError: 32768 requested and 16352 written`, with no errno: the CLI cannot tell that from a bug and showed
a traceback (`ttt data prepare govreport` on a full disk, issue 37). Through `f.write` the OS's own error
(ENOSPC, EDQUOT, EFBIG) reaches the caller, which words it in one line.
"""

from __future__ import annotations

from typing import IO

import numpy as np


class _Writes:
    """Only `write` of a file: numpy then takes its chunked path (16 MiB at a time) instead of tofile."""

    def __init__(self, f: IO[bytes]):
        self.write = f.write


def save(f: IO[bytes], arr) -> None:
    np.lib.format.write_array(_Writes(f), np.asanyarray(arr), allow_pickle=False)
