"""Yambda-5B as the MLPerf dlrmv4 reference reads it: the preprocessed layout, its anchors, day windows, eval
hold-out and per-sample features, in numpy (no polars, no torch, no TorchRec).

The layout (preprocess_public_data.py:215-227, utils.py:1755-1756), under a data root:
  processed_<size>/train_sessions.parquet   one row per (uid, 30-minute session): uid, session_id and the
                                            list columns item_ids, timestamps, event_types, is_organic,
                                            played_ratio_pct (+ track_length_seconds, unread)
  processed_<size>/item_popularity.npy      its length must equal the item count of the mappings
  shared_metadata/artist_item_mapping.parquet, album_item_mapping.parquet   item_id -> artist_id / album_id
The reference flattens the sessions in (uid, session_id) order into one event array per column
(yambda.py:93-148). A sample is one LISTEN event (the anchor) of a user with at least `min_history` earlier
events (yambda.py:369-373); its label is listen_plus (played >= 50%). What the sample holds is in
`YambdaDataset.samples` and docs/benchmarks/dlrmv4-data.md, with the reference's line for each rule.

Every check of the input runs at construction (before a run's clock): a missing file or column, ids out of a
table, timestamps out of order, a NaN ratio on a listen: one UserError line naming the file and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from timetotrain.data.yambda_hash import cross_hash, uid_unit_hash
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

    size: str = "5b"  # processed_<size>/ (utils.py:1755)
    history_length: int = 4086  # gin:451-453; per-pool cap = history_length // 3
    min_history: int = 4086  # gin:500-502
    scan_window: int = 20_000  # utils.py:1762
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
        if self.history_length < 1 or self.scan_window < 1 or self.min_history < 0:
            raise UserError("history_length and scan_window must be >= 1 and min_history >= 0")


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
    is_lp: np.ndarray = field(init=False)
    is_like: np.ndarray = field(init=False)
    is_skip: np.ndarray = field(init=False)
    user_start: np.ndarray = field(init=False)
    user_end: np.ndarray = field(init=False)

    def __post_init__(self):
        listen = self.etype == LISTEN
        self.is_lp = listen & (self.ratio >= LISTEN_PLUS_THRESHOLD)
        self.is_like = self.etype == LIKE
        self.is_skip = listen & (self.ratio < LISTEN_PLUS_THRESHOLD)
        starts = np.concatenate([[0], np.flatnonzero(np.diff(self.uid) != 0) + 1]).astype(np.int64)
        ends = np.concatenate([starts[1:], [len(self.uid)]]).astype(np.int64)
        rows = int(self.uid[starts].max()) + 1 if len(self.uid) else 0
        self.user_start = np.full(rows, -1, dtype=np.int64)
        self.user_end = np.full(rows, -1, dtype=np.int64)
        self.user_start[self.uid[starts]] = starts
        self.user_end[self.uid[starts]] = ends


def _bad(
    path: Path,
    what: str,
    fix: str = "re-run the preprocessing (download_dataset.sh) or `ttt data synth-yambda` into a new folder",
) -> UserError:
    return UserError(f"{path}: {what}; {fix}")


def _read_parquet(path: Path, columns: tuple[str, ...]):
    import pyarrow.parquet as pq

    if not path.is_file():
        raise _bad(path, "missing")
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError kinds for a file that is not parquet
        raise _bad(path, f"not a parquet file ({type(e).__name__}: {str(e).splitlines()[0][:80]})") from None
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise _bad(path, f"missing column(s) {', '.join(missing)} (has {', '.join(schema.names)})")
    return pq.read_table(path, columns=list(columns))


def _ints(path: Path, name: str, arr) -> np.ndarray:
    """An integer column (or flattened list) as int64; nulls and non-integers refused."""
    import pyarrow as pa

    if arr.null_count:
        raise _bad(path, f"{arr.null_count} null value(s) in {name}")
    if not pa.types.is_integer(arr.type):
        raise _bad(path, f"column {name} is {arr.type}, not integers")
    return np.asarray(arr.to_numpy(zero_copy_only=False)).astype(np.int64)


def read_sessions(path: Path) -> Events:
    """train_sessions.parquet flattened as yambda.py:110-123 does, each input rule checked."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = _read_parquet(path, ("uid", "session_id", *SESSION_COLUMNS))
    for c in SESSION_COLUMNS:
        if not pa.types.is_list(table.schema.field(c).type) and not pa.types.is_large_list(
            table.schema.field(c).type
        ):
            raise _bad(path, f"column {c} is {table.schema.field(c).type}, not a list per session")
    uid = _ints(path, "uid", table.column("uid").combine_chunks())
    sid = _ints(path, "session_id", table.column("session_id").combine_chunks())
    order = np.lexsort((sid, uid))  # yambda.py:112, sort(["uid", "session_id"])
    lists = {c: table.column(c).combine_chunks().take(pa.array(order)) for c in SESSION_COLUMNS}
    lengths = {c: pc.list_value_length(a).to_numpy(zero_copy_only=False) for c, a in lists.items()}
    for c in SESSION_COLUMNS[1:]:
        if lists[c].null_count or not np.array_equal(lengths[c], lengths["item_ids"]):
            raise _bad(path, f"list column {c} is null or of another length than item_ids in some session")
    flat = {c: a.flatten() for c, a in lists.items()}
    uid_flat = np.repeat(uid[order], lengths["item_ids"].astype(np.int64))
    ratio_arr = flat["played_ratio_pct"]
    if not (pa.types.is_integer(ratio_arr.type) or pa.types.is_floating(ratio_arr.type)):
        raise _bad(path, f"played_ratio_pct is {ratio_arr.type}, not numbers")
    ratio = np.asarray(ratio_arr.to_numpy(zero_copy_only=False), dtype=np.float32)  # nulls -> NaN
    etype = _ints(path, "event_types", flat["event_types"])
    ts = _ints(path, "timestamps", flat["timestamps"])
    _check_events(path, uid_flat, etype, ts, ratio)
    return Events(
        uid=uid_flat,
        item=_ints(path, "item_ids", flat["item_ids"]),
        ts=ts,
        etype=etype,
        ratio=ratio,
        organic=_ints(path, "is_organic", flat["is_organic"]).astype(np.int8),
    )


def _check_events(path: Path, uid: np.ndarray, et: np.ndarray, ts: np.ndarray, ratio: np.ndarray) -> None:
    """The rules a session file must meet before Events derives its pools; NaN ratios of non-listens
    (nulls in the real data: a like has no ratio) become 0 as yambda.py:123 makes them."""
    bad_type = (et < 0) | (et > max(EVENT_TYPES.values()))
    if bad_type.any():
        raise _bad(path, f"event type {int(et[bad_type][0])} is none of listen..undislike (0..4)")
    nan_listen = np.isnan(ratio) & (et == LISTEN)
    if nan_listen.any():
        # The reference reads NaN as 0 (yambda.py:123), silently a skip: a listen must carry its ratio.
        i = int(np.flatnonzero(nan_listen)[0])
        raise _bad(
            path,
            f"{int(nan_listen.sum())} listen event(s) have a null/NaN played_ratio_pct "
            f"(first: uid {int(uid[i])}, timestamp {int(ts[i])})",
        )
    np.nan_to_num(ratio, copy=False, nan=0.0)
    back = (uid[1:] == uid[:-1]) & (ts[1:] < ts[:-1])
    if back.any():
        i = int(np.flatnonzero(back)[0]) + 1
        raise _bad(
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
        t = _read_parquet(p, ("item_id", col))
        item = _ints(p, "item_id", t.column("item_id").combine_chunks())
        val = _ints(p, col, t.column(col).combine_chunks())
        if len(item) == 0:
            raise _bad(p, "no rows")
        if item.min() < 0 or val.min() < 0:
            raise _bad(p, "negative id(s)")
        tables[name] = (item, val)
    n_items = max(int(item.max()) + 1 for item, _ in tables.values())
    if popularity is not None and popularity.is_file():
        try:
            n_pop = int(np.load(popularity, mmap_mode="r", allow_pickle=False).shape[0])
        except (ValueError, OSError) as e:
            raise _bad(popularity, f"not a .npy array ({str(e)[:80]})") from None
        if n_pop != n_items:  # yambda.py:560-569
            raise _bad(
                popularity,
                f"{n_pop} entries but the artist/album mappings describe {n_items} items: "
                "the two come from different preprocessing runs",
            )
    for _, (item, val) in tables.items():
        arr = np.zeros(n_items, dtype=np.int64)
        arr[item] = val
        out.append(arr)
    return out[0], out[1]


def _check_ids(where: Path, name: str, ids: np.ndarray, rows: int | None) -> None:
    if ids.size and ids.min() < 0:
        raise _bad(where, f"negative {name}")
    if rows is not None and ids.size and ids.max() >= rows:
        raise _bad(
            where,
            f"{name} {int(ids.max())} is beyond its table of {rows:,} rows",
            fix="use the dataset the tier was declared for, or a tier whose tables fit it",
        )


class YambdaDataset:
    """The reference's DLRMv4YambdaDataset over a data root (the folder holding processed_<size>/ and
    shared_metadata/). `tables`: the embedding rows a model has per id feature ("item_id", "artist_id",
    "album_id", "uid"); every id of the data is checked against them. Anchors are indexed 0..len-1 in the
    reference's `_positions` order (user-major)."""

    def __init__(self, root: str | Path, config: YambdaConfig = YambdaConfig(), tables: dict | None = None):
        self.root = Path(root)
        self.config = config
        self.processed = self.root / f"processed_{config.size}"
        self.metadata = self.root / "shared_metadata"
        if not self.processed.is_dir():
            raise UserError(
                f"{self.processed}: missing; pass the data root that holds processed_{config.size}/ "
                "and shared_metadata/ (download_dataset.sh, or `ttt data synth-yambda`)"
            )
        sessions = self.processed / SESSIONS
        self.events = read_sessions(sessions)
        self.item_to_artist, self.item_to_album = read_item_maps(self.metadata, self.processed / POPULARITY)
        tables = dict(tables or {})
        _check_ids(sessions, "item id", self.events.item, tables.get("item_id", len(self.item_to_artist)))
        _check_ids(sessions, "uid", self.events.uid, tables.get("uid"))
        _check_ids(self.metadata / ARTIST_MAP, "artist_id", self.item_to_artist, tables.get("artist_id"))
        _check_ids(self.metadata / ALBUM_MAP, "album_id", self.item_to_album, tables.get("album_id"))
        ev = self.events
        idx = np.arange(len(ev.uid), dtype=np.int64)
        keep = (idx - ev.user_start[ev.uid] >= config.min_history) & (ev.etype == LISTEN)  # yambda.py:369-373
        self.positions = np.flatnonzero(keep).astype(np.int64)
        self.anchor_ts = ev.ts[self.positions]
        if len(self.positions) == 0:
            raise _bad(
                sessions,
                f"no LISTEN event has {config.min_history} earlier events of its user: no anchor to train on",
                fix="lower min_history or use a larger dataset",
            )
        self.t_min = int(self.anchor_ts.min())
        self.t_max = int(self.anchor_ts.max())

    def __len__(self) -> int:
        return len(self.positions)

    def table_rows(self) -> dict[str, int]:
        """Rows each id table needs for this data (the crosses: their declared rows)."""
        rows = {
            "item_id": len(self.item_to_artist),
            "artist_id": int(self.item_to_artist.max()) + 1,
            "album_id": int(self.item_to_album.max()) + 1,
            "uid": len(self.events.user_start),
        }
        rows.update({name: n for name, _k, n, _s in self.config.cross_specs})
        return rows

    # ---- the stream: day windows in time order (yambda.py:629-797) ----
    def num_windows(self) -> int:
        w = self.config.window_seconds
        return int((self.t_max - self.t_min + 1 + w - 1) // w)

    def window_indices(self, ts: int, sort_by_time: bool = False) -> np.ndarray:
        """Anchors whose timestamp is in [t_min + ts*W, t_min + (ts+1)*W), in user-major order."""
        lo = self.t_min + ts * self.config.window_seconds
        idx = np.flatnonzero((self.anchor_ts >= lo) & (self.anchor_ts < lo + self.config.window_seconds))
        if sort_by_time and idx.size:
            idx = idx[np.argsort(self.anchor_ts[idx], kind="stable")]
        return idx.astype(np.int64)

    def eval_mask(self, anchor_idx: np.ndarray) -> np.ndarray:
        """True for anchors of held-out users: uid hash >= train_split_percentage."""
        uids = self.events.uid[self.positions[anchor_idx]]
        return uid_unit_hash(uids, self.config.split_salt) >= self.config.train_split_percentage

    def shuffle_window(self, idx: np.ndarray, ts: int) -> np.ndarray:
        """The in-window shuffle of yambda.py:704-719: off at 0, a full permutation at 1, else a shuffle
        within consecutive segments of round(fraction * n); drawn from default_rng(seed + ts)."""
        frac = self.config.shuffle_fraction
        if idx.size <= 1 or not frac or frac <= 0.0:
            return idx
        rng = np.random.default_rng(self.config.shuffle_seed + ts)
        if frac >= 1.0:
            return idx[rng.permutation(idx.size)]
        k = max(1, int(round(frac * idx.size)))
        seg = np.arange(idx.size, dtype=np.int64) // k
        return idx[np.lexsort((rng.random(idx.size), seg))]

    def train_window_indices(self, ts: int) -> np.ndarray:
        idx = self.window_indices(ts)
        if self.config.train_split_percentage < 1.0:
            idx = idx[~self.eval_mask(idx)]
        return self.shuffle_window(idx, ts)

    def eval_holdout_indices(self, start_ts: int, num_windows: int = 1) -> np.ndarray:
        parts = []
        for ts in range(start_ts, start_ts + max(1, num_windows)):
            idx = self.window_indices(ts)
            if self.config.train_split_percentage < 1.0:
                idx = idx[self.eval_mask(idx)]
            parts.append(idx)
        return np.concatenate(parts).astype(np.int64)

    def total_train_anchors(self, start_ts: int, num_ts: int) -> int:
        if num_ts <= 0:
            return 0
        w = self.config.window_seconds
        lo, hi = self.t_min + start_ts * w, self.t_min + (start_ts + num_ts) * w
        sel = np.flatnonzero((self.anchor_ts >= lo) & (self.anchor_ts < hi))
        if self.config.train_split_percentage >= 1.0:
            return int(sel.size)
        return int(np.count_nonzero(~self.eval_mask(sel)))

    # ---- samples (yambda.py:851-1073) ----
    def _history(self, pos: int) -> np.ndarray:
        """Flat positions of the anchor's history, oldest first."""
        ev, cfg = self.events, self.config
        start = max(int(ev.user_start[ev.uid[pos]]), pos - cfg.scan_window)
        if pos <= start:
            return np.empty(0, dtype=np.int64)
        local = np.arange(start, pos, dtype=np.int64)
        lp, like, skip = ev.is_lp[start:pos], ev.is_like[start:pos], ev.is_skip[start:pos]
        if cfg.strategy == "last_n":
            return local[lp | like | skip][-cfg.history_length :]
        per_pool = max(1, cfg.history_length // 3)
        keep = np.concatenate([local[lp][-per_pool:], local[like][-per_pool:], local[skip][-per_pool:]])
        return np.sort(keep, kind="stable")

    def samples(self, anchor_idx) -> list[Sample]:
        """The samples of anchors `anchor_idx` (indices into the anchors), each as `_build_sample` yields.

        uih, in order: uid and the 7 crosses (length 1 each); item_id, artist_id, album_id, action_weight
        (pool bits LP=1/LIKE=2/SKIP=4), action_timestamp, dummy_watch_time (zeros), each of the history's
        length; dummy_query_time (length 1: the last history timestamp, or the anchor's with no history).
        candidates (length max_num_candidates each): the anchor's item, artist, album, the query time,
        its action weight (LP bit iff listen_plus), and 1. labels: {"listen_plus": [1.0 or 0.0]}."""
        ev, cfg = self.events, self.config
        pos = self.positions[np.atleast_1d(np.asarray(anchor_idx, dtype=np.int64))]
        uid, item, ts = ev.uid[pos], ev.item[pos], ev.ts[pos]
        artist, album = self.item_to_artist[item], self.item_to_album[item]
        keys = {
            "uid": uid,
            "item_id": item,
            "artist_id": artist,
            "album_id": album,
            "hour_of_day": (ts // 3600) % 24,
            "is_organic": ev.organic[pos].astype(np.int64),
        }
        crosses = {n: cross_hash([keys[k] for k in ks], rows, salt) for n, ks, rows, salt in cfg.cross_specs}
        budget = cfg.max_seq_len - cfg.max_num_candidates - (1 + len(cfg.cross_specs))
        m = cfg.max_num_candidates
        out = []
        for j, p in enumerate(pos.tolist()):
            h = self._history(p)[-budget:] if budget > 0 else np.empty(0, dtype=np.int64)
            n = len(h)
            h_items = ev.item[h]
            weight = (ev.is_lp[h] * LP_BIT) | (ev.is_like[h] * LIKE_BIT) | (ev.is_skip[h] * SKIP_BIT)
            h_ts = ev.ts[h]
            query = int(h_ts[-1]) if n else int(ts[j])
            uih = {"uid": (uid[j : j + 1].copy(), 1)}
            for name, *_ in cfg.cross_specs:
                uih[name] = (crosses[name][j : j + 1], 1)
            uih["item_id"] = (h_items, n)
            uih["artist_id"] = (self.item_to_artist[h_items], n)
            uih["album_id"] = (self.item_to_album[h_items], n)
            uih["action_weight"] = (weight.astype(np.int64), n)
            uih["action_timestamp"] = (h_ts, n)
            uih["dummy_watch_time"] = (np.zeros(n, dtype=np.int64), n)
            uih[QUERY_TIME] = (np.array([query], dtype=np.int64), 1)
            lp = bool(ev.is_lp[p])
            cand_vals = (int(item[j]), int(artist[j]), int(album[j]), query, LP_BIT if lp else 0, 1)
            cand = {
                f: (np.full(m, v, dtype=np.int64), m)
                for f, v in zip(CANDIDATE_FEATURES, cand_vals, strict=True)
            }
            out.append(Sample(uih, cand, {TASK: np.full(m, float(lp), dtype=np.float32)}))
        return out

    def sample(self, anchor: int) -> Sample:
        return self.samples([anchor])[0]


def per_rank(indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """A rank's share of a window as the reference's StreamingWindowSampler deals it (utils.py:1153-1168):
    the window cut to a multiple of world_size, then every world_size-th anchor from `rank`."""
    n = (len(indices) // world_size) * world_size
    return indices[:n][rank::world_size]


def stream_plan(
    available: int, start_ts: int = 0, num_train_ts: int = 299, eval_holdout_ts: int | None = 299
):
    """(train windows in order, eval window) as the streaming loop resolves them: the eval window is the
    requested one (or start_ts + num_train_ts when None or < 0), fixed before the train count is clamped to
    the available windows (utils.py:2180-2196, 2366-2373)."""
    eval_ts = (
        eval_holdout_ts if eval_holdout_ts is not None and eval_holdout_ts >= 0 else start_ts + num_train_ts
    )
    num_train_ts = min(num_train_ts, max(0, available - 1 - start_ts))
    return list(range(start_ts, start_ts + num_train_ts)), eval_ts


def split_meta(root: Path, size: str = "5b") -> dict | None:
    p = Path(root) / f"processed_{size}" / "split_meta.json"
    return json.loads(p.read_text()) if p.is_file() else None
