"""A tier's training and validation token streams: locate, verify (preflight), then open (after run_start)."""

from __future__ import annotations

import math
import os
import queue
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from timetotrain.data import npy
from timetotrain.data.blend import BlendedWindows, blend_sizes, normalize
from timetotrain.data.gpt_dataset import GPTWindows
from timetotrain.data.indexed import IndexedDataError, IndexedDataset
from timetotrain.data.manifest import REPREPARE, read_manifest, verify_manifest
from timetotrain.errors import UserError

_SUFFIX = "_text_document"


@dataclass(frozen=True)
class ResolvedData:
    train_prefix: Path
    val_prefix: Path
    counts_file: Path | None  # training-split token histogram, for vocabulary narrowing
    # A blended training split (LMData.train_blend): every file with its weight; train_prefix is the first.
    train_blend: tuple[tuple[Path, float], ...] = ()

    @property
    def train_prefixes(self) -> list[Path]:
        return [p for p, _ in self.train_blend] or [self.train_prefix]

    def files(self) -> list[Path]:
        prefixes = (*self.train_prefixes, self.val_prefix)
        out = [Path(f"{p}{ext}") for p in prefixes for ext in (".bin", ".idx")]
        return out + ([self.counts_file] if self.counts_file else [])


def _find(data_dir: Path, prefixes: tuple[str, ...], split: str) -> Path:
    for name in prefixes:
        if Path(data_dir, name + ".idx").exists() or Path(data_dir, name + ".bin").exists():
            return data_dir / name
    raise UserError(
        f"--data {data_dir} has no {split} split (looked for {' or '.join(p + '.idx' for p in prefixes)}): "
        f"run `ttt data prepare c4 --src <c4/en> --split {split} --out {data_dir}`"
    )


def resolve(
    data, data_dir: Path, verify: bool = True, vocab_size: int | None = None, eval_samples: int | None = None
) -> ResolvedData:
    """Preflight: every file present, checksums match the manifest, tokenizer as the tier expects,
    index headers consistent with the token files, both splits non-empty (the validation split holding
    `eval_samples` windows), and every token id inside the vocabulary the model sees (`vocab_size`, or the
    narrowing table of `vocab_keep`). Reads metadata, hashes and at most a bounded sample of tokens."""
    if not data_dir.is_dir():
        what = "is a file, not a folder" if data_dir.exists() else "does not exist"
        raise UserError(f"--data {data_dir} {what}: pass the folder written by `ttt data prepare c4`")
    blend = tuple((_find(data_dir, names, "train"), w) for names, w in data.train_blend)
    train = blend[0][0] if blend else _find(data_dir, data.train_prefixes, "train")
    val = _find(data_dir, data.val_prefixes, "validation")
    counts = None
    opened = {}
    vouched = set()  # prefixes whose token-count file the manifest lists (its size and sha256 checked)
    for prefix in (*(p for p, _ in blend[1:]), train, val):
        name = prefix.name.removesuffix(_SUFFIX)
        manifest = read_manifest(data_dir, name)
        if manifest is not None and _counts_file(prefix).name in manifest["files"]:
            vouched.add(prefix)
        if manifest is None:
            warnings.warn(
                f"{data_dir}/{name}.manifest.json not found: checksums of {prefix.name} not verified",
                stacklevel=2,
            )
        else:
            tok = manifest["tokenizer"]
            if tok["name"] != data.tokenizer:
                raise UserError(
                    f"{prefix}: prepared with tokenizer {tok['name']!r}, this tier needs {data.tokenizer!r}: "
                    f"prepare it again with `ttt data prepare c4 --tokenizer {data.tokenizer}` into a new --out"
                )
            if verify:
                verify_manifest(data_dir, manifest)
        try:
            opened[prefix] = IndexedDataset(prefix)
        except IndexedDataError as e:
            raise UserError(str(e)) from e
    for prefix, _ in blend[1:]:
        _check_sizes(opened[prefix], opened[val], data.seq_len, eval_samples)
    _check_sizes(opened[train], opened[val], data.seq_len, eval_samples)
    limit, what = vocab_size, f"the model's vocabulary of {vocab_size:,}" if vocab_size else ""
    if data.vocab_keep is not None:
        counts = _counts_file(train)
        if not counts.is_file():
            raise UserError(
                f"{counts} is missing (this tier narrows the vocabulary by training-split frequency): "
                f"{REPREPARE}"
            )
        # Narrowed: raw ids index the old->new table, whose size is the counts file's, not the model's.
        limit = _load_counts(counts).size
        what = f"the {limit:,} ids {counts.name} counts (this tier maps them to {data.vocab_keep + 1:,})"
    if counts is not None and train not in vouched:
        # No manifest vouches for the table's source: a counts file left from another prepare would map
        # ids it never counted. It must at least count this split's tokens.
        total = int(_load_counts(counts).sum())
        if total != opened[train].num_tokens:
            raise UserError(
                f"{counts} counts {total:,} tokens, {Path(opened[train].bin_path).name} holds "
                f"{opened[train].num_tokens:,}, and no manifest vouches for it: it is from another prepare; "
                f"{REPREPARE}"
            )
    if limit is not None:
        for prefix, ds in opened.items():
            # A counts file only a verified manifest vouches for is exact; any other is not trusted over
            # the tokens themselves (a bounded scan, see `max_token_id`).
            _check_ids(ds, _counts_file(prefix) if prefix in vouched else None, limit, what)
    return ResolvedData(train, val, counts, blend)


def _counts_file(prefix: Path) -> Path:
    return prefix.parent / f"{prefix.name.removesuffix(_SUFFIX)}_token_counts.npy"


def _load_counts(path: Path) -> np.ndarray:
    try:
        counts = npy.load_small(path, "token counts")
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"{path} is not a token-count array ({e}): {REPREPARE}") from e
    if counts.ndim != 1 or counts.dtype.kind not in "iu" or counts.size == 0:
        raise UserError(f"{path} is not a token-count array ({counts.dtype} {counts.shape}): {REPREPARE}")
    return counts


def _check_sizes(train: IndexedDataset, val: IndexedDataset, seq_len: int, eval_samples: int | None) -> None:
    """Empty or too-small splits fail here, not after run_start when the windows are built."""
    window = seq_len + 1
    for ds, split in ((train, "train"), (val, "validation")):
        if ds.num_tokens == 0:
            raise UserError(
                f"{ds.bin_path} holds no tokens ({ds.num_documents} documents): the {split} split is empty; "
                f"prepare it from a source with documents, into a new --out"
            )
    if train.num_tokens < window:
        raise UserError(
            f"{train.bin_path} holds {train.num_tokens} tokens, less than one training window of {window}: "
            "prepare more training documents"
        )
    if eval_samples is not None and (val.num_tokens - 1) // seq_len < eval_samples:
        raise UserError(
            f"{val.bin_path} holds {val.num_tokens:,} tokens, fewer than the {eval_samples} validation "
            f"windows of {window} tokens this tier evaluates: prepare more validation documents"
        )


_SCAN_TOKENS = 1 << 24  # without a counts file, the ids checked per split (64 evenly spread chunks)
_SCAN_CHUNKS = 64


def max_token_id(ds: IndexedDataset, counts_file: Path | None = None) -> tuple[int, int, str]:
    """(smallest, largest) token id of `ds` and how they were found: from the split's token-count file when
    there is one (exact, no token read), else from a bounded scan (exact for files up to 16 M tokens; for
    larger ones evenly spread chunks: it catches data tokenized with another vocabulary, whose large ids
    are everywhere, not a single corrupt id)."""
    if counts_file is not None and counts_file.is_file():
        nonzero = np.flatnonzero(_load_counts(counts_file))
        hi = int(nonzero[-1]) if nonzero.size else -1
        return (int(nonzero[0]) if nonzero.size else 0), hi, counts_file.name
    n = ds.num_tokens
    if n <= _SCAN_TOKENS:
        spans = [(0, n)]
    else:
        size = _SCAN_TOKENS // _SCAN_CHUNKS
        starts = np.linspace(0, n - size, _SCAN_CHUNKS).astype(np.int64)
        spans = [(int(s), int(s) + size) for s in starts]
    lo, hi = None, None
    for a, b in spans:
        piece = ds.tokens[a:b]
        lo = int(piece.min()) if lo is None else min(lo, int(piece.min()))
        hi = int(piece.max()) if hi is None else max(hi, int(piece.max()))
    scanned = sum(b - a for a, b in spans)
    return lo, hi, ("all its tokens" if scanned == n else f"a scan of {scanned:,} of its {n:,} tokens")


def _check_ids(ds: IndexedDataset, counts_file: Path | None, limit: int, what: str) -> None:
    info = np.iinfo(ds.dtype)
    if info.min >= 0 and info.max < limit:
        return  # the file's dtype cannot hold an id that large
    lo, hi, how = max_token_id(ds, counts_file)
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise UserError(
            f"{ds.bin_path} has token id {bad:,} (from {how}), outside {what}: it was tokenized with another "
            "vocabulary; prepare it with this tier's tokenizer into a new --out"
        )


def drop_page_cache(files: list[Path]) -> bool:
    """MLPerf `cache_clear`: evict the dataset from the page cache so every run reads from storage."""
    ok = True
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            ok = False
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            ok = False
        finally:
            os.close(fd)
    return ok


def vocab_table(counts_file: Path, keep: int) -> torch.Tensor:
    """Old id -> new id: the `keep` most frequent training ids by rank (ties: lower id first), others -> keep."""
    counts = npy.load_small(counts_file, "token counts")
    order = np.argsort(-counts, kind="stable")[:keep]
    table = np.full(counts.size, keep, dtype=np.int64)
    table[order] = np.arange(keep)
    return torch.from_numpy(table)


class TokenSource:
    """Global batches of `gbs` windows in step order, of which this rank reads the `local` from `offset` on
    (its share, which the harness computes: `spec.task.Share`); by default the whole batch."""

    def __init__(
        self,
        windows: GPTWindows,
        gbs: int,
        table: torch.Tensor | None,
        local: int | None = None,
        offset: int = 0,
    ):
        self.windows, self.gbs, self.table = windows, gbs, table
        self.local = gbs if local is None else local
        self.offset = offset

    def batch(self, step: int) -> torch.Tensor:
        start = step * self.gbs + self.offset
        try:
            tokens = self.windows.batch(np.arange(start, start + self.local))
        except IndexedDataError as e:  # the data changed under the run: one line, the run aborts
            raise UserError(f"training data: {e}") from e
        return self.table[tokens] if self.table is not None else tokens


class Prefetcher:
    """Fetches step n+1's batch (a dict of tensors, from `source.batch(step)`) on a thread and copies it to
    the device without blocking the host."""

    def __init__(self, source, first_step: int, device: torch.device, depth: int = 2):
        self.source, self.device = source, device
        self.pin = device.type == "cuda"
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._step = first_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._thread.start()

    def _work(self):
        step = self._step
        while not self._stop.is_set():
            try:
                batch = self.source.batch(step)
                if self.pin:
                    batch = {k: v.pin_memory() for k, v in batch.items()}
            except Exception as e:  # surfaced on the consumer's thread
                self._q.put(e)
                return
            self._q.put(batch)
            step += 1

    def next(self) -> dict[str, torch.Tensor]:
        item = self._q.get()
        if isinstance(item, Exception):
            raise item
        return {k: v.to(self.device, non_blocking=True) for k, v in item.items()}

    def close(self):
        self._stop.set()
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass


def reference_num_samples(train_samples: int) -> int:
    """The sample count megatron's blended builder asks GPTDataset for. The references pass the training
    file as a one-entry weighted blend (weight 10 -> 1.0), and the builder pads each request by 0.5%:
    ceil(ceil(n * 1.0) * 1.005). The count sets the number of epochs and so the shuffle; using it gives the
    reference's exact windows for a given seed."""
    return math.ceil(train_samples * 1.005)


def open_train(res: ResolvedData, seq_len: int, train_samples: int, seed: int):
    """The training windows: one file as a one-entry blend (`reference_num_samples`), or several blended by
    weight as megatron-core's BlendedDataset does, each file's GPTDataset drawn with the same seed."""
    if not res.train_blend:
        n = reference_num_samples(train_samples)
        return GPTWindows(IndexedDataset(res.train_prefix), seq_len, n, seed, shuffle=True)
    weights = normalize([w for _, w in res.train_blend])
    built = blend_sizes(weights, train_samples)
    parts = [
        GPTWindows(IndexedDataset(prefix), seq_len, n, seed, shuffle=True)
        for (prefix, _), n in zip(res.train_blend, built, strict=True)
    ]
    return BlendedWindows(parts, weights, sum(blend_sizes(weights, train_samples, surplus=0.0)))


def open_val_shuffled(res: ResolvedData, seq_len: int, num_samples: int, seed: int) -> GPTWindows:
    """The validation file as megatron-core's GPTDataset builds it for the validation split: shuffled with the
    run's seed, `num_samples` asked for, megatron's `len` (data/cyclic_sampler.py reads all of it)."""
    return GPTWindows(
        IndexedDataset(res.val_prefix), seq_len, num_samples, seed, shuffle=True, megatron_len=True
    )


def open_val(res: ResolvedData, seq_len: int, num_samples: int) -> GPTWindows:
    try:
        return GPTWindows(IndexedDataset(res.val_prefix), seq_len, num_samples, seed=None, shuffle=False)
    except ValueError as e:
        raise UserError(
            f"{res.val_prefix}: fewer than {num_samples} validation windows of {seq_len + 1} tokens ({e}): "
            "prepare more validation documents"
        ) from e
