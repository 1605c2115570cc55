"""The two hashes of the dlrmv4 reference's Yambda reader, vectorized in numpy.

- `cross_hash`: the hashed cross features. The reference hashes one sample at a time with the `xxhash`
  package: xxh64(seed=salt) over the keys packed as little-endian int64, mod the table's rows
  (datasets/utils.py:108-123). Inputs here are 2 or 3 int64 keys, 16 or 24 bytes, so only xxh64's
  short-input path (under 32 bytes: no stripes, no 4- or 1-byte tails) applies; written out in uint64 numpy,
  it hashes a whole batch at once and needs no extra dependency. tests/test_yambda_data.py checks it
  against the `xxhash` package itself.
- `uid_unit_hash`: splitmix64's finalizer of uid + salt, the top 53 bits as a double in [0, 1): which users
  are held out for eval (datasets/yambda.py:61-80).
"""

from __future__ import annotations

import numpy as np

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)
_MASK = 0xFFFFFFFFFFFFFFFF


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def xxh64_int64s(cols: list[np.ndarray], seed: int = 0) -> np.ndarray:
    """xxh64 of each row's int64 keys packed little-endian (`struct.pack('<nq', ...)`), for n <= 3 keys."""
    n = len(cols)
    if not 1 <= n <= 3:
        raise ValueError(f"xxh64_int64s hashes 1 to 3 int64 keys (the short-input path), not {n}")
    lanes = [np.asarray(c, dtype=np.int64).view(np.uint64) for c in cols]
    with np.errstate(over="ignore"):
        h = np.full(lanes[0].shape, (seed + int(_P5) + 8 * n) & _MASK, dtype=np.uint64)
        for k in lanes:
            h ^= _rotl(k * _P2, 31) * _P1
            h = _rotl(h, 27) * _P1 + _P4
        h ^= h >> np.uint64(33)
        h *= _P2
        h ^= h >> np.uint64(29)
        h *= _P3
        h ^= h >> np.uint64(32)
    return h


def cross_hash(cols: list[np.ndarray], table_rows: int, salt: int = 0) -> np.ndarray:
    """The reference's `xxhash_cross` for a batch: row of the cross table, int64."""
    if len(cols) < 2:
        raise ValueError(f"a cross needs at least 2 keys, got {len(cols)}")  # as utils.py:120
    return (xxh64_int64s(cols, salt) % np.uint64(table_rows)).astype(np.int64)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def uid_unit_hash(uids: np.ndarray, salt: int = 0) -> np.ndarray:
    """Uniform [0, 1) per uid, a pure function of (uid, salt): uids at or above the train split fraction
    are the eval users (yambda.py:669-677)."""
    with np.errstate(over="ignore"):
        z = np.asarray(uids).astype(np.uint64) + _GOLDEN + np.uint64(salt & _MASK)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
