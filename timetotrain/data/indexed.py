"""Megatron-compatible indexed token files (``<prefix>.bin`` + ``<prefix>.idx``).

The ``.bin`` file is the raw token ids of every sequence back to back in one numeric dtype. The
``.idx`` file (all integers little-endian) is laid out as:

====================  ======================================================================
bytes                 content
====================  ======================================================================
9                     magic ``b"MMIDIDX\\x00\\x00"``
8   (uint64)          version, always 1
1   (uint8)           dtype code (see ``_CODE_TO_DTYPE``)
8   (uint64)          S, number of sequences
8   (uint64)          D, number of entries of the document index (documents + 1)
4*S (int32)           tokens per sequence
8*S (int64)           byte offset of every sequence in the ``.bin``
8*D (int64)           document index: sequence index at which every document starts, plus S
====================  ======================================================================

This is the non-multimodal layout of megatron-core 0.16.1 (``IndexedDatasetBuilder`` /
``IndexedDataset``); multimodal files append S mode bytes, which we neither write nor accept.
Every document written here is one sequence, as megatron's ``preprocess_data`` produces
without sentence splitting, so the document index is ``0..S``.
"""

from __future__ import annotations

import array
import os
import struct
from pathlib import Path

import numpy as np

from timetotrain.data.manifest import RECOPY
from timetotrain.data.mapped import DataChangedError, MappedFiles

__all__ = ["IndexedDataError", "IndexedWriter", "IndexedDataset", "best_dtype", "DEFAULT_REMEDY"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34

# Megatron's DType enum; floats are valid codes there but never token ids, so we refuse them.
_CODE_TO_DTYPE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
_FLOAT_CODES = {6: "float64", 7: "float32"}
_DTYPE_TO_CODE = {dt: code for code, dt in _CODE_TO_DTYPE.items()}

# New files under new names, never the old ones rewritten in place: a run may have them mapped (SIGBUS).
DEFAULT_REMEDY = (
    "re-create the .bin/.idx pair under new names or in a new folder "
    "(`ttt data prepare` writes temporaries and renames them into place)"
)


class IndexedDataError(Exception):
    """A .bin/.idx pair that is missing, corrupt or inconsistent; the message is one line."""


def best_dtype(vocab_size: int | None) -> np.dtype:
    """Token dtype megatron's preprocessing picks for a vocabulary (``DType.optimal_dtype``).

    The cut-off is 65,500, not 65,536, and an unknown vocabulary gets int32: that is the rule the
    files are written with, so readers must expect int32 for vocabularies in 65,500..65,536.
    """
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _token_dtype(dtype) -> np.dtype:
    # Native order only: the format is little-endian and every supported host is too.
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise ValueError(f"token dtype {dt} must be little-endian")
    native = np.dtype(dt.name)
    if native not in _DTYPE_TO_CODE:
        supported = ", ".join(sorted(d.name for d in _DTYPE_TO_CODE))
        raise ValueError(f"unsupported token dtype {dt}; use one of {supported}")
    return native


class IndexedWriter:
    """Write ``prefix.bin``/``prefix.idx`` byte-identical to megatron's ``IndexedDatasetBuilder``.

    Data goes to temporary names next to the targets and is renamed into place only by a
    successful :meth:`close`, ``.bin`` first with any stale ``.idx`` removed beforehand: a crash
    leaves either the old pair, temporaries, or a ``.bin`` without ``.idx``, never a new-looking
    pair whose halves disagree. Leaving a ``with`` block through an exception discards the output.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32) -> None:
        self.prefix = str(prefix)
        self.dtype = _token_dtype(dtype)
        self.bin_path = self.prefix + ".bin"
        self.idx_path = self.prefix + ".idx"
        tag = f".{os.getpid()}.tmp"
        self._bin_tmp = self.bin_path + tag
        self._idx_tmp = self.idx_path + tag
        self._sizes = array.array("i")
        self._file = open(self._bin_tmp, "wb", buffering=1 << 20)
        self._closed = False
        info = np.iinfo(self.dtype)
        self._lo, self._hi = int(info.min), int(info.max)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @property
    def num_documents(self) -> int:
        return len(self._sizes)

    def _as_tokens(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D token array, got shape {arr.shape}")
        if arr.dtype == self.dtype:
            return np.ascontiguousarray(arr)
        if arr.size == 0:
            return np.empty(0, self.dtype)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        # Megatron's builder would silently wrap out-of-range ids; a wrapped id is a wrong token.
        if not np.can_cast(arr.dtype, self.dtype):
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._lo or hi > self._hi:
                raise ValueError(
                    f"token ids span [{lo}, {hi}] which does not fit {self.dtype.name} "
                    f"for {self.bin_path}; pick a wider dtype (see best_dtype)"
                )
        return arr.astype(self.dtype)

    def add_document(self, tokens) -> None:
        """Append one document (one sequence) of token ids."""
        self._check_open()
        arr = self._as_tokens(tokens)
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError("a document longer than 2**31-1 tokens cannot be indexed")
        self._file.write(memoryview(arr).cast("B"))
        self._sizes.append(arr.size)

    def add_documents(self, tokens, lengths) -> None:
        """Append many documents at once: ``tokens`` is their concatenation, ``lengths`` their sizes."""
        self._check_open()
        arr = self._as_tokens(tokens)
        lens = np.asarray(lengths, dtype=np.int64)
        if lens.ndim != 1 or (lens.size and lens.min() < 0) or int(lens.sum()) != arr.size:
            raise ValueError("lengths must be non-negative and sum to the number of tokens")
        if lens.size and lens.max() > np.iinfo(np.int32).max:
            raise ValueError("a document longer than 2**31-1 tokens cannot be indexed")
        self._file.write(memoryview(arr).cast("B"))
        self._sizes.frombytes(lens.astype(np.int32).tobytes())

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"IndexedWriter for {self.prefix} is already closed")

    def _write_index(self, f) -> None:
        sizes = np.frombuffer(self._sizes, dtype=np.int32) if len(self._sizes) else np.empty(0, np.int32)
        n = sizes.size
        f.write(MAGIC)
        f.write(struct.pack("<QBQQ", VERSION, _DTYPE_TO_CODE[self.dtype], n, n + 1))
        f.write(sizes)
        pointers = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        f.write(pointers)
        del pointers
        f.write(np.arange(n + 1, dtype=np.int64))

    def close(self) -> None:
        """Finish both files and move them into place."""
        if self._closed:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            with open(self._idx_tmp, "wb") as f:
                self._write_index(f)
                f.flush()
                os.fsync(f.fileno())
            if os.path.lexists(self.idx_path):
                os.remove(self.idx_path)
            os.replace(self._bin_tmp, self.bin_path)
            os.replace(self._idx_tmp, self.idx_path)
        except BaseException:
            self.abort()
            raise
        self._closed = True

    def abort(self) -> None:
        """Discard everything written so far; the targets are left untouched."""
        self._closed = True
        if not self._file.closed:
            self._file.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)


class IndexedDataset:
    """Memory-mapped reader for a ``prefix.bin``/``prefix.idx`` pair.

    Opening maps both files without reading the ``.bin``; it checks the header, the exact
    ``.idx`` size, the document index end points, that the last pointer agrees with the summed
    sequence lengths and that the ``.bin`` holds exactly that many tokens. Only the lengths table
    (4 bytes a sequence) is read in full. ``verify=True`` adds a pass over every pointer and the
    whole document index (non-negative lengths, contiguous pointers, monotone). ``remedy`` is the
    fix that error messages suggest.
    """

    def __init__(
        self, prefix: str | os.PathLike, *, verify: bool = False, remedy: str = DEFAULT_REMEDY
    ) -> None:
        self.prefix = str(prefix)
        self.remedy = remedy
        self.idx_path = self.prefix + ".idx"
        self.bin_path = self.prefix + ".bin"
        self._watched = MappedFiles()  # the mapped files, kept open and checked for changes under a run
        self._open(verify)

    def _fail(self, path: str, problem: str) -> IndexedDataError:
        return IndexedDataError(f"{path} {problem}: {self.remedy}")

    def _open(self, verify: bool) -> None:
        idx_path, bin_path = self.idx_path, self.bin_path
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise self._fail(path, "is missing")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[: len(MAGIC)] != MAGIC:
            if len(header) < len(MAGIC) and MAGIC.startswith(header):
                raise self._fail(
                    idx_path, f"is truncated (expected at least {HEADER_SIZE} bytes, found {idx_size})"
                )
            raise self._fail(idx_path, "is not a Megatron index (bad magic)")
        if len(header) < HEADER_SIZE:
            raise self._fail(
                idx_path, f"is truncated (expected at least {HEADER_SIZE} bytes, found {idx_size})"
            )
        (version,) = struct.unpack_from("<Q", header, 9)
        if version != VERSION:
            raise self._fail(idx_path, f"has unsupported index version {version} (expected {VERSION})")
        code = header[17]
        if code not in _CODE_TO_DTYPE:
            what = f"{_FLOAT_CODES[code]} tokens" if code in _FLOAT_CODES else f"dtype code {code}"
            raise self._fail(idx_path, f"has unsupported {what}")
        self.dtype = _CODE_TO_DTYPE[code]
        n_seq, n_doc = struct.unpack_from("<QQ", header, 18)
        expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc
        if idx_size != expected:
            state = "is truncated" if idx_size < expected else "is oversized"
            raise self._fail(idx_path, f"{state} (expected {expected} bytes, found {idx_size})")
        if n_doc < 1:
            raise self._fail(idx_path, "has an empty document index")

        mm = np.memmap(self._keep_open(idx_path), dtype=np.uint8, mode="r")
        self._idx_mmap = mm
        self.sizes = np.frombuffer(mm, dtype="<i4", count=n_seq, offset=HEADER_SIZE)
        self.pointers = np.frombuffer(mm, dtype="<i8", count=n_seq, offset=HEADER_SIZE + 4 * n_seq)
        self.document_indices = np.frombuffer(mm, dtype="<i8", count=n_doc, offset=HEADER_SIZE + 12 * n_seq)
        if self.document_indices[0] != 0 or self.document_indices[-1] != n_seq:
            raise self._fail(
                idx_path,
                f"has an inconsistent document index (starts at {self.document_indices[0]}, "
                f"ends at {self.document_indices[-1]}, {n_seq} sequences)",
            )

        # Summing the lengths reads only the .idx (4 bytes a sequence) and pins the .bin size
        # independently of the pointers, so a bad last pointer is blamed on the right file.
        itemsize = self.dtype.itemsize
        total = int(self.sizes.sum(dtype=np.int64))
        if n_seq:
            last = int(self.pointers[-1])
            if self.pointers[0] != 0 or last != (total - int(self.sizes[-1])) * itemsize:
                raise self._fail(idx_path, "has sequence pointers that disagree with the sequence lengths")
        bin_expected = total * itemsize
        bin_size = os.path.getsize(bin_path)
        if bin_size != bin_expected:
            state = "is truncated" if bin_size < bin_expected else "is larger than its index says"
            raise self._fail(bin_path, f"{state} (expected {bin_expected} bytes, found {bin_size})")
        if verify:
            self._verify()

        # numpy refuses to map an empty file.
        self._bin = self._keep_open(bin_path) if bin_size else None
        if bin_size:
            self.tokens = np.memmap(self._bin, dtype=self.dtype, mode="r")
        else:
            self.tokens = np.empty(0, self.dtype)

    def _keep_open(self, path: str):
        """Open `path` for mapping, watched: the map is made from this very file object."""
        return self._watched.watch(path)

    def check_unchanged(self) -> None:
        """Raise IndexedDataError if a mapped file was truncated or rewritten in place since it was opened
        (data/mapped.py says why: SIGBUS or mixed tokens otherwise). One fstat per file before each batch."""
        try:
            self._watched.check_unchanged()
        except DataChangedError as e:
            raise IndexedDataError(str(e)) from e

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `start:stop` of the whole token stream (file dtype), read from the file (pread), not
        through the map: the timed run's reads (data/gpt_dataset.py). A file cut short under the run gives
        a short read, which raises the one-line IndexedDataError, where touching the map past the new end
        is a SIGBUS that kills the process with no log line; `check_unchanged` before each batch cannot
        close that gap, a cut can land between the check and the reads."""
        itemsize = self.dtype.itemsize
        want = (stop - start) * itemsize
        data = os.pread(self._bin.fileno(), want, start * itemsize) if want else b""
        if len(data) != want:
            self.check_unchanged()  # names how the file changed
            raise IndexedDataError(f"{self.bin_path} ended early while this run was reading it: {RECOPY}")
        return np.frombuffer(data, dtype=self.dtype)

    def _verify(self, chunk: int = 1 << 22) -> None:
        itemsize = self.dtype.itemsize
        expect_next = 0
        for start in range(0, len(self.sizes), chunk):
            sizes = self.sizes[start : start + chunk].astype(np.int64)
            if sizes.size and sizes.min() < 0:
                raise self._fail(self.idx_path, "has negative sequence lengths")
            ends = np.cumsum(sizes) * itemsize + expect_next
            starts = np.concatenate(([expect_next], ends[:-1]))
            if not np.array_equal(starts, self.pointers[start : start + chunk]):
                raise self._fail(
                    self.idx_path, "has sequence pointers that disagree with the sequence lengths"
                )
            expect_next = int(ends[-1]) if ends.size else expect_next
        if np.any(np.diff(self.document_indices) < 0):
            raise self._fail(self.idx_path, "has a non-monotone document index")

    def __getstate__(self) -> dict:
        # Re-map in the receiving process instead of pickling the mapped bytes.
        return {"prefix": self.prefix, "remedy": self.remedy}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"], remedy=state["remedy"])

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype.name})"

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx`` as a read-only view (file dtype)."""
        idx = int(idx)
        n = len(self.sizes)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {self.prefix} ({n} sequences)")
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of length {size}"
            )
        start = int(self.pointers[idx]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    @staticmethod
    def exists(prefix: str | os.PathLike) -> bool:
        p = Path(str(prefix))
        return Path(f"{p}.idx").is_file() and Path(f"{p}.bin").is_file()
