"""Yambda-5B as the MLPerf dlrmv4 reference reads it: its anchors, day windows, eval hold-out and
per-sample features, in numpy (no polars, no torch, no TorchRec).

The data root holds processed_<size>/ and shared_metadata/ (yambda_layout.py). A sample is one LISTEN event
(the anchor) of a user with at least `min_history` earlier events (yambda.py:369-373); its label is
listen_plus (played >= 50%). What the sample holds is in `YambdaDataset.samples` and
docs/benchmarks/dlrmv4.md ("Data"), with the reference's line for each rule. The events come from
train_sessions.parquet, or from the reference's flat-event cache when it is there (yambda_cache.py: what
MLCommons' prepared download ships instead of the parquet).

Every check of the input runs at construction (before a run's clock): a missing file or column, ids out of a
table, timestamps out of order, a NaN ratio on a listen: one UserError line naming the file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from timetotrain.data import yambda_cache
from timetotrain.data.yambda_hash import cross_hash, uid_unit_hash
from timetotrain.data.yambda_layout import (
    ALBUM_MAP,
    ARTIST_MAP,
    CANDIDATE_FEATURES,
    CROSS_SPECS,
    EVENT_TYPES,
    LIKE_BIT,
    LISTEN,
    LISTEN_PLUS_THRESHOLD,
    LP_BIT,
    POPULARITY,
    QUERY_TIME,
    REFERENCE_TABLES,
    SEQUENCE_FEATURES,
    SESSION_COLUMNS,
    SESSIONS,
    SKIP_BIT,
    TASK,
    Events,
    Sample,
    YambdaConfig,
    bad_file,
    check_ids,
    read_item_maps,
    read_sessions,
    uih_features,
)
from timetotrain.errors import UserError

__all__ = [
    "ALBUM_MAP", "ARTIST_MAP", "CANDIDATE_FEATURES", "CROSS_SPECS", "EVENT_TYPES", "LISTEN", "LISTEN_PLUS_THRESHOLD",
    "POPULARITY", "QUERY_TIME", "REFERENCE_TABLES", "SEQUENCE_FEATURES", "SESSION_COLUMNS", "SESSIONS", "TASK",
    "Events", "Sample", "YambdaConfig", "YambdaDataset", "cross_hash", "global_batches", "per_rank", "read_item_maps",
    "read_sessions", "split_meta", "stream_plan", "uih_features",
]  # fmt: skip


class YambdaDataset:
    """The reference's DLRMv4YambdaDataset over a data root (the folder holding processed_<size>/ and
    shared_metadata/). `tables`: the embedding rows a model has per id feature ("item_id", "artist_id",
    "album_id", "uid"); every id of the data is checked against them. Anchors are indexed 0..len-1 in the
    reference's `_positions` order (user-major)."""

    def __init__(self, root: str | Path, config: YambdaConfig | None = None, tables: dict | None = None):
        self.root = Path(root)
        self.config = config = config or YambdaConfig()
        self.processed = self.root / f"processed_{config.size}"
        self.metadata = self.root / "shared_metadata"
        if not self.processed.is_dir():
            raise UserError(
                f"{self.processed}: missing; pass the data root that holds processed_{config.size}/ "
                "and shared_metadata/ (download_dataset.sh, or `ttt data synth-yambda`)"
            )
        cache = yambda_cache.cache_dir(self.processed, config.history_length)
        if (cache / "_READY").is_file():  # the reference uses its cache whenever _READY is there
            sessions, self.events = cache, yambda_cache.read_cache(cache)
        else:
            sessions = self.processed / SESSIONS
            self.events = read_sessions(sessions)
            cache = None
        self.item_to_artist, self.item_to_album = read_item_maps(self.metadata, self.processed / POPULARITY)
        tables = dict(tables or {})
        check_ids(
            sessions,
            "item id",
            self.events.item,
            min(len(self.item_to_artist), tables.get("item_id", 1 << 62)),
        )
        check_ids(sessions, "uid", self.events.uid, tables.get("uid"))
        check_ids(self.metadata / ARTIST_MAP, "artist_id", self.item_to_artist, tables.get("artist_id"))
        check_ids(self.metadata / ALBUM_MAP, "album_id", self.item_to_album, tables.get("album_id"))
        self.positions = yambda_cache.anchor_positions(
            self.events, config.min_history, cache, config.history_length
        )
        self.anchor_ts = self.events.ts[self.positions]
        if len(self.positions) == 0:
            raise bad_file(
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
    """A rank's share of a window as the reference's StreamingWindowSampler deals it (train/utils.py:1153-1168):
    the window cut to a multiple of world_size, then every world_size-th anchor from `rank`."""
    n = (len(indices) // world_size) * world_size
    return indices[:n][rank::world_size]


def global_batches(indices: np.ndarray, global_batch: int) -> np.ndarray:
    """[batches, global_batch]: what all ranks together take per step from a window (train or eval).

    Rank r's k-th batch of `per_rank` is indices[r + world_size * (k * bs + j)], j < bs, so the ranks' k-th
    batches together are indices[k * GBS : (k + 1) * GBS], whatever the world size; drop_last on every rank
    (train/utils.py:1181-1196, DataLoader drop_last=True) leaves the window cut to whole global batches. The eval
    window is cut the same way (train/utils.py:2994-3009): up to GBS - 1 eval anchors are never scored."""
    n = (len(indices) // global_batch) * global_batch
    return indices[:n].reshape(-1, global_batch)


def stream_plan(
    available: int, start_ts: int = 0, num_train_ts: int = 299, eval_holdout_ts: int | None = 299
):
    """(train windows in order, eval window) as the streaming loop resolves them: the eval window is the
    requested one (or start_ts + num_train_ts when None or < 0), fixed before the train count is clamped to
    the available windows (train/utils.py:2180-2196, 2366-2373)."""
    eval_ts = (
        eval_holdout_ts if eval_holdout_ts is not None and eval_holdout_ts >= 0 else start_ts + num_train_ts
    )
    num_train_ts = min(num_train_ts, max(0, available - 1 - start_ts))
    return list(range(start_ts, start_ts + num_train_ts)), eval_ts


def split_meta(root: Path, size: str = "5b") -> dict | None:
    p = Path(root) / f"processed_{size}" / "split_meta.json"
    return json.loads(p.read_text()) if p.is_file() else None
