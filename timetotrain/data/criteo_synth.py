"""A synthetic Criteo in the MLPerf multi-hot layout (`ttt data synth-criteo`), deterministic per seed.

No Criteo sample is reachable offline (the real one is 3.8 TB), so this feeds the reader, the tiny tier
and the tests. What a model can learn from it, and why AUC stays well under 1:
- each sample has one id per table, drawn skewed towards small ids (id = floor(rows x u^`skew`)), as
  Criteo's hashed categories are: frequent ids are learnable, the tail is noise;
- ids are expanded to the multi-hot rows as the reference's materialization does: id t of a sample becomes
  the row [id, r_1 .. r_{k-1}] of a fixed per-table table of uniform random rows (multi_hot.py:87-109);
- 13 integer counts, log-normal with some missing (0), stored as log(x + 3) in float32 (the reference's
  preprocessing);
- the click is Bernoulli(sigmoid(logit)) of a hidden model: a bias, a linear term in the dense features,
  one effect per id in each of the `important` tables, `crosses` products of two tables' id factors, and
  a dense-by-id cross, scaled by `signal`: its own AUC (the ceiling) is printed and kept in the manifest.

Files are written in chunks (a `full` scale day is ~180 M rows), each chunk's random numbers drawn from
(seed, day, chunk, purpose), staged and renamed into place together with the manifest.
"""

from __future__ import annotations

import dataclasses
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import rankdata

from timetotrain import fileio
from timetotrain.data import criteo
from timetotrain.data.manifest import write_manifest
from timetotrain.errors import UserError

# Training rows of the real dataset and the rows of day 23 (its validation half is 89,137,319).
FULL_TRAIN = 4_195_197_692
FULL_LAST_DAY = 178_274_637


@dataclass(frozen=True)
class Scale:
    table_sizes: tuple[int, ...]
    train_day_rows: tuple[int, ...]  # rows of days 0..22
    last_day_rows: int
    multi_hot: tuple[int, ...] = criteo.MULTI_HOT
    skew: float = 3.0
    important: tuple[int, ...] = (0, 2, 4, 9, 10, 13, 19, 21, 22)  # tables whose ids carry an effect
    crosses: tuple[tuple[int, int], ...] = ((1, 3), (6, 14), (9, 22))
    signal: float = 0.5
    click_bias: float = -1.6  # with the terms above: about 1 click in 4, a ceiling AUC near 0.82
    chunk: int = 1 << 18


def _capped(cap: int) -> tuple[int, ...]:
    return tuple(min(n, cap) for n in criteo.TABLE_SIZES)


def _full_days() -> tuple[int, ...]:
    base, extra = divmod(FULL_TRAIN, criteo.DAYS - 1)
    return tuple(base + (d < extra) for d in range(criteo.DAYS - 1))


SCALES = {
    # 23 x 8,192 training rows, 16,384 validation rows, tables capped at 2,000 rows: about 60 MB of ids.
    "tiny": Scale(_capped(2_000), (8_192,) * (criteo.DAYS - 1), 32_768),
    "small": Scale(_capped(200_000), (400_000,) * (criteo.DAYS - 1), 800_000),
    # The real sizes: ~4 TB, days of ~182 M rows. For throughput studies of the reader, not for tests.
    "full": Scale(criteo.TABLE_SIZES, _full_days(), FULL_LAST_DAY),
}


def scale(name: str) -> Scale:
    if name not in SCALES:
        raise UserError(f"--scale {name!r}: choose one of {', '.join(SCALES)}")
    return SCALES[name]


def _rng(seed: int, *parts: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *parts]))


@dataclass
class Hidden:
    """The planted click model and the multi-hot tables, drawn once per seed."""

    dense_w: np.ndarray
    dense_mu: np.ndarray
    effect: list[np.ndarray]  # per table, per id (zeros for tables without an effect)
    factor: list[np.ndarray]  # per table, per id, for the crosses
    dense_cross: np.ndarray  # per id of table 0, times dense feature 0
    expand: list[np.ndarray]  # per table [rows, k] int32 (column 0 is the id itself)


def hidden(sc: Scale, seed: int) -> Hidden:
    rng = _rng(seed, 0)
    effect, factor, expand = [], [], []
    for t, n in enumerate(sc.table_sizes):
        effect.append(rng.standard_normal(n) * (0.9 if t in sc.important else 0.0))
        factor.append(rng.standard_normal(n))
        k = sc.multi_hot[t]
        rows = np.arange(n, dtype=np.int64)[:, None]
        extra = rng.integers(0, n, size=(n, k - 1))
        expand.append(np.concatenate([rows, extra], axis=1).astype(np.int32))
    return Hidden(
        dense_w=rng.standard_normal(13) * 0.35,
        dense_mu=rng.uniform(0.5, 2.5, 13),
        effect=effect,
        factor=factor,
        dense_cross=rng.standard_normal(sc.table_sizes[0]) * 0.5,
        expand=expand,
    )


def ids_of(sc: Scale, seed: int, day: int, index: int, rows: int, t: int) -> np.ndarray:
    """Table t's one-hot ids of a chunk, from a stream of their own: the multi-hot pass draws one table's
    ids again without the rest."""
    n = sc.table_sizes[t]
    u = _rng(seed, 2, day, index, t).random(rows)
    return np.minimum((n * u**sc.skew).astype(np.int64), n - 1)


def chunk(sc: Scale, h: Hidden, seed: int, day: int, index: int, rows: int):
    """(dense float32 [rows, 13], labels int32 [rows, 1], one-hot ids int64 [rows, tables], logits)."""
    rng = _rng(seed, 1, day, index)
    raw = np.floor(np.exp(rng.normal(h.dense_mu, 1.2, size=(rows, 13)))) - 1
    raw[rng.random((rows, 13)) < 0.1] = 0  # missing values are 0 in the preprocessing
    dense = np.log(np.maximum(raw, 0) + 3).astype(np.float32)
    ids = np.stack([ids_of(sc, seed, day, index, rows, t) for t in range(len(sc.table_sizes))], axis=1)
    z = dense.astype(np.float64) - np.log(np.exp(h.dense_mu) + 2)
    logit = z @ h.dense_w
    for t in sc.important:
        logit += h.effect[t][ids[:, t]]
    for a, b in sc.crosses:
        logit += 0.8 * h.factor[a][ids[:, a]] * h.factor[b][ids[:, b]]
    logit += z[:, 0] * h.dense_cross[ids[:, 0]]
    logit = sc.click_bias + sc.signal * logit
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int32).reshape(-1, 1)
    return dense, labels, ids, logit


def _day_rows(sc: Scale) -> list[int]:
    return [*sc.train_day_rows, sc.last_day_rows]


def _chunks(rows: int, size: int):
    for i, a in enumerate(range(0, rows, size)):
        yield i, min(size, rows - a)


def _npy_header(f, dtype, shape) -> None:
    np.lib.format.write_array_header_2_0(
        f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    )


def _write_day(staged: fileio.Staged, out: Path, sc: Scale, h: Hidden, seed: int, day: int, rows: int):
    """The three files of one day, chunk by chunk; returns (clicks, logits of the validation half or None)."""
    clicks, logits = 0, []
    with staged.open(criteo.dense_file(out, day)) as fd, staged.open(criteo.labels_file(out, day)) as fl:
        _npy_header(fd, np.float32, (rows, 13))
        _npy_header(fl, np.int32, (rows, 1))
        for i, n in _chunks(rows, sc.chunk):
            dense, labels, _, logit = chunk(sc, h, seed, day, i, n)
            fd.write(dense.tobytes())
            fl.write(labels.tobytes())
            clicks += int(labels.sum())
            logits.append(logit)
    # The multi-hot zip: table-major members, so each chunk's ids are drawn again per table (cheap next to
    # holding a day's ids). Stored, with zip64 headers: what np.savez writes and the reference maps.
    with staged.open(criteo.sparse_file(out, day)) as fz, zipfile.ZipFile(fz, "w", zipfile.ZIP_STORED) as zf:
        for t, k in enumerate(sc.multi_hot):
            with zf.open(f"{t}.npy", "w", force_zip64=True) as m:
                _npy_header(m, np.int32, (rows, k))
                for i, n in _chunks(rows, sc.chunk):
                    ids = ids_of(sc, seed, day, i, n, t)
                    m.write(np.ascontiguousarray(h.expand[t][ids]).tobytes())
    return clicks, np.concatenate(logits) if logits else np.empty(0)


def generate(out: Path, sc: Scale, seed: int, log=print) -> dict:
    """Write the 24 days under `out` with their manifest; returns a summary (rows, click rate, the hidden
    model's own validation AUC)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    h = hidden(sc, seed)
    rows = _day_rows(sc)
    total_clicks = 0
    with fileio.Staged() as staged:
        written: list[Path] = []
        last_logits = None
        for d, n in enumerate(rows):
            clicks, logits = _write_day(staged, out, sc, h, seed, d, n)
            total_clicks += clicks
            written += criteo.day_files(out, d)
            if d == criteo.DAYS - 1:
                last_logits = logits
            log(f"day {d}: {n:,} rows, click rate {clicks / max(n, 1):.3f}")
        val = criteo.val_rows(rows[-1])
        labels = np.concatenate(
            [chunk(sc, h, seed, criteo.DAYS - 1, i, n)[1] for i, n in _chunks(rows[-1], sc.chunk)]
        )
        ceiling = _auc(last_logits[:val], labels[:val, 0])
        summary = {
            "rows": sum(rows),
            "train_rows": sum(rows[:-1]),
            "val_rows": val,
            "click_rate": total_clicks / max(sum(rows), 1),
            "hidden_model_val_auc": ceiling,
        }
        info = {"generator": {"scale": dataclasses.asdict(sc), "seed": seed}, **summary}
        write_manifest(out, criteo.MANIFEST, written, info, staged)
    return summary


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney AUC with average ranks for ties (the hidden model's, for the manifest)."""
    pos = labels == 1
    p, n = int(pos.sum()), int((~pos).sum())
    if not p or not n:
        return float("nan")
    r = rankdata(scores)
    return float((r[pos].sum() - p * (p + 1) / 2) / (p * n))
