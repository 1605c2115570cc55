"""Fixed-length token windows over an indexed token file, with Megatron ``GPTDataset`` semantics.

What is matched (megatron-core 0.16.1, ``GPTDataset`` over all sequences of one file, i.e. a split
of ``"1,0,0"`` / ``indices = arange(len(file))``, ``add_extra_token_to_sequence=True``,
train split so ``drop_last_partial_sequence=True``; the reset/eod-mask options only touch masks
and position ids, which are not produced here):

* Epochs: the fewest ``E >= 1`` with ``E * T >= num_samples * L + 1`` (T tokens in the file, L the
  sequence length).
* ``separate_final_epoch`` when ``E > 1`` and the last epoch contributes fewer than
  ``int(0.8 * ((T - 1) // L))`` of the requested samples.
* One ``numpy.random.RandomState(seed)`` drawn in megatron's order: shuffle of the int32 document
  index (``E`` tiled copies of the sequence ids; with a separate final epoch, first the ``E - 1``
  copies and then the last one), then the shuffle index (uint32, int64 past 2**32 - 2; with a
  separate final epoch, ``[0, n_sans_final)`` and the rest shuffled independently).
* The sample index of the C++ ``build_sample_idx``: sample ``k`` is tokens
  ``[k * L, k * L + L + 1)`` of the documents concatenated in document-index order, so windows
  overlap by one token and cross document boundaries; there are ``(E * T - 1) // L`` of them and
  the boundary of each is stored as (document-index position, offset) of the document that holds
  the token, exactly the pairs (and integer width) megatron stores. It is computed with vectorised
  cumulative sums over chunks of the document index instead of a per-token loop.
* Window ``i`` is sample ``shuffle_index[i]``; ``__len__`` is the requested ``num_samples``, which
  is the prefix a megatron training loop consumes (megatron's own ``len`` also counts the samples
  the last epoch happens to complete).

``num_samples`` is what megatron hands the ``GPTDataset``. A weighted blend, even of a single file
(the llama31_8b reference uses weight 10 on one file), reaches it through ``BlendedDataset``,
which asks for ``ceil(ceil(n * w) * 1.005)`` samples (``w`` the normalised weight, 1.0 here) and then reads them in order; callers
reproducing that path must pass the inflated count, since it can change the epoch count.

Validation (``shuffle=False``) follows the MLPerf rule rather than stock megatron: the first
``num_samples`` windows of the file in document order, one epoch, no randomness. Asking for more
windows than the file holds is an error rather than a wrap into a second epoch.

No index is cached on disk; everything is rebuilt in memory from the ``.idx``. At the reference
scale (19.2 M windows of 8,193 tokens, ~45 M documents, 8 epochs) that takes ~30 s, of which
~20 s is the ``RandomState`` shuffle of the 360 M-entry document index that megatron does too and
that cannot be vectorised without changing the order; the sample index itself takes ~6 s.
"""

from __future__ import annotations

import numpy as np
import torch

from .indexed import IndexedDataset

__all__ = ["GPTWindows", "build_document_index", "build_sample_index", "build_shuffle_index"]

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
_CHUNK = 1 << 22


def build_document_index(
    num_sequences: int, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """Megatron's epoch-tiled, shuffled document index (int32), drawing from ``rng`` in its order."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.arange(num_sequences, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(num_sequences, num_epochs - 1, rng, False)
    last = build_document_index(num_sequences, 1, rng, False)
    return np.concatenate((first, last))


def build_shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``[0, total)`` that keeps ``[0, num_first)`` ahead of the rest (Megatron's)."""
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    rest = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(rest)
    return np.concatenate((first, rest))


def build_sample_index(
    sizes: np.ndarray, document_index: np.ndarray | None, seq_length: int, num_samples: int
) -> np.ndarray:
    """``[num_samples + 1, 2]`` array of (document-index position, token offset) per window start.

    Window ``k`` starts at stream position ``k * seq_length``; its boundary is the document that
    contains that token (empty documents never contain one), except boundary 0, which megatron
    pins to ``(0, 0)``. ``document_index=None`` means the file order. The integer width follows
    megatron: int32 unless the document index or a document length does not fit.
    """
    n_positions = len(sizes) if document_index is None else len(document_index)
    max_size = int(sizes.max()) if len(sizes) else 0
    dtype = np.int32 if max(n_positions, max_size) <= np.iinfo(np.int32).max else np.int64
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[0] = 0
    k = 1  # next boundary to place
    base = 0  # stream position of the chunk's first token
    for c0 in range(0, n_positions, _CHUNK):
        if k > num_samples:
            break
        ids = slice(c0, c0 + _CHUNK) if document_index is None else document_index[c0 : c0 + _CHUNK]
        lengths = np.asarray(sizes[ids], dtype=np.int64)
        ends = np.cumsum(lengths)
        ends += base
        chunk_end = int(ends[-1])
        k_stop = min(num_samples, (chunk_end - 1) // seq_length) + 1
        if k_stop > k:
            pos = np.arange(k, k_stop, dtype=np.int64) * seq_length
            j = np.searchsorted(ends, pos, side="right")
            out[k:k_stop, 0] = j + c0
            out[k:k_stop, 1] = pos - (ends[j] - lengths[j])
            k = k_stop
        base = chunk_end
    if k != num_samples + 1:
        raise ValueError(f"the token stream ({base} tokens) is too short for {num_samples} windows")
    return out


class GPTWindows:
    """Windows of ``seq_length + 1`` tokens (inputs ``w[:-1]``, labels ``w[1:]``) over an indexed file.

    ``shuffle=True`` reproduces megatron-core's ``GPTDataset`` order for ``seed`` (see the module
    docstring); ``shuffle=False`` gives the first ``num_samples`` windows in document order.
    ``num_samples=None`` means one epoch's worth of windows. ``megatron_len=True``: ``len`` is megatron's
    (all ``total_samples`` the epochs complete) rather than the requested count.
    """

    def __init__(
        self,
        dataset: IndexedDataset,
        seq_length: int,
        num_samples: int | None,
        seed: int | None = None,
        shuffle: bool = True,
        megatron_len: bool = False,
    ) -> None:
        if seq_length < 2:
            raise ValueError(f"seq_length must be at least 2, got {seq_length}")
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be non-negative, got {num_samples}")
        if shuffle and seed is None:
            raise ValueError("a shuffled GPTWindows needs a seed")
        self.dataset = dataset
        self.seq_length = int(seq_length)
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.num_tokens_per_epoch = int(np.sum(dataset.sizes, dtype=np.int64))
        if self.num_tokens_per_epoch < 2:
            raise ValueError(
                f"{dataset.bin_path} holds {self.num_tokens_per_epoch} tokens; windows need at least 2"
            )
        if shuffle:
            self._build_shuffled(num_samples)
        else:
            self._build_in_order(num_samples)
        if megatron_len:
            # Megatron's own `len`: every sample the epochs complete, which is what a sampler over the whole
            # dataset draws from (Megatron-Bridge's cyclic validation sampler, data/cyclic_sampler.py).
            self.num_samples = self.total_samples
        self._itemsize = dataset.dtype.itemsize

    def _build_shuffled(self, num_samples: int | None) -> None:
        tokens, seq = self.num_tokens_per_epoch, self.seq_length
        if num_samples is None:
            epochs = 1
        else:
            epochs = max(1, -(-(num_samples * seq + 1) // tokens))
        separate = False
        n_sans_final = 0
        if epochs > 1:
            n_sans_final = ((epochs - 1) * tokens - 1) // seq
            per_epoch = (tokens - 1) // seq
            from_final = num_samples - n_sans_final
            separate = from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
        self.num_epochs = epochs
        self.separate_final_epoch = separate
        self.total_samples = (epochs * tokens - 1) // seq
        self.num_samples = self.total_samples if num_samples is None else int(num_samples)

        rng = np.random.RandomState(self.seed)
        self.document_index = build_document_index(len(self.dataset.sizes), epochs, rng, separate)
        # A RAM copy of the lengths: the chunked gathers below hit every entry, often repeatedly.
        sizes = np.array(self.dataset.sizes)
        self.sample_index = build_sample_index(sizes, self.document_index, seq, self.total_samples)
        first = n_sans_final if separate else self.total_samples
        self.shuffle_index = build_shuffle_index(first, self.total_samples, rng)

    def _build_in_order(self, num_samples: int | None) -> None:
        seq = self.seq_length
        available = (self.num_tokens_per_epoch - 1) // seq
        if num_samples is None:
            num_samples = available
        if num_samples > available:
            raise ValueError(
                f"{self.dataset.bin_path} holds {self.num_tokens_per_epoch} tokens, enough for {available} "
                f"windows of {seq}+1 tokens, but {num_samples} were requested"
            )
        self.num_epochs = 1
        self.separate_final_epoch = False
        self.total_samples = self.num_samples = int(num_samples)
        self.document_index = None
        self.sample_index = build_sample_index(self.dataset.sizes, None, seq, self.num_samples)
        self.shuffle_index = None

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (
            f"GPTWindows({self.dataset.prefix!r}, seq_length={self.seq_length}, num_samples={self.num_samples}, "
            f"shuffle={self.shuffle}, seed={self.seed}, epochs={self.num_epochs})"
        )

    def sample_id(self, i: int) -> int:
        """Position of window ``i`` in the unshuffled stream."""
        i = int(i)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"window {i} out of range ({self.num_samples} windows)")
        return i if self.shuffle_index is None else int(self.shuffle_index[i])

    def _fill(self, out: np.ndarray, sample: int) -> None:
        ds = self.dataset
        sizes, pointers, doc_index = ds.sizes, ds.pointers, self.document_index
        (j0, off0), (j1, off1) = self.sample_index[sample], self.sample_index[sample + 1]
        j0, off0, j1, off1 = int(j0), int(off0), int(j1), int(off1)
        filled = 0
        for j in range(j0, j1 + 1):
            doc = j if doc_index is None else int(doc_index[j])
            base = int(pointers[doc]) // self._itemsize
            start = base + (off0 if j == j0 else 0)
            stop = base + (off1 + 1 if j == j1 else int(sizes[doc]))
            n = stop - start
            # One read per piece (not through the map: IndexedDataset.read), to int64 on the way.
            out[filled : filled + n] = ds.read(start, stop)
            filled += n
        if filled != self.seq_length + 1:
            raise RuntimeError(f"window {sample} assembled {filled} tokens instead of {self.seq_length + 1}")

    def __getitem__(self, i: int) -> np.ndarray:
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        self._fill(out, self.sample_id(i))
        return out

    def batch(self, indices) -> torch.Tensor:
        """``LongTensor [len(indices), seq_length + 1]`` of the given windows."""
        idx = [int(i) for i in indices]
        # Before touching the mapped pages: a file cut short under us would otherwise be a SIGBUS.
        self.dataset.check_unchanged()
        out = np.empty((len(idx), self.seq_length + 1), dtype=np.int64)
        for row, i in enumerate(idx):
            self._fill(out[row], self.sample_id(i))
        return torch.from_numpy(out)
