"""Preflight scans for NaN and inf in prepared arrays (flux1's encodings, rgat's node features): a value that
is not finite poisons every step that reads it, hours into a run.

Arrays up to `FULL_SCAN_BYTES` are scanned whole. Larger ones (MLCommons' 2.5 TB of CC12M encodings, IGBH's
features) get a bounded scan: `CHUNKS` evenly spread runs of rows, `FULL_SCAN_BYTES` in all, which finds data
that is broken throughout (an encoder that overflowed, features written as garbage) but not one bad row; the
error says which scan found it. Checkpoint weights are scanned in train/checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from timetotrain.errors import UserError

FULL_SCAN_BYTES = 64 << 20
CHUNKS = 64


def spans(rows: int, row_bytes: int) -> tuple[list[tuple[int, int]], bool]:
    """Row ranges to scan, and whether they are all the rows."""
    if rows * row_bytes <= FULL_SCAN_BYTES:
        return [(0, rows)], True
    per = max(1, FULL_SCAN_BYTES // CHUNKS // max(row_bytes, 1))
    starts = np.linspace(0, rows - per, CHUNKS).astype(np.int64)
    return [(int(s), int(s) + per) for s in starts], False


def check_finite(path: Path, a: np.ndarray, remedy: str, as_float: Callable | None = None) -> None:
    """A one-line UserError naming `path` and the first row with a NaN or inf. `as_float` turns a chunk of
    the stored array into floats (bfloat16 bit patterns, for one)."""
    if a.ndim == 0 or len(a) == 0:
        return
    row_bytes = a.itemsize * (a.size // len(a))
    todo, whole = spans(len(a), row_bytes)
    for lo, hi in todo:
        chunk = np.asarray(a[lo:hi])
        values = as_float(chunk) if as_float is not None else chunk
        bad = ~np.isfinite(values.reshape(len(chunk), -1)).all(axis=1)
        if bad.any():
            row = lo + int(np.flatnonzero(bad)[0])
            scanned = sum(stop - start for start, stop in todo)
            how = "a full scan" if whole else f"a bounded scan of {scanned:,} of {len(a):,} rows"
            raise UserError(f"{path}: row {row:,} holds NaN or inf (found by {how}): {remedy}")
