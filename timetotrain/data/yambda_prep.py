"""Yambda's raw events into the dlrmv4 reference's processed layout, as preprocess_public_data.py does it.

- Global temporal split (preprocess_public_data.py:425-442): test = the last `test_days` before the last
  timestamp, train = the `train_days` ending `gap_minutes` before the test; both half-open, so the event at
  the very last timestamp is in neither. Test events are kept only for users that have train events.
- Sessions (preprocess_public_data.py:444-467): a user's train events in time order; a gap of more than
  1,800 s starts a new session (session ids from 0 per user). Where two events of a user share a timestamp
  the reference's sort leaves their order unspecified; here it is the input order (a stable sort).
- The files (preprocess_public_data.py:366-392): train_sessions.parquet (one row per session, list columns),
  test_events.parquet, session_index.parquet, item_popularity.npy (train events per item), split_meta.json.

`RawEvents` holds the columns of Yambda's flat multi_event.parquet with event types already as 0..4. Users are
written in blocks (`SessionWriter`), each a whole set of users, so the full-size synthetic data streams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from timetotrain import fileio
from timetotrain.data import yambda_layout as yambda

SECONDS_PER_DAY = 86_400
SESSION_GAP_SECONDS = 1_800


@dataclass(frozen=True)
class Split:
    train_start: int
    train_end: int
    test_start: int
    test_end: int


def split_boundaries(t_max: int, train_days: int = 300, gap_minutes: int = 30, test_days: int = 1) -> Split:
    test_end = t_max
    test_start = test_end - test_days * SECONDS_PER_DAY
    train_end = test_start - gap_minutes * 60
    return Split(train_end - train_days * SECONDS_PER_DAY, train_end, test_start, test_end)


@dataclass
class RawEvents:
    """Flat events (one block of whole users): ratio and track length are float with NaN for null."""

    uid: np.ndarray
    ts: np.ndarray
    item: np.ndarray
    organic: np.ndarray
    etype: np.ndarray
    ratio: np.ndarray
    track_len: np.ndarray

    def take(self, idx) -> RawEvents:
        return RawEvents(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))


def session_ids(uid: np.ndarray, ts: np.ndarray, gap: int = SESSION_GAP_SECONDS) -> np.ndarray:
    """Per event (sorted by uid, then time): its session's number within its user, from 0."""
    if len(uid) == 0:
        return np.empty(0, dtype=np.int64)
    new = np.zeros(len(uid), dtype=np.int64)
    same = uid[1:] == uid[:-1]
    new[1:] = (same & (np.diff(ts) > gap)).astype(np.int64)
    run = np.cumsum(new)
    first = np.concatenate([[True], ~same])
    return run - np.maximum.accumulate(np.where(first, run, 0))


def _list(offsets: np.ndarray, values, pa):
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)


def _opt(x: np.ndarray, dtype, pa):
    """A nullable integer column from float with NaN for null."""
    null = np.isnan(x)
    return pa.array(np.where(null, 0, x).astype(dtype), mask=null)


class SessionWriter:
    """Writes the processed layout block by block under `root` (staged: all files appear at commit)."""

    def __init__(self, root: Path, staged: fileio.Staged, split: Split, size: str = "5b"):
        # heavy (pyarrow): loaded only where parquet is read, not on every `ttt` start
        import pyarrow as pa

        self.pa = pa
        self.root = Path(root)
        self.processed = self.root / f"processed_{size}"
        self.processed.mkdir(parents=True, exist_ok=True)
        self.staged, self.split, self.size = staged, split, size
        self.files: list[Path] = []
        self._writers: dict[str, object] = {}
        self._handles = []
        self.popularity = np.zeros(0, dtype=np.int64)
        self.counts = {"train_events": 0, "test_events": 0, "sessions": 0, "users": 0}

    def _write(self, name: str, table) -> None:
        # heavy (pyarrow): loaded only where parquet is read, not on every `ttt` start
        import pyarrow.parquet as pq

        if name not in self._writers:
            path = self.processed / name
            f = self.staged.open(path)
            self._handles.append(f)
            self._writers[name] = pq.ParquetWriter(f, table.schema)
            self.files.append(path)
        self._writers[name].write_table(table)

    def add(self, raw: RawEvents) -> None:
        """One block of whole users (any order: it is sorted here)."""
        pa, s = self.pa, self.split
        raw = raw.take(np.lexsort((raw.ts, raw.uid)))
        train_m = (raw.ts >= s.train_start) & (raw.ts < s.train_end)
        train = raw.take(train_m)
        test = raw.take((raw.ts >= s.test_start) & (raw.ts < s.test_end))
        test = test.take(np.isin(test.uid, np.unique(train.uid)))
        self._sessions(train)
        self._write(
            "test_events.parquet",
            pa.table(
                {
                    "uid": pa.array(test.uid.astype(np.uint32)),
                    "timestamp": pa.array(test.ts.astype(np.uint32)),
                    "item_id": pa.array(test.item.astype(np.uint32)),
                    "is_organic": pa.array(test.organic.astype(np.uint8)),
                    "event_type": pa.array(test.etype.astype(np.uint8)),
                    "played_ratio_pct": _opt(test.ratio, np.uint16, pa),
                    "track_length_seconds": _opt(test.track_len, np.uint32, pa),
                }
            ),
        )
        self.counts["test_events"] += len(test.uid)
        if len(train.item):
            top = int(train.item.max()) + 1
            if top > len(self.popularity):
                self.popularity = np.concatenate(
                    [self.popularity, np.zeros(top - len(self.popularity), np.int64)]
                )
            self.popularity += np.bincount(train.item, minlength=len(self.popularity))

    def _sessions(self, tr: RawEvents) -> None:
        pa = self.pa
        sid = session_ids(tr.uid, tr.ts)
        n = len(tr.uid)
        cut = np.ones(n, dtype=bool)
        if n:
            cut[1:] = (tr.uid[1:] != tr.uid[:-1]) | (sid[1:] != sid[:-1])
        starts = np.flatnonzero(cut)
        offsets = np.concatenate([starts, [n]])
        lens = np.diff(offsets)
        s_uid, s_id = tr.uid[starts], sid[starts]
        self._write(
            yambda.SESSIONS,
            pa.table(
                {
                    "uid": pa.array(s_uid.astype(np.uint32)),
                    "session_id": pa.array(s_id.astype(np.uint32)),
                    "item_ids": _list(offsets, pa.array(tr.item.astype(np.uint32)), pa),
                    "timestamps": _list(offsets, pa.array(tr.ts.astype(np.uint32)), pa),
                    "event_types": _list(offsets, pa.array(tr.etype.astype(np.uint8)), pa),
                    "is_organic": _list(offsets, pa.array(tr.organic.astype(np.uint8)), pa),
                    "played_ratio_pct": _list(offsets, _opt(tr.ratio, np.uint16, pa), pa),
                    "track_length_seconds": _list(offsets, _opt(tr.track_len, np.uint32, pa), pa),
                }
            ),
        )
        # session_index: per user its session ids, lengths and running end offsets (:469-480)
        ucut = np.ones(len(s_uid), dtype=bool)
        ucut[1:] = s_uid[1:] != s_uid[:-1]
        ustarts = np.flatnonzero(ucut)
        uoff = np.concatenate([ustarts, [len(s_uid)]])
        ends = np.cumsum(lens)
        ends = ends - np.repeat(np.concatenate([[0], ends])[ustarts], np.diff(uoff))
        self._write(
            "session_index.parquet",
            pa.table(
                {
                    "uid": pa.array(s_uid[ustarts].astype(np.uint32)),
                    "session_ids": _list(uoff, pa.array(s_id.astype(np.uint32)), pa),
                    "session_lens": _list(uoff, pa.array(lens.astype(np.uint32)), pa),
                    "session_offsets": _list(uoff, pa.array(ends.astype(np.uint32)), pa),
                }
            ),
        )
        self.counts["train_events"] += n
        self.counts["sessions"] += len(starts)
        self.counts["users"] += len(ustarts)

    def close(self, info: dict) -> list[Path]:
        """Finish the parquet files and write item_popularity.npy and split_meta.json; returns every file."""
        for w in self._writers.values():
            w.close()
        for f in self._handles:
            f.close()
        pop = self.processed / yambda.POPULARITY
        with self.staged.open(pop) as f:
            np.save(f, self.popularity, allow_pickle=False)
        s = self.split
        meta = {
            "size": self.size,
            "train_start": s.train_start,
            "train_end": s.train_end,
            "test_start": s.test_start,
            "test_end": s.test_end,
            "session_gap_seconds": SESSION_GAP_SECONDS,
            "num_train_events": self.counts["train_events"],
            "num_test_events": self.counts["test_events"],
            "num_sessions": self.counts["sessions"],
            "num_users": self.counts["users"],
            **info,
        }
        meta_path = self.processed / "split_meta.json"
        self.staged.write_text(meta_path, json.dumps(meta, indent=2) + "\n")
        return [*self.files, pop, meta_path]


def write_item_maps(
    root: Path, staged: fileio.Staged, item_artist: np.ndarray, item_album: np.ndarray
) -> list[Path]:
    """shared_metadata/{artist,album}_item_mapping.parquet: one row per item."""
    # heavy (pyarrow): loaded only where parquet is read, not on every `ttt` start
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = Path(root) / "shared_metadata"
    meta.mkdir(parents=True, exist_ok=True)
    items = pa.array(np.arange(len(item_artist), dtype=np.uint32))
    out = []
    for name, col, vals in (
        (yambda.ARTIST_MAP, "artist_id", item_artist),
        (yambda.ALBUM_MAP, "album_id", item_album),
    ):
        path = meta / name
        with staged.open(path) as f:
            pq.write_table(pa.table({"item_id": items, col: pa.array(vals.astype(np.uint32))}), f)
        out.append(path)
    return out


RAW_COLUMNS = (
    "uid",
    "timestamp",
    "item_id",
    "is_organic",
    "event_type",
    "played_ratio_pct",
    "track_length_seconds",
)


def read_raw(path: Path) -> RawEvents:
    """Yambda's flat multi_event.parquet (the Hugging Face `yandex/yambda` layout) in memory, event types
    encoded as preprocess_public_data.py:413-423 does. For the 50m and 500m variants; 5b needs ~150 GB."""
    # heavy (pyarrow): loaded only where parquet is read, not on every `ttt` start
    import pyarrow as pa
    import pyarrow.compute as pc

    table = yambda.read_parquet_columns(Path(path), RAW_COLUMNS)
    et = table.column("event_type").combine_chunks()
    if pa.types.is_dictionary(et.type):
        et = et.cast(pa.string())
    if pa.types.is_string(et.type) or pa.types.is_large_string(et.type):
        names = et.to_pylist()
        unknown = sorted({n for n in set(names) if n not in yambda.EVENT_TYPES}, key=str)
        if unknown:
            raise yambda.bad_file(Path(path), f"unknown event_type value(s) {unknown[:3]}", fix="expected "
                              + ", ".join(yambda.EVENT_TYPES))  # fmt: skip
        et = pa.array([yambda.EVENT_TYPES[n] for n in names], type=pa.uint8())

    def col(name, arr=None):
        arr = arr if arr is not None else table.column(name).combine_chunks()
        return yambda.int_column(Path(path), name, arr)

    def opt(name):
        arr = table.column(name).combine_chunks()
        return np.asarray(pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)

    return RawEvents(
        uid=col("uid"),
        ts=col("timestamp"),
        item=col("item_id"),
        organic=col("is_organic"),
        etype=col("event_type", et),
        ratio=opt("played_ratio_pct"),
        track_len=opt("track_length_seconds"),
    )


def preprocess(raw_path: Path, root: Path, size: str, train_days: int = 300, gap_minutes: int = 30,
               test_days: int = 1) -> list[Path]:  # fmt: skip
    """The reference's `DLRMYambdaProcessor.preprocess` without the download: `root/processed_<size>/` from a
    raw multi_event.parquet (the item mappings are downloaded files: copy them into `root/shared_metadata/`)."""
    raw = read_raw(raw_path)
    if len(raw.ts) == 0:
        raise yambda.bad_file(Path(raw_path), "no events")
    split = split_boundaries(int(raw.ts.max()), train_days, gap_minutes, test_days)
    with fileio.Staged() as staged:
        w = SessionWriter(root, staged, split, size)
        w.add(raw)
        meta = {"t_min": int(raw.ts.min()), "t_max": int(raw.ts.max()), "train_days": train_days,
                "gap_minutes": gap_minutes, "test_days": test_days}  # fmt: skip
        return w.close(meta)
