"""A synthetic Yambda in the dlrmv4 reference's processed layout (`ttt data synth-yambda`), deterministic per
seed.

Yambda-5B is 38 GB raw and a 227 GB trainer cache, so the tiny tier, the tests and anyone without the download
read this instead. The reader (data/yambda.py) and the reference's own DLRMv4YambdaDataset read it alike: it is
written as processed_5b/ and shared_metadata/ with the real files and column types.

The planted model (what a sequential recommender can learn from it):
- a catalog of items in albums in artists, popularity Zipf-like; each artist has a taste vector, each item
  its artist's plus a little noise;
- each user has a taste vector, a skip propensity and a favourite hour; sessions start around that hour and
  play tracks back to back, with now and then a pause of more than 30 minutes (so sessions split);
- a track is picked by the user (is_organic=1, drawn by taste over artists) or recommended (0, drawn by
  popularity alone);
- listen_plus (played >= 50%) is Bernoulli(sigmoid(logit)) with logit = bias + user + artist + item effects
  + taste affinity + an organic bonus: the history shows a user's skips and which artists they finish, the
  uid and user x artist crosses can memorize them. Likes follow some listen_plus, dislikes some skips, an
  unlike some likes (ratio and track length null on those, as in Yambda).
The hidden model's own AUC on the last training day (its ceiling) goes into split_meta.json and the manifest.

Users are generated and written in blocks of whole users, each from (seed, block) alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import rankdata

from timetotrain import fileio
from timetotrain.data import yambda_layout as yambda
from timetotrain.data.manifest import write_manifest
from timetotrain.data.yambda_prep import (
    SECONDS_PER_DAY,
    RawEvents,
    SessionWriter,
    split_boundaries,
    write_item_maps,
)
from timetotrain.errors import UserError

MANIFEST = "yambda"
CANDIDATES = 48  # artists a user picks from on organic plays


@dataclass(frozen=True)
class Scale:
    users: int
    items: int
    artists: int
    albums: int
    train_days: int
    sessions_per_day: float  # per user, Poisson
    tracks_per_session: float  # mean, geometric
    test_days: int = 1
    gap_minutes: int = 30
    dim: int = 8
    taste: float = 1.2  # weight of taste affinity in the label logit
    pick: float = 2.0  # how strongly organic picks follow taste
    organic: float = 0.45  # share of organic picks
    bias: float = 0.1  # about 60% listen_plus overall, as Yambda's 61% (README.MD:240)
    block_users: int = 4096


# fmt: off
SCALES = {
    # ~33k train events of 256 users over 10 days: < 1 MB, written in about a second.
    "tiny": Scale(users=256, items=2_000, artists=100, albums=400, train_days=10, sessions_per_day=1.2,
                  tracks_per_session=9.0),
    # ~14 M events of 20k users over 30 days.
    "small": Scale(users=20_000, items=200_000, artists=10_000, albums=40_000, train_days=30,
                   sessions_per_day=1.6, tracks_per_session=12.0),
    # Yambda-5B's sizes (README.MD:227-234; configs.py:763-791): ~4.7 B events, for throughput studies.
    "full": Scale(users=1_000_000, items=9_390_624, artists=1_293_395, albums=3_367_692, train_days=300,
                  sessions_per_day=1.3, tracks_per_session=12.0, block_users=2048),
}
# fmt: on


def scale(name: str, **overrides) -> Scale:
    """A named scale, with fields replaced (a tier may shrink one: `scale("tiny", users=64)`)."""
    if name not in SCALES:
        raise UserError(f"--scale {name!r}: choose one of {', '.join(SCALES)}")
    return dataclasses.replace(SCALES[name], **overrides)


def _rng(seed: int, *parts: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *parts]))


@dataclass
class Catalog:
    item_artist: np.ndarray
    item_album: np.ndarray
    item_len: np.ndarray  # track length, seconds
    item_effect: np.ndarray
    artist_effect: np.ndarray
    artist_vec: np.ndarray  # [artists, dim]
    artist_pop: np.ndarray  # log popularity
    item_pop: np.ndarray  # cumulative distribution over items, for recommended picks
    by_artist: np.ndarray  # item ids grouped by artist
    artist_bounds: np.ndarray  # artist a's items: by_artist[bounds[a]:bounds[a + 1]]
    by_artist_cum: np.ndarray  # running popularity along by_artist


def _item_of_artist(cat: Catalog, art: np.ndarray, r: np.ndarray) -> np.ndarray:
    """An item of each artist in `art`, by popularity within the artist (r uniform in [0, 1))."""
    lo_i, hi_i = cat.artist_bounds[art], cat.artist_bounds[art + 1]
    cum = cat.by_artist_cum
    lo = np.where(lo_i > 0, cum[np.maximum(lo_i - 1, 0)], 0.0)
    pos = np.searchsorted(cum, lo + r * (cum[hi_i - 1] - lo), side="right")
    return cat.by_artist[np.clip(pos, lo_i, hi_i - 1)]


def catalog(sc: Scale, seed: int) -> Catalog:
    rng = _rng(seed, 0)
    # albums to artists, items to albums: every artist has an album and every album an item
    album_artist = np.concatenate(
        [np.arange(sc.artists), rng.integers(0, sc.artists, sc.albums - sc.artists)]
    )
    item_album = np.concatenate([np.arange(sc.albums), rng.integers(0, sc.albums, sc.items - sc.albums)])
    rng.shuffle(item_album)
    item_artist = album_artist[item_album]
    artist_pop = -1.1 * np.log1p(rng.permutation(sc.artists)).astype(np.float64)
    item_w = np.exp(artist_pop[item_artist] + rng.normal(0, 1.0, sc.items))
    order = np.argsort(item_artist, kind="stable")
    return Catalog(
        item_artist=item_artist,
        item_album=item_album,
        item_len=rng.integers(90, 360, sc.items),
        item_effect=rng.normal(0, 0.5, sc.items).astype(np.float32),
        artist_effect=rng.normal(0, 0.6, sc.artists).astype(np.float32),
        artist_vec=rng.normal(0, 1, (sc.artists, sc.dim)).astype(np.float32),
        artist_pop=artist_pop,
        item_pop=np.cumsum(item_w) / item_w.sum(),
        by_artist=order,
        artist_bounds=np.searchsorted(item_artist[order], np.arange(sc.artists + 1)),
        by_artist_cum=np.cumsum(item_w[order]),
    )


def _pick(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    return np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1)


def user_block(sc: Scale, cat: Catalog, seed: int, block: int, first: int, count: int):
    """(RawEvents, listen logits) of users first..first+count-1."""
    rng = _rng(seed, 1, block)
    days = sc.train_days + sc.test_days
    span = days * SECONDS_PER_DAY + sc.gap_minutes * 60
    u_vec = rng.normal(0, 1, (count, sc.dim)).astype(np.float32)
    u_eff = rng.normal(0, 1.0, count).astype(np.float32)
    u_hour = rng.uniform(0, 24, count)
    n_sess = rng.poisson(sc.sessions_per_day * days, count)
    s_user = np.repeat(np.arange(count), n_sess)
    s_day = rng.integers(0, days, len(s_user))
    s_hour = (u_hour[s_user] + rng.normal(0, 3.0, len(s_user))) % 24
    s_start = s_day * SECONDS_PER_DAY + (s_hour * 3600).astype(np.int64)
    n_tr = 1 + rng.geometric(1.0 / sc.tracks_per_session, len(s_user))
    ev_sess = np.repeat(np.arange(len(s_user)), n_tr)
    user = s_user[ev_sess]
    n = len(ev_sess)
    organic = rng.random(n) < sc.organic
    item = _pick(cat.item_pop, rng.random(n))
    # organic: one of the user's candidate artists (drawn by popularity) by taste, then one of its items
    cand = _pick(
        np.cumsum(np.exp(cat.artist_pop)) / np.exp(cat.artist_pop).sum(), rng.random((count, CANDIDATES))
    )
    cscore = sc.pick * np.einsum("ud,ucd->uc", u_vec, cat.artist_vec[cand]) / np.sqrt(sc.dim)
    ccdf = np.cumsum(np.exp(cscore - cscore.max(axis=1, keepdims=True)), axis=1)
    ccdf /= ccdf[:, -1:]
    org = np.flatnonzero(organic)
    r = rng.random(len(org))
    for a in range(0, len(org), 1 << 16):  # chunks: [events, CANDIDATES] at a time
        e = org[a : a + (1 << 16)]
        k = np.minimum((ccdf[user[e]] < r[a : a + len(e), None]).sum(axis=1), CANDIDATES - 1)
        item[e] = _item_of_artist(cat, cand[user[e], k], rng.random(len(e)))
    artist = cat.item_artist[item]
    aff = np.einsum("ij,ij->i", u_vec[user], cat.artist_vec[artist]) / np.sqrt(sc.dim)
    logit = (
        sc.bias
        + u_eff[user]
        + cat.artist_effect[artist]
        + cat.item_effect[item]
        + sc.taste * aff
        + 0.6 * organic
    ).astype(np.float64)
    lp = rng.random(n) < 1 / (1 + np.exp(-logit))
    ratio = np.where(lp, rng.integers(50, 101, n), rng.integers(0, 50, n)).astype(np.float64)
    played = np.maximum(5, (ratio / 100 * cat.item_len[item]).astype(np.int64))
    pause = np.where(rng.random(n) < 0.04, rng.integers(1900, 4000, n), rng.integers(0, 20, n))
    step = played + pause
    csum = np.cumsum(step)
    first_of = np.concatenate([[0], np.cumsum(n_tr)[:-1]])
    offset = csum - np.repeat(csum[first_of] - step[first_of], n_tr) - step  # time before each track
    ts = (s_start[ev_sess] + offset) // 5 * 5  # Yambda's timestamps are rounded to 5 s
    # likes after some listen_plus, dislikes after some skips, unlikes after some likes: same timestamp + 5
    like = lp & (rng.random(n) < 0.06 * (1 + np.tanh(aff)))
    dislike = ~lp & (rng.random(n) < 0.02)
    unlike = like & (rng.random(n) < 0.05)
    extra = [(like, 1, 0), (dislike, 2, 0), (unlike, 3, 5)]
    uid = first + user
    cols = [uid, ts, item, organic.astype(np.int64), np.zeros(n, np.int64), ratio, cat.item_len[item] * 1.0]
    logits = [logit]
    for mask, etype, dt in extra:
        i = np.flatnonzero(mask)
        cols = [
            np.concatenate([c, v])
            for c, v in zip(
                cols,
                (
                    uid[i],
                    ts[i] + dt,
                    item[i],
                    organic[i].astype(np.int64),
                    np.full(len(i), etype),
                    np.full(len(i), np.nan),
                    np.full(len(i), np.nan),
                ),
                strict=True,
            )
        ]
        logits.append(np.full(len(i), np.nan))
    raw = RawEvents(*cols)
    keep = raw.ts < span  # the last instant is planted by `generate`
    return raw.take(keep), np.concatenate(logits)[keep]


def generate(out: Path, sc: Scale, seed: int, log=print) -> dict:
    """Write the processed layout under `out` with its manifest; returns a summary."""
    out = Path(out)
    cat = catalog(sc, seed)
    span = (sc.train_days + sc.test_days) * SECONDS_PER_DAY + sc.gap_minutes * 60
    # The split is computed from the last timestamp (preprocess_public_data.py:338-345); user 0 gets an event
    # at exactly `span`, so the train window is [0, train_days) days and every block knows it in advance.
    split = split_boundaries(span, sc.train_days, sc.gap_minutes, sc.test_days)
    last_day = (split.train_end - SECONDS_PER_DAY, split.train_end)
    scores, labels = [], []
    with fileio.Staged() as staged:
        files = write_item_maps(out, staged, cat.item_artist, cat.item_album)
        w = SessionWriter(out, staged, split)
        blocks = range(0, sc.users, sc.block_users)
        for b, first in enumerate(blocks):
            raw, logit = user_block(sc, cat, seed, b, first, min(sc.block_users, sc.users - first))
            if b == 0:  # the last instant, and the last item in train so item_popularity spans the catalog
                plant = [0, span, sc.items - 1, 1, 0, 100.0, float(cat.item_len[-1])]
                plant2 = [0, 0, sc.items - 1, 1, 0, 100.0, float(cat.item_len[-1])]
                raw = RawEvents(
                    *(
                        np.concatenate([c, [p, q]])
                        for c, p, q in zip(
                            (getattr(raw, f) for f in raw.__dataclass_fields__), plant, plant2, strict=True
                        )
                    )
                )
                logit = np.concatenate([logit, [np.nan, np.nan]])
            day = (raw.ts >= last_day[0]) & (raw.ts < last_day[1]) & (raw.etype == yambda.LISTEN)
            scores.append(logit[day])
            labels.append(raw.ratio[day] >= yambda.LISTEN_PLUS_THRESHOLD)
            w.add(raw)
            if len(blocks) > 1:
                log(
                    f"users {first + min(sc.block_users, sc.users - first):,}/{sc.users:,}: "
                    f"{w.counts['train_events']:,} train events"
                )
        ceiling = _auc(np.concatenate(scores), np.concatenate(labels))
        summary = {
            "train_events": w.counts["train_events"],
            "test_events": w.counts["test_events"],
            "sessions": w.counts["sessions"],
            "users": w.counts["users"],
            "items": sc.items,
            "listen_plus_rate_last_day": float(np.concatenate(labels).mean()),
            "hidden_model_last_day_auc": ceiling,
        }
        files += w.close({"synthetic": {"seed": seed, **summary}})
        info = {"generator": {"scale": dataclasses.asdict(sc), "seed": seed}, **summary}
        write_manifest(out, MANIFEST, files, info, staged)
    return summary


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos = labels.astype(bool)
    p, n = int(pos.sum()), int((~pos).sum())
    if not p or not n:
        return float("nan")
    r = rankdata(scores)
    return float((r[pos].sum() - p * (p + 1) / 2) / (p * n))
