"""The MLPerf DLRM-DCNv2 dataset on disk (Criteo 1TB, preprocessed and materialized multi-hot) and its
reader, as the reference reads it (recommendation_v2/torchrec_dlrm/data/dlrm_dataloader.py:83-94,
data/multi_hot_criteo.py):

- 24 days, `day_<d>_dense.npy` (float32 [N, 13]: log(x + 3) of the integer features, missing as 0,
  torchrec/datasets/criteo.py:203-234 at v0.3.2), `day_<d>_labels.npy` (int32 [N, 1]) and
  `day_<d>_sparse_multi_hot.npz`, an uncompressed zip of `0.npy` ... `25.npy` (int32 [N, multi_hot[t]],
  each table's row ids; materialize_synthetic_multihot_dataset.py:131-141);
- days 0..22 are the training set, read in order (shuffled once offline); day 23's first half, rounded
  up, is the validation set, its second half the test set (multi_hot_criteo.py:116-129).

`check` is the preflight (before init_start, one line naming the file): every file present, each .npy
header readable with the expected dtype and shape and the file as long as its header says, the zip's
members stored uncompressed, ids inside their tables and labels in {0, 1}.
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from timetotrain.data.manifest import RECOPY, read_manifest, verify_manifest
from timetotrain.data.mapped import MappedFiles, _header
from timetotrain.errors import UserError

DAYS = 24  # torchrec.datasets.criteo.DAYS
# The ids each table was hashed to and the ids per sample the materialization wrote
# (materialize_synthetic_multihot_dataset.py:91-92). The model's config states its own copy (models and data
# are one layer: neither imports the other); tests/test_criteo_data.py checks they agree.
TABLE_SIZES = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282, 10,
    2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36,
)  # fmt: skip
MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
MANIFEST = "criteo"  # criteo.manifest.json: what `ttt data synth-criteo` wrote, sizes and sha256s
# Files up to this size have every id and label range-checked by the preflight (the generated tiers'); a
# larger one (a real day: 7-90 GB) has its first and last CHECK_ROWS rows checked, so that the preflight
# stays seconds, not the hours a full pass over 3.8 TB takes.
FULL_CHECK_BYTES = 2 << 30
CHECK_ROWS = 1 << 20


def dense_file(root: Path, day: int) -> Path:
    return root / f"day_{day}_dense.npy"


def labels_file(root: Path, day: int) -> Path:
    return root / f"day_{day}_labels.npy"


def sparse_file(root: Path, day: int) -> Path:
    return root / f"day_{day}_sparse_multi_hot.npz"


def day_files(root: Path, day: int) -> list[Path]:
    return [dense_file(root, day), labels_file(root, day), sparse_file(root, day)]


def val_rows(last_day_rows: int) -> int:
    """The validation half of the last day: its first ceil(N / 2) rows (multi_hot_criteo.py:117)."""
    return last_day_rows // 2 + last_day_rows % 2


def member_offset(zf: zipfile.ZipFile, fp, name: str, path: Path) -> int:
    """Where member `name`'s bytes start in the zip: after its local header (30 bytes, the name and the
    local extra field, whose lengths the local header itself gives)."""
    info = zf.NameToInfo.get(name)
    if info is None:
        raise UserError(f"{path} has no member {name}: a multi-hot file holds 0.npy ... 25.npy; {RECOPY}")
    if info.compress_type != zipfile.ZIP_STORED:
        raise UserError(f"{path}: member {name} is compressed; the reader maps it, so it must be stored")
    fp.seek(info.header_offset)
    head = fp.read(30)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise UserError(f"{path}: member {name}'s local header is damaged; {RECOPY}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


@dataclass
class Day:
    rows: int
    dense: np.ndarray  # [rows, 13] float32, mapped
    labels: np.ndarray  # [rows, 1] int32
    sparse: list[np.ndarray]  # per table [rows, k_t] int32


def _npy(mapped: MappedFiles, path: Path, dtype, cols: int | None) -> np.ndarray:
    if not path.is_file():
        raise UserError(
            f"{path} is missing: the dataset has {DAYS} days of dense, labels and multi-hot files"
        )
    arr = mapped.load(path)  # truncation and a bad header are one line naming the file
    if arr.dtype != np.dtype(dtype):
        raise UserError(f"{path} holds {arr.dtype}, not {np.dtype(dtype)}; {RECOPY}")
    if cols is not None and (arr.ndim != 2 or arr.shape[1] != cols):
        raise UserError(f"{path} has shape {arr.shape}, not [rows, {cols}]; {RECOPY}")
    return arr


def _sparse(mapped: MappedFiles, path: Path, multi_hot: tuple[int, ...], rows: int) -> list[np.ndarray]:
    if not path.is_file():
        raise UserError(
            f"{path} is missing: the dataset has {DAYS} days of dense, labels and multi-hot files"
        )
    f = mapped.watch(path)
    try:
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{path} is not a readable .npz file ({e}); {RECOPY}") from e
    size = path.stat().st_size
    out = []
    for t, k in enumerate(multi_hot):
        name = f"{t}.npy"
        start = member_offset(zf, f, name, path)
        f.seek(start)
        shape, dtype, order, offset = _header(f, path)
        where = f"{path} member {name}"
        if dtype != np.int32:
            raise UserError(f"{where} holds {dtype}, not int32 (the reference's multi-hot dtype); {RECOPY}")
        if shape != (rows, k):
            raise UserError(f"{where} has shape {shape}; the day has {rows:,} rows and table {t} {k} ids")
        if offset + rows * k * 4 > size:
            raise UserError(f"{path} is truncated ({size} bytes; member {name} ends past it): {RECOPY}")
        if rows == 0:
            out.append(np.empty((0, k), np.int32))
        else:
            out.append(np.memmap(f, dtype=np.int32, mode="r", offset=offset, shape=(rows, k), order=order))
    return out


def _spans(rows: int, nbytes: int):
    if nbytes <= FULL_CHECK_BYTES or rows <= 2 * CHECK_ROWS:
        return [slice(0, rows)]
    return [slice(0, CHECK_ROWS), slice(rows - CHECK_ROWS, rows)]


def _check_values(path_of, day: Day, table_sizes: tuple[int, ...], chunk: int = 1 << 18) -> None:
    lab_path = path_of("labels")
    for span in _spans(day.rows, day.labels.nbytes):
        for a in range(span.start, span.stop, chunk):
            lab = day.labels[a : min(a + chunk, span.stop)]
            if lab.size and (int(lab.min()) < 0 or int(lab.max()) > 1):
                bad = int(lab[(lab < 0) | (lab > 1)][0])
                raise UserError(f"{lab_path}: label {bad} is not 0 or 1 (a click label); {RECOPY}")
    sp_path = path_of("sparse")
    for t, (arr, n) in enumerate(zip(day.sparse, table_sizes, strict=True)):
        for span in _spans(day.rows, arr.nbytes):
            for a in range(span.start, span.stop, chunk):
                ids = arr[a : min(a + chunk, span.stop)]
                if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
                    bad = int(ids.max()) if int(ids.max()) >= n else int(ids.min())
                    raise UserError(
                        f"{sp_path} member {t}.npy: id {bad} is outside table {t}'s {n:,} rows; the data "
                        "was made for other table sizes"
                    )


class CriteoFiles:
    """The checked, memory-mapped days of one dataset folder."""

    def __init__(self, root: Path, days: list[Day], mapped: MappedFiles, manifest: dict | None):
        self.root, self.days, self.mapped, self.manifest = root, days, mapped, manifest

    def files(self) -> list[Path]:
        return [p for d in range(DAYS) for p in day_files(self.root, d)]

    @property
    def train_rows(self) -> int:
        return sum(d.rows for d in self.days[:-1])

    @property
    def val_rows(self) -> int:
        return val_rows(self.days[-1].rows)

    def close(self) -> None:
        self.mapped.close()


def open_files(
    root: Path, table_sizes: tuple[int, ...], multi_hot: tuple[int, ...], check_values: bool = True
) -> CriteoFiles:
    """Map every day and check it (the preflight); raises UserError naming the first bad file."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--data {root} is not a folder: give the folder with day_0_dense.npy ... day_23_*")
    mapped = MappedFiles()
    days = []
    try:
        for d in range(DAYS):
            for p in day_files(root, d):  # every missing file is named before any is opened
                if not p.is_file():
                    raise UserError(
                        f"{p} is missing: the dataset has {DAYS} days of dense, labels and multi-hot files"
                    )
        for d in range(DAYS):
            dense = _npy(mapped, dense_file(root, d), np.float32, 13)
            labels = _npy(mapped, labels_file(root, d), np.int32, None)
            if labels.ndim == 1:
                labels = labels.reshape(-1, 1)
            rows = len(dense)
            if labels.shape != (rows, 1):
                raise UserError(f"{labels_file(root, d)} has shape {labels.shape}; its day has {rows:,} rows")
            sparse = _sparse(mapped, sparse_file(root, d), multi_hot, rows)
            day = Day(rows, dense, labels, sparse)
            if check_values:
                names = {"labels": labels_file(root, d), "sparse": sparse_file(root, d)}
                _check_values(names.__getitem__, day, table_sizes)
            days.append(day)
    except BaseException:
        mapped.close()
        raise
    return CriteoFiles(root, days, mapped, read_manifest(root, MANIFEST, tokenized=False))


def verify(files: CriteoFiles) -> bool:
    """Sizes, then sha256s, of the files a generated dataset's manifest lists; False when there is none."""
    if files.manifest is None:
        return False
    verify_manifest(files.root, files.manifest)
    return True


class Rows:
    """Rows [start, stop) of a split that runs across days, gathered into one batch."""

    def __init__(self, days: list[Day], first: int = 0, count: int | None = None):
        # (day, first row in it) pieces laid end to end
        self.days = days
        self.starts = [0]
        for d in days:
            self.starts.append(self.starts[-1] + d.rows)
        self.first = first
        self.count = self.starts[-1] - first if count is None else count

    def __len__(self) -> int:
        return self.count

    def take(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dense [n, 13] float32, labels [n] float32, sparse [n, sum k] int32) of split rows [start, start+n)."""
        a, b = self.first + start, self.first + start + n
        dense, labels, sparse = [], [], []
        for i, d in enumerate(self.days):
            lo, hi = max(a, self.starts[i]), min(b, self.starts[i + 1])
            if lo >= hi:
                continue
            s = slice(lo - self.starts[i], hi - self.starts[i])
            dense.append(np.asarray(d.dense[s]))
            labels.append(np.asarray(d.labels[s]).reshape(-1))
            sparse.append(np.concatenate([np.asarray(x[s]) for x in d.sparse], axis=1))
        return (
            np.concatenate(dense),
            np.concatenate(labels).astype(np.float32),
            np.concatenate(sparse),
        )


def batches(rows: int, gbs: int) -> int:
    """Whole training batches in one epoch: the last, partial one is dropped (the reference's
    --drop_last_training_batch; the rules allow it)."""
    return rows // gbs


def eval_every(train_rows: int, gbs: int, per_epoch: int = 20) -> int:
    """The reference's --validation_freq_within_epoch $((TOTAL_TRAINING_SAMPLES / (GLOBAL_BATCH_SIZE * 20)))
    (README.MD:162, shell integer division), in steps; at least 1."""
    return max(train_rows // (gbs * per_epoch), 1)


def expected_bytes(rows: int, multi_hot: tuple[int, ...]) -> int:
    return rows * (13 * 4 + 4 + 4 * sum(multi_hot))
