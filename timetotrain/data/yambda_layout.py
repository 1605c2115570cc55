"""Yambda-5B's processed layout as the MLPerf dlrmv4 reference reads it: names, the reference's constants, and
the checked readers of train_sessions.parquet and the item mappings (yambda.py is the dataset over them).

The layout (preprocess_public_data.py:215-227, dlrm_v4/utils.py:1756-1757), under a data root:
  processed_<size>/train_sessions.parquet   one row per (uid, 30-minute session): uid, session_id and the
                                            list columns item_ids, timestamps, event_types, is_organic,
                                            played_ratio_pct (+ track_length_seconds, unread)
  processed_<size>/item_popularity.npy      its length must equal the item count of the mappings
  shared_metadata/artist_item_mapping.parquet, album_item_mapping.parquet   item_id -> artist_id / album_id
The reference flattens the sessions in (uid, session_id) order into one event array per column
(yambda.py:93-148); `Events` holds those arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from timetotrain.errors import UserError

# preprocess_public_data.py:245; yambda.py:83-91
EVENT_TYPES = {"listen": 0, "like": 1, "dislike": 2, "unlike": 3, "undislike": 4}
LISTEN, LIKE = 0, 1
LISTEN_PLUS_THRESHOLD = 50
LP_BIT, LIKE_BIT, SKIP_BIT = 1, 2, 4

# configs.py:44-52: (name, keys, rows, salt), the 7 hashed crosses of the reference.
CROSS_SPECS: tuple[tuple[str, tuple[str, ...], int, int], ...] = (
    ("user_x_artist", ("uid", "artist_id"), 100_000_000, 0),
    ("user_x_album", ("uid", "album_id"), 40_000_000, 0),
    ("user_x_hour", ("uid", "hour_of_day"), 24_000_000, 0),
    ("item_x_hour", ("item_id", "hour_of_day"), 40_000_000, 0),
    ("artist_x_hour", ("artist_id", "hour_of_day"), 32_000_000, 0),
    ("user_x_is_organic", ("uid", "is_organic"), 2_000_000, 0),
    ("user_x_artist_x_hour", ("uid", "artist_id", "hour_of_day"), 40_000_000, 0),
)
# configs.py:763-791: the id tables of yambda-5b.
REFERENCE_TABLES = {"item_id": 9_390_624, "artist_id": 1_293_395, "album_id": 3_367_692, "uid": 1_000_001}

SEQUENCE_FEATURES = (
    "item_id",
    "artist_id",
    "album_id",
    "action_weight",
    "action_timestamp",
    "dummy_watch_time",
)
CANDIDATE_FEATURES = (  # configs.py:415-422
    "item_candidate_id",
    "item_candidate_artist_id",
    "item_candidate_album_id",
    "item_query_time",
    "item_action_weight",
    "item_dummy_watchtime",
)
QUERY_TIME = "dummy_query_time"  # appended after the uih features (yambda.py:1048)
TASK = "listen_plus"  # configs.py:423-429, the LP bit of item_action_weight

SESSIONS = "train_sessions.parquet"
POPULARITY = "item_popularity.npy"
ARTIST_MAP = "artist_item_mapping.parquet"
ALBUM_MAP = "album_item_mapping.parquet"
SESSION_COLUMNS = ("item_ids", "timestamps", "event_types", "is_organic", "played_ratio_pct")


def uih_features(cross_specs=CROSS_SPECS) -> tuple[str, ...]:
    """configs.py:403-414: uid, the crosses, then the sequence features."""
    return ("uid", *(s[0] for s in cross_specs), *SEQUENCE_FEATURES)


@dataclass(frozen=True)
class YambdaConfig:
    """What shapes the samples and the stream; the defaults are the reference's (yambda_5b.gin)."""

    size: str = "5b"  # processed_<size>/ (dlrm_v4/utils.py:1756)
    history_length: int = 4086  # gin:451-453; per-pool cap = history_length // 3
    min_history: int = 4086  # gin:500-502
    scan_window: int = 20_000  # dlrm_v4/utils.py:1761
    strategy: str = "interleaved"  # gin:488-490; or "last_n"
    max_seq_len: int = 4096  # gin:509-511
    max_num_candidates: int = 1  # configs.py:360
    cross_specs: tuple = CROSS_SPECS
    window_seconds: int = 86_400  # gin:529
    shuffle_fraction: float = 0.0  # gin:544-547
    shuffle_seed: int = 0  # gin:550-552
    train_split_percentage: float = 1.0  # gin:224-226: no user hold-out
    split_salt: int = 0  # gin:559-561

    def __post_init__(self):
        if self.strategy not in ("interleaved", "last_n"):
            raise UserError(f"history strategy {self.strategy!r}: choose interleaved or last_n")
        if self.history_length < 1 or self.scan_window < 1 or self.min_history < 0 or self.window_seconds < 1:
            raise UserError("history_length, scan_window and window_seconds must be >= 1, min_history >= 0")
        if self.max_seq_len <= self.max_num_candidates + 1 + len(self.cross_specs):
            # the reference's slice items[-budget:] would keep everything at a budget of 0
            raise UserError(
                f"max_seq_len {self.max_seq_len} leaves no room for a history after {self.max_num_candidates} "
                f"candidate(s) and {1 + len(self.cross_specs)} contextual features"
            )


class Sample(NamedTuple):
    """One anchor: `uih` and `candidates` map each feature name to (int64 values, length), in the key order
    of the reference's KeyedJaggedTensors; `labels` maps the task name to float32 [num_candidates]."""

    uih: dict[str, tuple[np.ndarray, int]]
    candidates: dict[str, tuple[np.ndarray, int]]
    labels: dict[str, np.ndarray]


@dataclass
class Events:
    """The flat event columns in (uid, session_id) order, and each user's [start, end) in them."""

    uid: np.ndarray
    item: np.ndarray
    ts: np.ndarray
    etype: np.ndarray
    ratio: np.ndarray  # float32, NaN (a non-listen's null) already 0 as yambda.py:123
    organic: np.ndarray
    is_lp: np.ndarray
    is_like: np.ndarray
    is_skip: np.ndarray
    user_start: np.ndarray  # by uid; -1 for a uid without events
    user_end: np.ndarray

    @classmethod
    def derive(cls, uid, item, ts, etype, ratio, organic) -> Events:
        """The pools and the per-user ranges from the six columns (yambda.py:125-144)."""
        listen = etype == LISTEN
        starts = np.concatenate([[0], np.flatnonzero(np.diff(uid) != 0) + 1]).astype(np.int64)
        ends = np.concatenate([starts[1:], [len(uid)]]).astype(np.int64)
        rows = int(uid[starts].max()) + 1 if len(uid) else 0
        user_start = np.full(rows, -1, dtype=np.int64)
        user_end = np.full(rows, -1, dtype=np.int64)
        user_start[uid[starts]] = starts
        user_end[uid[starts]] = ends
        return cls(
            uid, item, ts, etype, ratio, organic,
            is_lp=listen & (ratio >= LISTEN_PLUS_THRESHOLD),
            is_like=etype == LIKE,
            is_skip=listen & (ratio < LISTEN_PLUS_THRESHOLD),
            user_start=user_start,
            user_end=user_end,
        )  # fmt: skip


def bad_file(
    path: Path,
    what: str,
    fix: str = "re-run the preprocessing (download_dataset.sh) or `ttt data synth-yambda` into a new folder",
) -> UserError:
    return UserError(f"{path}: {what}; {fix}")


def read_parquet_columns(path: Path, columns: tuple[str, ...]):
    # heavy (pyarrow): loaded only where parquet is read, not on every `ttt` start
    import pyarrow.parquet as pq

    if not path.is_file():
        raise bad_file(path, "missing")
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError kinds for a file that is not parquet
        raise bad_file(
            path, f"not a parquet file ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
        ) from None
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise bad_file(path, f"missing column(s) {', '.join(missing)} (has {', '.join(schema.names)})")
    return pq.read_table(path, columns=list(columns))


def int_column(path: Path, name: str, arr) -> np.ndarray:
    """An integer column (or flattened list) as int64; nulls and non-integers refused."""
    # heavy (pyarrow): loaded only where parquet is read, not on every `ttt` start
    import pyarrow as pa

    if arr.null_count:
        raise bad_file(path, f"{arr.null_count} null value(s) in {name}")
    if not pa.types.is_integer(arr.type):
        raise bad_file(path, f"column {name} is {arr.type}, not integers")
    return np.asarray(arr.to_numpy(zero_copy_only=False)).astype(np.int64)


def read_sessions(path: Path) -> Events:
    """train_sessions.parquet flattened as yambda.py:110-123 does, each input rule checked."""
    # heavy (pyarrow): loaded only where parquet is read, not on every `ttt` start
    import pyarrow as pa
    import pyarrow.compute as pc

    table = read_parquet_columns(path, ("uid", "session_id", *SESSION_COLUMNS))
    for c in SESSION_COLUMNS:
        if not pa.types.is_list(table.schema.field(c).type) and not pa.types.is_large_list(
            table.schema.field(c).type
        ):
            raise bad_file(path, f"column {c} is {table.schema.field(c).type}, not a list per session")
    uid = int_column(path, "uid", table.column("uid").combine_chunks())
    sid = int_column(path, "session_id", table.column("session_id").combine_chunks())
    order = np.lexsort((sid, uid))  # yambda.py:112, sort(["uid", "session_id"])
    lists = {c: table.column(c).combine_chunks().take(pa.array(order)) for c in SESSION_COLUMNS}
    lengths = {c: pc.list_value_length(a).to_numpy(zero_copy_only=False) for c, a in lists.items()}
    for c in SESSION_COLUMNS[1:]:
        if lists[c].null_count or not np.array_equal(lengths[c], lengths["item_ids"]):
            raise bad_file(
                path, f"list column {c} is null or of another length than item_ids in some session"
            )
    flat = {c: a.flatten() for c, a in lists.items()}
    uid_flat = np.repeat(uid[order], lengths["item_ids"].astype(np.int64))
    ratio_arr = flat["played_ratio_pct"]
    if not (pa.types.is_integer(ratio_arr.type) or pa.types.is_floating(ratio_arr.type)):
        raise bad_file(path, f"played_ratio_pct is {ratio_arr.type}, not numbers")
    ratio = np.asarray(ratio_arr.to_numpy(zero_copy_only=False), dtype=np.float32)  # nulls -> NaN
    etype = int_column(path, "event_types", flat["event_types"])
    ts = int_column(path, "timestamps", flat["timestamps"])
    _check_events(path, uid_flat, etype, ts, ratio)
    return Events.derive(
        uid=uid_flat,
        item=int_column(path, "item_ids", flat["item_ids"]),
        ts=ts,
        etype=etype,
        ratio=ratio,
        organic=int_column(path, "is_organic", flat["is_organic"]).astype(np.int8),
    )


def _check_events(path: Path, uid: np.ndarray, et: np.ndarray, ts: np.ndarray, ratio: np.ndarray) -> None:
    """The rules a session file must meet before Events derives its pools; NaN ratios of non-listens
    (nulls in the real data: a like has no ratio) become 0 as yambda.py:123 makes them."""
    bad_type = (et < 0) | (et > max(EVENT_TYPES.values()))
    if bad_type.any():
        raise bad_file(path, f"event type {int(et[bad_type][0])} is none of listen..undislike (0..4)")
    nan_listen = np.isnan(ratio) & (et == LISTEN)
    if nan_listen.any():
        # The reference reads NaN as 0 (yambda.py:123), silently a skip: a listen must carry its ratio.
        i = int(np.flatnonzero(nan_listen)[0])
        raise bad_file(
            path,
            f"{int(nan_listen.sum())} listen event(s) have a null/NaN played_ratio_pct "
            f"(first: uid {int(uid[i])}, timestamp {int(ts[i])})",
        )
    np.nan_to_num(ratio, copy=False, nan=0.0)
    back = (uid[1:] == uid[:-1]) & (ts[1:] < ts[:-1])
    if back.any():
        i = int(np.flatnonzero(back)[0]) + 1
        raise bad_file(
            path,
            f"timestamps go back in time within user {int(uid[i])} ({int(ts[i - 1])} then {int(ts[i])}) "
            "in (uid, session_id) order",
        )


def read_item_maps(metadata_dir: Path, popularity: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """item -> artist and item -> album arrays over max(item_id) + 1 items (yambda.py:546-576)."""
    out = []
    tables = {}
    for name, col in ((ARTIST_MAP, "artist_id"), (ALBUM_MAP, "album_id")):
        p = metadata_dir / name
        t = read_parquet_columns(p, ("item_id", col))
        item = int_column(p, "item_id", t.column("item_id").combine_chunks())
        val = int_column(p, col, t.column(col).combine_chunks())
        if len(item) == 0:
            raise bad_file(p, "no rows")
        if item.min() < 0 or val.min() < 0:
            raise bad_file(p, "negative id(s)")
        tables[name] = (item, val)
    n_items = max(int(item.max()) + 1 for item, _ in tables.values())
    if popularity is not None and popularity.is_file():
        try:
            n_pop = int(np.load(popularity, mmap_mode="r", allow_pickle=False).shape[0])
        except (ValueError, OSError) as e:
            raise bad_file(popularity, f"not a .npy array ({str(e)[:80]})") from None
        if n_pop != n_items:  # yambda.py:560-569
            raise bad_file(
                popularity,
                f"{n_pop} entries but the artist/album mappings describe {n_items} items: "
                "the two come from different preprocessing runs",
            )
    for _, (item, val) in tables.items():
        arr = np.zeros(n_items, dtype=np.int64)
        arr[item] = val
        out.append(arr)
    return out[0], out[1]


def check_ids(where: Path, name: str, ids: np.ndarray, rows: int | None) -> None:
    if ids.size and ids.min() < 0:
        raise bad_file(where, f"negative {name}")
    if rows is not None and ids.size and ids.max() >= rows:
        raise bad_file(
            where,
            f"{name} {int(ids.max())} is beyond its table of {rows:,} rows",
            fix="use the dataset the tier was declared for, or a tier whose tables fit it",
        )
