"""The Yambda reader (data/yambda.py) on files this test writes in the dlrmv4 reference's layout: the global
temporal split and the 30-minute session cut, the per-pool history (a third per pool, re-sorted by position,
truncated to the sequence budget), the sample's features in the reference's key order with its cross hashes
(recomputed here with the `xxhash` package and struct, as datasets/utils.py:108-123 does), day windows in
time order, the eval hold-out by the splitmix uid hash (recomputed here in plain Python), the in-window
shuffle; `ttt data synth-yambda` deterministic per seed; bad input as one line naming the file."""

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from timetotrain.cli import main
from timetotrain.data import yambda, yambda_synth
from timetotrain.data.yambda import YambdaConfig, YambdaDataset
from timetotrain.data.yambda_prep import RawEvents, SessionWriter, session_ids, split_boundaries
from timetotrain.errors import UserError
from timetotrain.fileio import Staged

L, K, S, D = 0, 1, 2, 3  # listen, like, skip-or-dislike helpers below; D = dislike event type 2
SMALL_CROSSES = tuple((n, k, 97, 5) for n, k, _, _ in yambda.CROSS_SPECS)  # small tables, a nonzero salt


def _write(root: Path, sessions, n_items=20, popularity=True, maps=None):
    """sessions: (uid, session_id, [(item, ts, etype, ratio or None, organic)]) rows, written as the
    reference's train_sessions.parquet; items map to artist item % 5 and album item % 7."""
    proc = root / "processed_5b"
    proc.mkdir(parents=True, exist_ok=True)
    cols = {c: [] for c in ("uid", "session_id", *yambda.SESSION_COLUMNS, "track_length_seconds")}
    for uid, sid, evs in sessions:
        cols["uid"].append(uid)
        cols["session_id"].append(sid)
        cols["item_ids"].append([e[0] for e in evs])
        cols["timestamps"].append([e[1] for e in evs])
        cols["event_types"].append([e[2] for e in evs])
        cols["played_ratio_pct"].append([e[3] for e in evs])
        cols["is_organic"].append([e[4] for e in evs])
        cols["track_length_seconds"].append([200 for _ in evs])
    types = {
        "uid": pa.uint32(),
        "session_id": pa.uint32(),
        "item_ids": pa.list_(pa.uint32()),
        "timestamps": pa.list_(pa.uint32()),
        "event_types": pa.list_(pa.uint8()),
        "played_ratio_pct": pa.list_(pa.uint16()),
        "is_organic": pa.list_(pa.uint8()),
        "track_length_seconds": pa.list_(pa.uint32()),
    }
    pq.write_table(pa.table({c: pa.array(v, type=types[c]) for c, v in cols.items()}), proc / yambda.SESSIONS)
    meta = root / "shared_metadata"
    meta.mkdir(exist_ok=True)
    items = np.arange(n_items)
    artist, album = maps if maps is not None else (items % 5, items % 7)
    pq.write_table(pa.table({"item_id": items, "artist_id": artist}), meta / yambda.ARTIST_MAP)
    pq.write_table(pa.table({"item_id": items, "album_id": album}), meta / yambda.ALBUM_MAP)
    if popularity:
        np.save(proc / yambda.POPULARITY, np.ones(n_items, dtype=np.int64))
    return root


def _ev(item, ts, kind):
    """An event of kind 'lp' (listen, 80%), 'skip' (listen, 20%), 'like', 'dislike'."""
    etype, ratio = {"lp": (0, 80), "skip": (0, 20), "like": (1, None), "dislike": (2, None)}[kind]
    return (item, ts, etype, ratio, 1)


# ---------------------------------------------------------------- preprocessing: split and sessions


def test_sessions_cut_after_30_minutes_of_silence():
    uid = np.array([1, 1, 1, 1, 1, 2, 2])
    ts = np.array([0, 1800, 3601, 3700, 9000, 0, 1801])
    # a gap of exactly 1,800 s stays in the session, 1,801 s starts the next (diff > gap), per user from 0
    assert session_ids(uid, ts).tolist() == [0, 0, 1, 1, 2, 0, 1]


def test_global_temporal_split_and_the_written_sessions(tmp_path):
    day = 86_400
    t_max = 3 * day + 1800  # train days [0, 2), gap 30 min, test day
    sp = split_boundaries(t_max, train_days=2, gap_minutes=30, test_days=1)
    assert (sp.train_start, sp.train_end, sp.test_start, sp.test_end) == (0, 2 * day, 2 * day + 1800, t_max)
    rows = [  # uid, ts
        (1, 0), (1, 100), (1, 5000), (1, 2 * day - 5), (1, 2 * day), (1, 2 * day + 1800), (1, t_max),
        (2, 2 * day + 2000),  # user 2 has only test events: dropped from the test (not in train)
        (3, 50), (3, 40),  # out of order in the input: sorted by time
    ]  # fmt: skip
    n = len(rows)
    raw = RawEvents(
        uid=np.array([r[0] for r in rows]),
        ts=np.array([r[1] for r in rows]),
        item=np.arange(n),
        organic=np.ones(n, dtype=np.int64),
        etype=np.zeros(n, dtype=np.int64),
        ratio=np.full(n, 60.0),
        track_len=np.full(n, 200.0),
    )
    with Staged() as st:
        w = SessionWriter(tmp_path, st, sp)
        w.add(raw)
        w.close({})
    t = pq.read_table(tmp_path / "processed_5b" / yambda.SESSIONS).to_pylist()
    got = [(r["uid"], r["session_id"], r["timestamps"]) for r in t]
    # 2*day - 5 is in train, 2*day (gap) and t_max (the half-open end) are in neither
    assert got == [(1, 0, [0, 100]), (1, 1, [5000]), (1, 2, [2 * day - 5]), (3, 0, [40, 50])]
    test = pq.read_table(tmp_path / "processed_5b" / "test_events.parquet").to_pylist()
    assert [(r["uid"], r["timestamp"]) for r in test] == [(1, 2 * day + 1800)]
    pop = np.load(tmp_path / "processed_5b" / yambda.POPULARITY)
    assert pop.tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 1, 1]  # train events per item id


def test_preprocess_raw_multi_event(tmp_path):
    """The Hugging Face layout (event_type as strings, null ratio on likes) into processed_<size>/."""
    from timetotrain.data.yambda_prep import preprocess

    day = 86_400
    raw = pa.table({
        "uid": pa.array([5, 5, 5, 5, 6], pa.uint32()),
        "timestamp": pa.array([0, 10, 10, 3 * day + 1800, 20], pa.uint32()),
        "item_id": pa.array([1, 2, 2, 3, 4], pa.uint32()),
        "is_organic": pa.array([1, 0, 0, 1, 1], pa.uint8()),
        "event_type": pa.array(["listen", "listen", "like", "listen", "dislike"]).dictionary_encode(),
        "played_ratio_pct": pa.array([70, 10, None, 100, None], pa.uint16()),
        "track_length_seconds": pa.array([200, 200, None, 200, None], pa.uint32()),
    })  # fmt: skip
    pq.write_table(raw, tmp_path / "multi_event.parquet")
    files = preprocess(tmp_path / "multi_event.parquet", tmp_path / "d", "50m", train_days=2)
    assert {f.name for f in files} >= {yambda.SESSIONS, "test_events.parquet", yambda.POPULARITY}
    rows = pq.read_table(tmp_path / "d" / "processed_50m" / yambda.SESSIONS).to_pylist()
    assert [(r["uid"], r["event_types"], r["played_ratio_pct"]) for r in rows] == [
        (5, [0, 0, 1], [70, 10, None]),  # the last listen is t_max itself: in neither split
        (6, [2], [None]),
    ]
    bad = raw.set_column(4, "event_type", pa.array(["listen", "listen", "like", "listen", "superlike"]))
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(UserError, match="unknown event_type.*superlike") as e:
        preprocess(tmp_path / "bad.parquet", tmp_path / "e", "50m")
    _one_line(e, tmp_path / "bad.parquet")


# ---------------------------------------------------------------- history and the sample


def _history_user():
    """User 3: a known run of events across two sessions; returns (sessions, the events flat)."""
    kinds = ["lp", "skip", "like", "lp", "dislike", "skip", "lp", "like", "skip", "lp", "skip", "lp"]
    evs = [_ev(i + 1, 1000 + 60 * i, k) for i, k in enumerate(kinds)]
    evs.append(_ev(19, 9000, "skip"))  # the last anchor, a skip (listen, label 0), after a session cut
    return [(3, 0, evs[:6]), (3, 1, evs[6:])], evs, kinds + ["skip"]


def _expected_history(kinds, anchor, per_pool, scan_window=10**9):
    start = max(0, anchor - scan_window)
    pools = {"lp": [], "like": [], "skip": []}
    for i in range(start, anchor):
        if kinds[i] in pools:
            pools[kinds[i]].append(i)
    return sorted(pools["lp"][-per_pool:] + pools["like"][-per_pool:] + pools["skip"][-per_pool:])


@pytest.mark.parametrize("per_pool,scan", [(2, 10**9), (1, 10**9), (2, 5)])
def test_history_takes_the_last_of_each_pool_in_time_order(tmp_path, per_pool, scan):
    sessions, evs, kinds = _history_user()
    cfg = YambdaConfig(history_length=3 * per_pool + 2, min_history=0, scan_window=scan, max_seq_len=64,
                       cross_specs=SMALL_CROSSES)  # fmt: skip
    ds = YambdaDataset(_write(tmp_path, sessions), cfg)
    anchors = [i for i, k in enumerate(kinds) if k in ("lp", "skip")]  # listens only
    assert ds.positions.tolist() == anchors
    bits = {"lp": 1, "like": 2, "skip": 4}
    for a_idx, pos in enumerate(anchors):
        want = _expected_history(kinds, pos, per_pool, scan)
        s = ds.sample(a_idx)
        assert s.uih["item_id"][0].tolist() == [evs[i][0] for i in want]
        assert s.uih["action_timestamp"][0].tolist() == [evs[i][1] for i in want]
        assert s.uih["action_weight"][0].tolist() == [bits[kinds[i]] for i in want]
        assert s.uih["artist_id"][0].tolist() == [evs[i][0] % 5 for i in want]
        assert s.uih["album_id"][0].tolist() == [evs[i][0] % 7 for i in want]


def test_history_truncated_to_the_sequence_budget_and_last_n(tmp_path):
    sessions, evs, kinds = _history_user()
    # budget = max_seq_len - 1 candidate - 8 contextual = 3: the 3 most recent of the gathered history
    cfg = YambdaConfig(history_length=30, min_history=0, max_seq_len=12, cross_specs=SMALL_CROSSES)
    ds = YambdaDataset(_write(tmp_path, sessions), cfg)
    s = ds.sample(len(ds) - 1)
    pooled = [i for i in range(len(kinds) - 1) if kinds[i] != "dislike"]
    assert s.uih["item_id"][0].tolist() == [evs[i][0] for i in pooled[-3:]]
    assert s.uih["item_id"][1] == 3
    last_n = YambdaDataset(
        tmp_path, dataclasses.replace(cfg, strategy="last_n", history_length=4, max_seq_len=64)
    )
    assert last_n.sample(len(ds) - 1).uih["item_id"][0].tolist() == [evs[i][0] for i in pooled[-4:]]


def _xxhash_cross(values, rows, salt):
    import xxhash

    return xxhash.xxh64(struct.pack(f"<{len(values)}q", *values), seed=salt).intdigest() % rows


def test_sample_is_the_references_build_sample(tmp_path):
    sessions, evs, kinds = _history_user()
    cfg = YambdaConfig(history_length=6, min_history=3, max_seq_len=64, cross_specs=SMALL_CROSSES)
    ds = YambdaDataset(_write(tmp_path, sessions), cfg)
    assert ds.positions.tolist() == [i for i, k in enumerate(kinds) if k in ("lp", "skip") and i >= 3]
    for a_idx, pos in enumerate(ds.positions.tolist()):
        s = ds.sample(a_idx)
        names = list(yambda.uih_features(SMALL_CROSSES)) + [yambda.QUERY_TIME]
        assert list(s.uih) == names and list(s.candidates) == list(yambda.CANDIDATE_FEATURES)
        item, ts, _, ratio, organic = evs[pos]
        anchor = {"uid": 3, "item_id": item, "artist_id": item % 5, "album_id": item % 7,
                  "hour_of_day": (ts // 3600) % 24, "is_organic": organic}  # fmt: skip
        assert s.uih["uid"][0].tolist() == [3] and s.uih["uid"][1] == 1
        for name, keys, rows, salt in SMALL_CROSSES:
            assert s.uih[name][0].tolist() == [_xxhash_cross([anchor[k] for k in keys], rows, salt)], name
        n = s.uih["item_id"][1]
        for f in yambda.SEQUENCE_FEATURES:
            assert s.uih[f][1] == n and len(s.uih[f][0]) == n and s.uih[f][0].dtype == np.int64
        assert s.uih["dummy_watch_time"][0].tolist() == [0] * n
        query = int(s.uih["action_timestamp"][0][-1])  # the last history time, not the anchor's
        assert s.uih[yambda.QUERY_TIME][0].tolist() == [query]
        lp = kinds[pos] == "lp"
        want = [item, item % 5, item % 7, query, 1 if lp else 0, 1]
        assert [(v.tolist(), m) for v, m in s.candidates.values()] == [([w], 1) for w in want]
        assert s.labels[yambda.TASK].tolist() == [float(lp)]


def test_cross_hash_batch_equals_xxhash_package():
    rng = np.random.default_rng(0)
    for n, rows, salt in ((2, 100_000_000, 0), (3, 40_000_000, 0), (2, 7, 123)):
        cols = [rng.integers(0, 2**40, 200) for _ in range(n)]
        got = yambda.cross_hash(cols, rows, salt)
        assert got.tolist() == [_xxhash_cross([int(c[i]) for c in cols], rows, salt) for i in range(200)]


# ---------------------------------------------------------------- windows, hold-out, shuffle


def _splitmix_unit(uid, salt):
    m = (1 << 64) - 1
    z = (uid + 0x9E3779B97F4A7C15 + salt) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return (z >> 11) / 9007199254740992.0


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """40 users, each a listen every 6 hours over 5 days from a per-user offset, interleaved with likes."""
    sessions = []
    for u in range(40):
        evs = []
        for j in range(20):
            t = 7 * u + 21_600 * j
            evs.append(_ev(j % 20, t, "lp" if (u + j) % 3 else "skip"))
            if j % 4 == 0:
                evs.append(_ev(j % 20, t, "like"))
        sessions += [(u, j, [e]) for j, e in enumerate(evs)]
    return _write(tmp_path_factory.mktemp("yambda") / "d", sessions)


def test_windows_are_days_in_time_order_and_cover_every_anchor(days):
    ds = YambdaDataset(days, YambdaConfig(min_history=2, cross_specs=SMALL_CROSSES))
    assert ds.num_windows() == 5 and ds.t_min == ds.anchor_ts.min()
    seen = []
    for w in range(ds.num_windows()):
        idx = ds.window_indices(w)
        ts = ds.anchor_ts[idx]
        assert ((ts >= ds.t_min + w * 86_400) & (ts < ds.t_min + (w + 1) * 86_400)).all()
        assert (np.diff(idx) > 0).all()  # user-major: the reference's ascending anchor order
        if seen:
            assert ts.min() > ds.anchor_ts[seen[-1]].max()  # strictly after the previous window
        seen.append(idx)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(len(ds)))
    assert ds.total_train_anchors(0, 3) == sum(len(s) for s in seen[:3])
    assert yambda.stream_plan(5, 0, 299, 299) == ([0, 1, 2, 3], 299)  # clamped train count; eval as asked
    assert yambda.stream_plan(5, 1, 2, None) == ([1, 2], 3)


def test_eval_holdout_users_never_train(days):
    cfg = YambdaConfig(min_history=2, cross_specs=SMALL_CROSSES, train_split_percentage=0.7, split_salt=11)
    ds = YambdaDataset(days, cfg)
    held = {u for u in range(40) if _splitmix_unit(u, 11) >= 0.7}
    assert 0 < len(held) < 40
    for w in range(4):
        users = set(ds.events.uid[ds.positions[ds.train_window_indices(w)]].tolist())
        assert users and not users & held
    ev = ds.eval_holdout_indices(4)
    assert set(ds.events.uid[ds.positions[ev]].tolist()) == held
    assert np.array_equal(ev, ds.window_indices(4)[np.isin(ds.events.uid[ds.positions[ds.window_indices(4)]],
                                                           list(held))])  # fmt: skip
    assert ds.total_train_anchors(0, 4) == sum(len(ds.train_window_indices(w)) for w in range(4))
    assert yambda.per_rank(np.arange(10), 1, 4).tolist() == [1, 5]  # cut to 8, every 4th from rank 1
    idx = ds.window_indices(2)
    ws, bs = 4, 3
    ranks = [yambda.per_rank(idx, r, ws) for r in range(ws)]
    steps = min(len(x) for x in ranks) // bs  # DataLoader(drop_last=True) on each rank
    together = [np.sort(np.concatenate([x[k * bs : (k + 1) * bs] for x in ranks])) for k in range(steps)]
    assert np.array_equal(np.array(together), yambda.global_batches(idx, ws * bs))


def test_in_window_shuffle(days):
    base = YambdaConfig(min_history=2, cross_specs=SMALL_CROSSES, shuffle_seed=3)
    idx = YambdaDataset(days, base).window_indices(2)
    full = YambdaDataset(days, dataclasses.replace(base, shuffle_fraction=1.0)).train_window_indices(2)
    assert np.array_equal(full, idx[np.random.default_rng(3 + 2).permutation(len(idx))])
    half = YambdaDataset(days, dataclasses.replace(base, shuffle_fraction=0.5)).train_window_indices(2)
    k = round(0.5 * len(idx))
    assert not np.array_equal(half, idx)
    assert sorted(half[:k]) == sorted(idx[:k]) and sorted(half[k:]) == sorted(idx[k:])  # within segments
    assert np.array_equal(YambdaDataset(days, base).train_window_indices(2), idx)  # 0: off


# ---------------------------------------------------------------- the synthetic data


MICRO = dataclasses.replace(
    yambda_synth.SCALES["tiny"], users=24, items=120, artists=10, albums=30, train_days=3
)


def _manifest(out: Path) -> dict:
    return json.loads((out / "yambda.manifest.json").read_text())


def test_synth_is_deterministic_per_seed_and_readable(tmp_path):
    a, b, c = (yambda_synth.generate(tmp_path / n, MICRO, s, log=lambda *_: None) for n, s in
               (("a", 0), ("b", 0), ("c", 1)))  # fmt: skip
    fa, fb, fc = (_manifest(tmp_path / n)["files"] for n in "abc")
    assert fa == fb and a == b
    assert fa["processed_5b/train_sessions.parquet"] != fc["processed_5b/train_sessions.parquet"]
    assert set(fa) == {
        "processed_5b/train_sessions.parquet", "processed_5b/test_events.parquet",
        "processed_5b/session_index.parquet", "processed_5b/item_popularity.npy", "processed_5b/split_meta.json",
        "shared_metadata/artist_item_mapping.parquet", "shared_metadata/album_item_mapping.parquet",
    }  # fmt: skip
    ds = YambdaDataset(tmp_path / "a", YambdaConfig(history_length=30, min_history=5, max_seq_len=64))
    assert ds.num_windows() == MICRO.train_days
    assert 0.5 < a["hidden_model_last_day_auc"] < 1 and 0.4 < a["listen_plus_rate_last_day"] < 0.85


def test_synth_yambda_tiny_cli(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["data", "synth-yambda", "--scale", "tiny", "--out", str(out), "--seed", "0"]) == 0
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert size < 3 << 20
    info = _manifest(out)
    assert info["hidden_model_last_day_auc"] > 0.8  # the planted signal a model can learn
    capsys.readouterr()
    assert main(["data", "synth-yambda", "--scale", "tiny", "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err


def _write_reference_cache(ds: YambdaDataset, folder: Path, positions: bool) -> None:
    """The flat-event cache as the reference's _ensure_cache_built writes it (yambda.py:441-541)."""
    folder.mkdir()
    ev = ds.events
    cols = {
        "flat_uid": ev.uid, "flat_item_ids": ev.item, "flat_timestamps": ev.ts, "flat_event_types": ev.etype,
        "flat_is_organic": ev.organic.astype(np.int8), "flat_played_ratio": ev.ratio.astype(np.float32),
        "flat_is_listen_plus": ev.is_lp, "flat_is_like": ev.is_like, "flat_is_skip": ev.is_skip,
        "user_start": ev.user_start, "user_end": ev.user_end, "unique_uids": np.unique(ev.uid),
    }  # fmt: skip
    for name, arr in cols.items():
        np.save(folder / f"{name}.npy", arr)
    if positions:
        np.save(folder / "positions_L30_m5.npy", ds.positions)
    (folder / "store_meta.json").write_text(json.dumps({"num_users": 24, "total_events": len(ev.uid)}))
    (folder / "_READY").touch()


@pytest.mark.parametrize("positions", [True, False])
def test_the_references_cache_reads_as_the_parquet(tmp_path, positions):
    """MLCommons' prepared download ships the flat-event cache and no parquet (README.MD:64-82)."""
    yambda_synth.generate(tmp_path, MICRO, 0, log=lambda *_: None)
    cfg = YambdaConfig(history_length=30, min_history=5, max_seq_len=64, shuffle_fraction=0.3)
    ref = YambdaDataset(tmp_path, cfg)
    cache = tmp_path / "processed_5b" / "hstu_cache_L30"
    _write_reference_cache(ref, cache, positions)
    (tmp_path / "processed_5b" / yambda.SESSIONS).unlink()
    ds = YambdaDataset(tmp_path, cfg)
    assert np.array_equal(ds.positions, ref.positions) and ds.num_windows() == ref.num_windows()
    assert np.array_equal(ds.train_window_indices(1), ref.train_window_indices(1))
    for a, b in zip(ds.samples(range(0, len(ds), 7)), ref.samples(range(0, len(ds), 7)), strict=True):
        for x, y in ((a.uih, b.uih), (a.candidates, b.candidates)):
            assert list(x) == list(y)
            assert all(np.array_equal(x[k][0], y[k][0]) and x[k][1] == y[k][1] for k in x)
        assert a.labels.keys() == b.labels.keys() and all(
            np.array_equal(a.labels[k], b.labels[k]) for k in a.labels
        )
    ts = np.load(cache / "flat_timestamps.npy")
    ts[5], ts[6] = ts[6] + 1, ts[5]
    np.save(cache / "flat_timestamps.npy", ts)
    with pytest.raises(UserError, match="go back in time") as e:
        YambdaDataset(tmp_path, cfg)
    _one_line(e, cache / "flat_timestamps.npy")


# ---------------------------------------------------------------- bad input: one line naming the file


def _one_line(excinfo, path):
    msg = str(excinfo.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def _simple(uid=1, ts=(0, 10, 20), kinds=("lp", "skip", "lp"), items=(1, 2, 3)):
    return [(uid, 0, [_ev(i, t, k) for i, t, k in zip(items, ts, kinds, strict=True)])]


def test_bad_input_is_one_line_naming_the_file(tmp_path):
    cfg = YambdaConfig(min_history=0, cross_specs=SMALL_CROSSES)
    sess = lambda r: r / "processed_5b" / yambda.SESSIONS  # noqa: E731
    cases = []
    r = _write(tmp_path / "ts", _simple(ts=(0, 30, 20)))
    cases.append((r, sess(r), "back in time"))
    r = _write(tmp_path / "nan", [(1, 0, [_ev(1, 0, "lp"), (2, 5, 0, None, 1)])])
    cases.append((r, sess(r), "NaN played_ratio_pct"))
    r = _write(tmp_path / "item", _simple(items=(1, 2, 25)))
    cases.append((r, sess(r), "item id 25 is beyond its table of 20 rows"))
    r = _write(tmp_path / "etype", [(1, 0, [_ev(1, 0, "lp"), (2, 5, 9, None, 1)])])
    cases.append((r, sess(r), "event type 9"))
    r = _write(tmp_path / "col", _simple())
    t = pq.read_table(sess(r)).drop_columns(["is_organic"])
    pq.write_table(t, sess(r))
    cases.append((r, sess(r), "missing column.*is_organic"))
    r = _write(tmp_path / "pop", _simple())
    np.save(r / "processed_5b" / yambda.POPULARITY, np.ones(19, dtype=np.int64))
    cases.append((r, r / "processed_5b" / yambda.POPULARITY, "19 entries but .* 20 items"))
    r = _write(tmp_path / "map", _simple())
    (r / "shared_metadata" / yambda.ALBUM_MAP).unlink()
    cases.append((r, r / "shared_metadata" / yambda.ALBUM_MAP, "missing"))
    r = _write(tmp_path / "notpq", _simple())
    sess(r).write_bytes(b"not parquet")
    cases.append((r, sess(r), "not a parquet file"))
    for root, path, pattern in cases:
        with pytest.raises(UserError, match=pattern) as e:
            YambdaDataset(root, cfg)
        _one_line(e, path)
    # ids beyond the tables a model declares
    r = _write(tmp_path / "tables", _simple(uid=7))
    with pytest.raises(UserError, match="uid 7 is beyond its table of 5 rows") as e:
        YambdaDataset(r, cfg, tables={"uid": 5})
    _one_line(e, sess(r))
    with pytest.raises(UserError, match="item id 3 is beyond its table of 3 rows") as e:
        YambdaDataset(r, cfg, tables={"item_id": 3})
    _one_line(e, sess(r))
    with pytest.raises(UserError, match="artist_id 4 is beyond its table of 3 rows") as e:
        YambdaDataset(r, cfg, tables={"artist_id": 3})
    _one_line(e, r / "shared_metadata" / yambda.ARTIST_MAP)
    with pytest.raises(UserError, match="processed_5b: missing") as e:
        YambdaDataset(tmp_path / "nothing", cfg)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="max_seq_len 9 leaves no room"):
        YambdaConfig(max_seq_len=9)
