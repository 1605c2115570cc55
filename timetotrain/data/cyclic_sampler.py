"""Which validation windows each evaluation reads under Megatron-Bridge's validation loader (deepseekv3_671b).

Megatron-Bridge v0.3.0 (the reference container's) builds the validation loader of a `GPTDatasetConfig` as
"cyclic" whatever the config says (`data/loaders.py` lines 232 and 336) and iterates it once for the whole
run, so every `evaluate()` call takes the next `eval_iters` batches from where the previous one stopped.
"cyclic" is `MegatronPretrainingRandomSampler` (`data/samplers.py` lines 348-438) with `data_sharding=True`
(the `DataloaderConfig` default): data-parallel rank r owns the contiguous bucket
[r * B, (r + 1) * B) of the dataset, B = (len // (mbs * dp)) * mbs, and reads it in the order of
`torch.randperm(B, generator=torch.Generator().manual_seed(epoch))`, the epoch counting the times the
buckets were used up (0 for the first pass, then 1, ...). The dataset underneath is the seed-shuffled
validation `GPTDataset` (data/gpt_dataset.py) of `(train_iters // eval_interval + 1) * eval_iters * GBS`
samples (`get_train_valid_test_num_samples`, `data/loaders.py` line 128), its `len` megatron's.
"""

from __future__ import annotations

import numpy as np
import torch


def reference_val_samples(max_steps: int, eval_interval: int, gbs: int, eval_iters: int = 1) -> int:
    """The validation sample count Megatron-Bridge asks the GPTDataset for (`get_train_valid_test_num_samples`:
    the training GBS, not the eval batch size)."""
    return (max_steps // eval_interval + 1) * eval_iters * gbs


class CyclicDraw:
    """Dataset indices of one data-parallel rank's validation stream: position p of the stream is the p-th
    index the sampler yields to this rank over the whole run."""

    def __init__(self, length: int, micro_batch: int, rank: int, world: int):
        self.bucket = (length // (micro_batch * world)) * micro_batch
        if self.bucket <= 0:
            raise ValueError(
                f"{length} validation windows cannot fill one micro-batch of {micro_batch} per rank"
            )
        self.start = rank * self.bucket
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            g = torch.Generator()
            g.manual_seed(epoch)
            self._perms = {epoch: torch.randperm(self.bucket, generator=g).numpy()}  # one epoch at a time
        return self._perms[epoch]

    def indices(self, first: int, count: int) -> np.ndarray:
        """Dataset indices at stream positions [first, first + count), crossing into the next epoch's
        permutation where the bucket runs out (the iterator is cyclic)."""
        out = []
        pos, stop = first, first + count
        while pos < stop:
            epoch, j = divmod(pos, self.bucket)
            take = min(self.bucket - j, stop - pos)
            out.append(self.start + self._perm(epoch)[j : j + take])
            pos += take
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
