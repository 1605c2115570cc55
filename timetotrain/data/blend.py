"""Several training files drawn by weight, as megatron-core 0.16.1's ``BlendedDataset`` draws them.

What is matched (``BlendedMegatronDatasetBuilder`` with client weights and a client sample count ``n``):

* Weights are normalised to sum to 1 (float64, ``w / sum(w)``).
* File ``i`` is built as a ``GPTDataset`` of ``ceil(ceil(n * w_i) * 1.005)`` samples (the 0.5% mid-level
  surplus), every file with the same seed; the blend holds ``sum(ceil(n * w_i))`` samples.
* Sample ``k`` of the blend comes from the file with the largest error ``w_i * max(k, 1) - taken_i``
  (first file on ties; the C++ ``build_blending_indices``), and is that file's next unused sample.

With equal weights that greedy rule alternates the files in order, which is computed in closed form; other
weights run the rule itself, once per sample, when the data is opened (a few seconds per million samples).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from timetotrain.data.gpt_dataset import GPTWindows

SURPLUS = 0.005  # megatron-core's BlendedMegatronDatasetConfig.mid_level_dataset_surplus


def normalize(weights) -> list[float]:
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def blend_sizes(weights: list[float], n: int, surplus: float = SURPLUS) -> list[int]:
    """Samples asked of each file for a blend of `n` (normalised `weights`); surplus 0 gives the blend's
    share of each file."""
    return [int(math.ceil(math.ceil(n * w) * (1 + surplus))) for w in weights]


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(file of each blended sample (int16), its sample number within that file (int64))."""
    k = len(weights)
    if len(set(weights)) == 1:
        # Equal weights: the error of file i at step s is s/k - taken_i, so the files take turns in order.
        idx = np.arange(size, dtype=np.int64)
        return (idx % k).astype(np.int16), idx // k
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    taken = [0] * k
    for s in range(size):
        x = float(max(s, 1))
        best, best_err = 0, weights[0] * x - taken[0]
        for i in range(1, k):
            err = weights[i] * x - taken[i]
            if err > best_err:
                best, best_err = i, err
        dataset_index[s] = best
        sample_index[s] = taken[best]
        taken[best] += 1
    return dataset_index, sample_index


class BlendedWindows:
    """Windows of several `GPTWindows` blended by weight; the interface of `GPTWindows` the loader uses."""

    def __init__(self, parts: list[GPTWindows], weights: list[float], size: int):
        if len(parts) != len(weights) or not parts:
            raise ValueError("one weight per part, at least one part")
        lengths = {p.seq_length for p in parts}
        if len(lengths) != 1:
            raise ValueError(f"blended parts have different window lengths {sorted(lengths)}")
        self.parts = parts
        self.seq_length = lengths.pop()
        self.dataset_index, self.dataset_sample_index = blending_indices(weights, size)
        for i, part in enumerate(parts):
            used = self.dataset_sample_index[self.dataset_index == i]
            if used.size and int(used.max()) >= len(part):
                raise ValueError(f"the blend needs more than the {len(part)} windows of part {i}")

    def __len__(self) -> int:
        return int(self.dataset_index.size)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.parts[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def batch(self, indices) -> torch.Tensor:
        """``LongTensor [len(indices), seq_length + 1]``: each part fills its rows in one call."""
        idx = np.asarray(list(indices), dtype=np.int64)
        out = torch.empty((idx.size, self.seq_length + 1), dtype=torch.int64)
        which = self.dataset_index[idx]
        for i, part in enumerate(self.parts):
            rows = np.flatnonzero(which == i)
            if rows.size:
                out[torch.from_numpy(rows)] = part.batch(self.dataset_sample_index[idx[rows]])
        return out
