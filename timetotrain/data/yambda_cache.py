"""The dlrmv4 reference's flat-event cache, `processed_<size>/hstu_cache_L<history_length>/`, read in place.

MLCommons' prepared download ships this cache instead of train_sessions.parquet (README.MD:64-82): the trainer
opens only it and the two item mappings. It is what `_ensure_cache_built` writes (yambda.py:385-544): one
.npy per flat column in (uid, session_id) order, the pool flags, user_start/user_end by uid, unique_uids,
store_meta.json, positions_L<L>[_m<min_history>].npy, and the _READY sentinel written last. Each array is
memory-mapped read-only (np.load, never a pickle) and checked in chunks, so the 4.76 B events of Yambda-5B
are validated without a second copy in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from timetotrain.data import yambda_layout as yambda
from timetotrain.errors import UserError

# name -> (Events field, dtype kind) (yambda.py:102-108)
COLUMNS = {
    "flat_uid": ("uid", "i"),
    "flat_item_ids": ("item", "i"),
    "flat_timestamps": ("ts", "i"),
    "flat_event_types": ("etype", "i"),
    "flat_played_ratio": ("ratio", "f"),
    "flat_is_organic": ("organic", "i"),
    "flat_is_listen_plus": ("is_lp", "b"),
    "flat_is_like": ("is_like", "b"),
    "flat_is_skip": ("is_skip", "b"),
    "user_start": ("user_start", "i"),
    "user_end": ("user_end", "i"),
}
CHUNK = 1 << 26


def cache_dir(processed: Path, history_length: int) -> Path:
    return Path(processed) / f"hstu_cache_L{history_length}"  # yambda.py:302-303


def positions_name(history_length: int, min_history: int) -> str:
    """yambda.py:326-333: the legacy name when the floor equals the gather cap."""
    if min_history == history_length:
        return f"positions_L{history_length}.npy"
    return f"positions_L{history_length}_m{min_history}.npy"


def _load(path: Path, kind: str) -> np.ndarray:
    fix = "download the prepared dataset again into a new folder, or delete the cache folder to rebuild"
    if not path.is_file():
        raise UserError(f"{path}: missing from the cache (no _READY without it); {fix}")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not a readable .npy ({str(e).splitlines()[0][:80]}); {fix}") from None
    if arr.ndim != 1 or arr.dtype.kind != kind:
        raise UserError(f"{path}: a {arr.ndim}-d {arr.dtype} array, not 1-d of kind {kind!r}; {fix}")
    return arr


def _chunks(n: int):
    for a in range(0, n, CHUNK):
        yield a, min(n, a + CHUNK)


def read_cache(folder: Path) -> yambda.Events:
    """The cache's Events, every rule of `yambda.read_sessions` checked chunk by chunk."""
    cols = {field: _load(folder / f"{name}.npy", kind) for name, (field, kind) in COLUMNS.items()}
    n = len(cols["uid"])
    for field, arr in cols.items():
        if field not in ("user_start", "user_end") and len(arr) != n:
            raise UserError(
                f"{folder}: {field} has {len(arr)} entries, flat_uid {n}: the cache is incomplete"
            )
    meta = folder / "store_meta.json"
    try:
        total = int(json.loads(meta.read_text())["total_events"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{meta}: unreadable or without total_events ({type(e).__name__})") from None
    if total != n:
        raise UserError(f"{meta}: total_events {total:,} but flat_uid has {n:,}: the cache is incomplete")
    uid, ts, et = cols["uid"], cols["ts"], cols["etype"]
    for a, b in _chunks(n):
        lo = max(a - 1, 0)  # one event of overlap: order is checked across chunk edges
        u, t, e = uid[lo:b], ts[lo:b], et[lo:b]
        if (np.diff(u) < 0).any():
            raise UserError(f"{folder / 'flat_uid.npy'}: uids are not in ascending order (user-major)")
        back = (u[1:] == u[:-1]) & (t[1:] < t[:-1])
        if back.any():
            i = lo + int(np.flatnonzero(back)[0]) + 1
            raise UserError(
                f"{folder / 'flat_timestamps.npy'}: timestamps go back in time within user {int(uid[i])} at "
                f"event {i:,}; rebuild the cache from a preprocessed train_sessions.parquet"
            )
        if ((e < 0) | (e > max(yambda.EVENT_TYPES.values()))).any():
            raise UserError(f"{folder / 'flat_event_types.npy'}: an event type outside 0..4")
    start = cols["user_start"]
    present = np.flatnonzero(start >= 0)
    if n and (len(present) == 0 or (uid[start[present]] != present).any()):
        raise UserError(f"{folder / 'user_start.npy'}: does not match flat_uid; the cache is inconsistent")
    return yambda.Events(**cols)


def anchor_positions(
    ev: yambda.Events, min_history: int, folder: Path | None = None, history_length: int = 0
):
    """LISTEN events with at least `min_history` earlier events of their user (yambda.py:369-373): the
    cache's positions file when there is one, else computed in chunks."""
    if folder is not None:
        p = folder / positions_name(history_length, min_history)
        if p.is_file():
            pos = _load(p, "i")
            if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= len(ev.uid)):
                raise UserError(f"{p}: anchor positions beyond the {len(ev.uid):,} events")
            return pos
    parts = []
    for a, b in _chunks(len(ev.uid)):
        idx = np.arange(a, b, dtype=np.int64)
        keep = (idx - ev.user_start[ev.uid[a:b]] >= min_history) & (ev.etype[a:b] == yambda.LISTEN)
        parts.append(idx[keep])
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
