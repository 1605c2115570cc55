"""MLCommons' preprocessed flux1 encodings -> the memory-mapped layout of data/flux_encodings.py.

`ttt data prepare flux --src DIR` imports them when DIR is in this layout (it is detected; no --encoders):
the training loop then reads our one-file-per-field memory maps, never the Arrow files.

The source layout, as the MLCommons training repository's flux1 reference (text_to_image: torchtitan's
experiments/flux preprocessing scripts) writes it and as its download (`cc12m_preprocessed/`,
`coco_preprocessed/`, `empty_encodings/`) provides it:

- Each preprocessing rank writes Parquet files `data_<rank>_<idx:04d>.parquet`; these are then loaded with
  `datasets.Dataset.from_parquet(<folder>/*.parquet)` and written with `save_to_disk`: a folder holding
  `state.json` (its `_data_files`, in order), `dataset_info.json` and `data-XXXXX-of-YYYYY.arrow` files
  (Arrow IPC streams). The reference reads it with `datasets.load_from_disk`, and its configs name
  `<folder>/*`, so a folder may also hold several such datasets.
  `--src` may be: one save_to_disk folder; a folder of several (read in sorted name order); a folder of
  the Parquet files (sorted by name, the order `from_parquet` of their glob gives) or one such file; or
  several of these, comma-separated, read in the order given.
- One row per sample, columns: `__key__` (string); `t5_encodings`, `clip_encodings`, `mean`, `logvar`
  (binary: the bytes `np.save` writes for a uint16 array holding the bit pattern of a bfloat16 tensor;
  per sample [256, 4096], [768], [16, 32, 32], [16, 32, 32] at the reference shapes); `timestep` (int32:
  set on the COCO validation set, each sample's fixed eval timestep index 0..7, t = timestep / 8; null, or
  absent, on training data). Other columns are ignored.
- `empty_encodings/t5_empty.npy`, `clip_empty.npy`: `np.save` of a real float array each, with a leading
  batch dim of 1 ([1, 256, 4096], [1, 768]); the reference takes `[0]` and casts to its compute dtype.

The import streams: Arrow files are memory-mapped and read batch by batch, Parquet files batch by batch (at
most one row group's column chunks in memory), and every sample's cells are checked and written straight to
the output files, so memory stays bounded for the real 1,099,776-sample (about 2.5 TB) training set. A
first pass counts the rows (Parquet footers; Arrow stream message headers, zero-copy) so each output
`.npy` can be written sequentially under its final header. A live line shows progress.

Per sample: each cell must decode as an .npy array of uint16 (bfloat16 bits) in this tier's shape; the bits
are copied as they are (the import is bit-exact). Keys must be non-empty and without whitespace (keys.txt
holds one a line). Stored timesteps are kept (`timestep.npy`) when every row has one, and then the
evaluation uses them instead of its own (i mod 8) / 8; the manifest records their counts per value and
whether they equal i mod 8 in stored order. Any violation is one error line naming the file and the key.

The empty encodings are taken from `--empty-encodings DIR`, else from `empty_encodings/` beside (or
inside) the --src folder, and stored without the batch dim in their own float dtype.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from timetotrain import fileio
from timetotrain.data import flux_encodings as enc
from timetotrain.errors import UserError
from timetotrain.progress import LiveLine

KEY = "__key__"
TIMESTEP = "timestep"
COLUMNS = {"t5": "t5_encodings", "clip": "clip_encodings", "vae_mean": "mean", "vae_logvar": "logvar"}
SOURCE_FORMAT = "mlcommons-preprocessed"
_BATCH_ROWS = 64  # Parquet rows per decoded batch: 64 reference samples are about 140 MB


@dataclass(frozen=True)
class Part:
    """One source file: an Arrow IPC file of a save_to_disk dataset, or a Parquet file."""

    path: Path
    kind: str  # "arrow" | "parquet"


# ------------------------------------------------------------------------------------------------ finding


def _saved_dataset(d: Path) -> list[Part]:
    """The Arrow files of one save_to_disk folder, in state.json's order (sorted names without it)."""
    state = d / "state.json"
    names = None
    if state.is_file():
        try:
            names = [
                f["filename"]
                for f in json.loads(fileio.read_bounded(state, fileio.SMALL_FILE, "state file").decode())[
                    "_data_files"
                ]
            ]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"{state}: not a `datasets` save_to_disk state file ({type(e).__name__}: {e})"
            ) from e
    paths = [d / n for n in names] if names is not None else sorted(d.glob("data-*.arrow"))
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise UserError(f"{missing[0]}: listed in {state.name} but missing: the download is incomplete")
    if not paths:
        raise UserError(f"{d}: a `datasets` folder without .arrow files: the download is incomplete")
    return [Part(p, "arrow") for p in paths]


def _is_saved_dataset(d: Path) -> bool:
    return (d / "state.json").is_file() or any(d.glob("data-*-of-*.arrow"))


def _parts_of(p: Path) -> list[Part] | None:
    """The MLCommons files under one --src path, or None when it is not in that layout."""
    if p.is_file():
        return [Part(p, p.suffix[1:])] if p.suffix in (".parquet", ".arrow") else None
    if not p.is_dir():
        return None
    if _is_saved_dataset(p):
        return _saved_dataset(p)
    subsets = sorted(s for s in p.iterdir() if s.is_dir() and _is_saved_dataset(s))
    parquet = sorted(p.glob("*.parquet"))
    if subsets and parquet:
        raise UserError(
            f"--src {p} holds both `datasets` folders ({subsets[0].name}, ...) and Parquet files "
            f"({parquet[0].name}, ...): name one of them"
        )
    splits = {s.name for s in subsets} & {"cc12m_preprocessed", "coco_preprocessed"}
    if len(splits) == 2:  # the download's root: training and validation would be imported as one split
        raise UserError(
            f"--src {p} holds both cc12m_preprocessed/ (training) and coco_preprocessed/ (validation): "
            f"import each with its --split, e.g. --src {p / 'cc12m_preprocessed'} --split train"
        )
    if subsets:
        return [part for s in subsets for part in _saved_dataset(s)]
    return [Part(f, "parquet") for f in parquet] or None


def find_sources(src: str) -> list[Part] | None:
    """The files of MLCommons' preprocessed encodings that `--src` (comma-separated) names, in reading
    order; None when --src is something else (image/caption tars, or paths that do not exist)."""
    paths = [Path(s.strip()) for s in src.split(",") if s.strip()]
    found = [_parts_of(p) for p in paths]
    if all(f is None for f in found):
        return None
    if any(f is None for f in found):
        other = paths[[f is None for f in found].index(True)]
        raise UserError(
            f"--src {other} is not MLCommons' preprocessed encodings while the other --src paths are: "
            "import encodings and encode tars in separate runs"
        )
    return [part for f in found for part in f]


# ------------------------------------------------------------------------------------------------ reading


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class _Reader:
    """Schema, row count and record batches of one Part; errors name the file. The file is open only while
    it is counted or read (the real download has thousands of files: more than the usual open-file limit)."""

    def __init__(self, part: Part):
        self.part = part
        with self._open() as src:
            self.schema = src.schema_arrow if part.kind == "parquet" else src.schema
        self._check_schema()

    @contextlib.contextmanager
    def _open(self):
        what = "a Parquet file" if self.part.kind == "parquet" else "an Arrow IPC stream or file"
        try:
            if self.part.kind == "parquet":
                with pq.ParquetFile(self.part.path, memory_map=True) as f:
                    yield f
                return
            with pa.memory_map(str(self.part.path)) as mm:
                try:  # save_to_disk writes IPC streams; an IPC file (random access) is accepted too
                    reader = pa.ipc.open_stream(mm)
                except pa.ArrowInvalid:
                    mm.seek(0)
                    reader = pa.ipc.open_file(mm)
                yield reader
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{self.part.path}: not {what} or damaged ({_one_line(e)})") from e

    def _check_schema(self) -> None:
        names = self.schema.names
        for col in (KEY, *COLUMNS.values()):
            if col not in names:
                raise UserError(
                    f"{self.part.path}: no column {col!r} (it has {', '.join(names)}): not MLCommons' flux1 "
                    "preprocessed encodings"
                )
        kinds = {KEY: (pa.types.is_string, pa.types.is_large_string)}
        kinds |= {c: (pa.types.is_binary, pa.types.is_large_binary) for c in COLUMNS.values()}
        if TIMESTEP in names:
            kinds[TIMESTEP] = (pa.types.is_integer, pa.types.is_null)
        for col, ok in kinds.items():
            t = self.schema.field(col).type
            if not any(f(t) for f in ok):
                raise UserError(f"{self.part.path}: column {col!r} is {t}, expected {ok[0].__name__[3:]}")
        self.columns = [KEY, *COLUMNS.values()] + ([TIMESTEP] if TIMESTEP in names else [])

    def rows(self) -> int:
        if self.part.kind == "parquet":
            with self._open() as f:
                return f.metadata.num_rows
        return sum(b.num_rows for b in self.batches())

    def batches(self):
        with self._open() as src:
            if self.part.kind == "parquet":
                yield from src.iter_batches(batch_size=_BATCH_ROWS, columns=self.columns)
            elif isinstance(src, pa.ipc.RecordBatchFileReader):
                for i in range(src.num_record_batches):
                    yield src.get_batch(i)
            else:
                yield from src


def decode_cell(cell) -> np.ndarray:
    """An `np.save` blob (bytes-like) -> its array, a zero-copy view of the blob. ValueError if it is not
    one (bad magic or header, pickled objects, data of the wrong length)."""
    buf = memoryview(cell)
    head = io.BytesIO(bytes(buf[:4096]))  # np.save headers are 128 bytes; 4 kB is ample
    version = np.lib.format.read_magic(head)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
    else:
        raise ValueError(f"npy format version {version}")
    if dtype.hasobject:
        raise ValueError("an object (pickled) array")
    count = math.prod(shape)
    offset = head.tell()
    if len(buf) - offset != count * dtype.itemsize:
        raise ValueError(f"{len(buf) - offset} data bytes for {list(shape)} {dtype}")
    a = np.frombuffer(buf, dtype, count=count, offset=offset)
    return a.reshape(shape[::-1]).T if fortran else a.reshape(shape)


def _cell(col: pa.Array, i: int) -> pa.Buffer | None:
    """Cell `i` of a binary column as a zero-copy Arrow buffer (into the memory-mapped file), or None."""
    s = col[i]
    return s.as_buffer() if s.is_valid else None


def _sample(path: Path, key: str, cells: dict, shapes: enc.Shapes) -> dict[str, np.ndarray]:
    """One row's four cells decoded and checked: uint16 (bfloat16 bits) in this tier's shapes, C order."""
    out = {}
    for f, col in COLUMNS.items():
        cell = cells[f]
        if cell is None:
            raise UserError(f"{path}: sample {key!r}: {col} is null")
        try:
            a = decode_cell(cell)
        except (ValueError, EOFError) as e:
            raise UserError(f"{path}: sample {key!r}: {col} is not an np.save array ({_one_line(e)})") from e
        want = shapes.of(f)
        if a.dtype != np.uint16 or a.shape != want:
            raise UserError(
                f"{path}: sample {key!r}: {col} is {list(a.shape)} {a.dtype}, expected {list(want)} uint16 "
                "(bfloat16 bits): encodings of other shapes than this tier's (see --tier)"
            )
        out[f] = np.ascontiguousarray(a)
    return out


def _keys(path: Path, col: pa.Array) -> list[str]:
    keys = col.to_pylist()
    for i, k in enumerate(keys):
        if not k or k.split() != [k]:
            before = f" (after {keys[i - 1]!r})" if i else ""
            raise UserError(
                f"{path}: sample key {k!r}{before} is empty or has whitespace: keys.txt cannot hold it"
            )
    return keys


def _timesteps(path: Path, keys: list[str], col: pa.Array | None) -> np.ndarray:
    """The batch's stored timesteps, -1 where null; values outside 0..7 name their sample."""
    if col is None or pa.types.is_null(col.type):
        return np.full(len(keys), -1, np.int64)
    ts = pc.fill_null(col.cast(pa.int64()), -1).to_numpy()
    bad = np.flatnonzero(
        (ts < -1) | (ts >= enc.TIMESTEP_DIVISOR) | ((ts == -1) & col.is_valid().to_numpy(False))
    )
    if len(bad):
        i = int(bad[0])
        raise UserError(
            f"{path}: sample {keys[i]!r}: timestep {ts[i]} is outside 0..{enc.TIMESTEP_DIVISOR - 1} "
            f"(the eval timestep index, t = timestep / {enc.TIMESTEP_DIVISOR})"
        )
    return ts


# ------------------------------------------------------------------------------------------------ importing


def import_split(parts: list[Part], split: str, shapes: enc.Shapes, out: Path, tier: str = "") -> dict:
    """Stream `parts` into `out/<split>` (data/flux_encodings.py layout). Returns the summary the CLI prints."""
    readers = [_Reader(p) for p in parts]  # every schema checked before anything is read
    line = LiveLine()
    try:
        return _stream(readers, split, shapes, Path(out), tier, line)
    finally:
        line.close()


def _stream(
    readers: list[_Reader], split: str, shapes: enc.Shapes, out: Path, tier: str, line: LiveLine
) -> dict:
    parts = [r.part for r in readers]
    counts = []
    for r in readers:
        line.update(f"flux import {split}: counting rows, {r.part.path.name}")
        counts.append(r.rows())
    n = sum(counts)
    if n == 0:
        raise UserError(f"--src: {len(parts)} file(s) with no rows ({parts[0].path}): the download is empty")
    stored = np.empty(n, np.int64)  # 8 bytes a sample: 9 MB for CC12M
    null_key = set_key = None
    start, done, nbytes = time.monotonic(), 0, 0
    with enc.SplitStream(out, split, n, shapes) as stream:
        for r in readers:
            path = r.part.path
            for batch in r.batches():
                keys = _keys(path, batch.column(KEY))
                cols = {f: batch.column(c) for f, c in COLUMNS.items()}
                ts_col = batch.column(TIMESTEP) if TIMESTEP in batch.schema.names else None
                ts = _timesteps(path, keys, ts_col)
                if done + len(keys) > n:
                    raise UserError(
                        f"{path}: more rows than counted: did the files change during the import?"
                    )
                for i, key in enumerate(keys):
                    arrays = _sample(path, key, {f: _cell(c, i) for f, c in cols.items()}, shapes)
                    stream.add(key, arrays)
                    nbytes += sum(a.nbytes for a in arrays.values())
                stored[done : done + len(keys)] = ts
                if null_key is None and (ts < 0).any():
                    null_key = (path, keys[int(np.flatnonzero(ts < 0)[0])])
                if set_key is None and (ts >= 0).any():
                    set_key = (path, keys[int(np.flatnonzero(ts >= 0)[0])])
                if null_key and set_key:
                    a, b = (null_key, set_key)
                    raise UserError(
                        f"{a[0]}: sample {a[1]!r} has no timestep while {b[1]!r} ({b[0].name}) has one: a split "
                        "either fixes every sample's eval timestep (COCO validation) or none (training)"
                    )
                done += len(keys)
                secs = max(time.monotonic() - start, 1e-9)
                line.update(
                    f"flux import {split}: {done:,} / {n:,} samples ({100 * done / n:.1f}%), "
                    f"{nbytes / 1e9:,.1f} GB, {done / secs:,.0f} samples/s"
                )
        timesteps = stored if set_key else None
        meta = {
            "split": split,
            "source_format": SOURCE_FORMAT,
            "sources": [str(p.path) for p in parts],
            "tier": tier,
        }
        stream.finish(meta, timesteps)
    man = json.loads(
        fileio.read_bounded(out / split / "manifest.json", fileio.SMALL_FILE, "manifest").decode()
    )
    return {"samples": n, "files": len(parts), "bytes": nbytes, "timesteps": man.get("timesteps")}


def find_empty(src: str, given: str | None) -> Path | None:
    """MLCommons' empty_encodings/ folder: --empty-encodings, else beside or inside the first --src path."""
    if given:
        d = Path(given)
        if not d.is_dir():
            raise UserError(f"--empty-encodings {d} is not a folder: give MLCommons' empty_encodings/")
        return d
    first = Path(src.split(",")[0].strip())
    base = first if first.is_dir() else first.parent
    for d in (base / enc.EMPTY_DIR, base.parent / enc.EMPTY_DIR):
        if d.is_dir():
            return d
    return None


def import_empty(d: Path, shapes: enc.Shapes, out: Path) -> str:
    """Copy MLCommons' empty-prompt encodings (with or without the batch dim) into `out`; returns the dtype."""
    t5, clip, dtype = enc.read_empty_arrays(d, shapes)
    enc.write_empty(out, t5, clip, dtype)
    return dtype
