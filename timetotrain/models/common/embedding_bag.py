"""Embedding tables as one module: the recommenders' sparse features (DLRM-DCNv2's 26 Criteo tables).
Free of parallelism: train/embedding_parallel.py replaces it by a rank's row shards from outside, for any
family that declares its tables (`ModelFamily.embedding_tables`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class FusedEmbeddingBag(nn.Module):
    """All tables as row ranges of one [sum(rows), dim] weight, looked up by one sum-pooled
    `embedding_bag` (FBGEMM's table-batched embedding does the same on one buffer). Its gradient is
    sparse (the rows looked up): the optimizer updates only those (train/adagrad.py)."""

    def __init__(self, table_sizes: tuple[int, ...], multi_hot: tuple[int, ...], dim: int):
        super().__init__()
        self.table_sizes, self.multi_hot, self.dim = tuple(table_sizes), tuple(multi_hot), dim
        self.weight = nn.Parameter(torch.empty(sum(table_sizes), dim))
        # Filled by `fill_buffers` (after to_empty: a meta build leaves buffers unset): each id column's
        # table start row, and each table's first column within a sample.
        self.register_buffer("column_base", torch.empty(sum(multi_hot), dtype=torch.long), persistent=False)
        self.register_buffer("bag_start", torch.empty(len(multi_hot), dtype=torch.long), persistent=False)

    @torch.no_grad()
    def fill_buffers(self) -> None:
        starts = [0]
        for n in self.table_sizes[:-1]:
            starts.append(starts[-1] + n)
        cols = [s for s, k in zip(starts, self.multi_hot, strict=True) for _ in range(k)]
        self.column_base.copy_(torch.tensor(cols, dtype=torch.long))
        first = [0]
        for k in self.multi_hot[:-1]:
            first.append(first[-1] + k)
        self.bag_start.copy_(torch.tensor(first, dtype=torch.long))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The buffers, and each table U(-sqrt(1/rows), sqrt(1/rows)) (TorchRec's EmbeddingBagConfig default),
        drawn table by table from `generator`."""
        self.fill_buffers()
        for t, rows in enumerate(self.table_sizes):
            bound = math.sqrt(1.0 / rows)
            self.weight[self.table_rows(t)].uniform_(-bound, bound, generator=generator)

    def table_rows(self, t: int) -> slice:
        start = sum(self.table_sizes[:t])
        return slice(start, start + self.table_sizes[t])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, sum(multi_hot)] (per-table row ids) -> pooled [B, tables, dim]."""
        b, hots = ids.shape
        flat = (ids.long() + self.column_base).reshape(-1)
        offsets = (torch.arange(b, device=ids.device).unsqueeze(1) * hots + self.bag_start).reshape(-1)
        pooled = F.embedding_bag(flat, self.weight, offsets, mode="sum", sparse=True)
        return pooled.view(b, len(self.table_sizes), self.dim)
