"""HSTU's embedding tables: one row per looked-up id, not pooled (TorchRec's EmbeddingCollection, which the
reference builds at modules/dlrm_hstu.py:159-163), held as row ranges of one [sum(rows), dim] weight as
models/common/embedding_bag.FusedEmbeddingBag holds DLRM's. The lookup's gradient is sparse (the rows looked
up), so train/adagrad.SparseAdagrad(rowwise=True), the reference's RowWiseAdagrad, updates only those.
Here in common, not in models/hstu, so that the harness finds it by type (train/embedding_parallel.py).

Not a FusedEmbeddingBag: that one sum-pools a fixed number of ids per table, while a history looks up a
different number of rows per sample and keeps each. Free of parallelism: a sharded lookup replaces it from
outside."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class FusedEmbedding(nn.Module):
    def __init__(self, table_sizes: tuple[int, ...], dim: int):
        super().__init__()
        self.table_sizes, self.dim = tuple(table_sizes), dim
        # Built under the meta device at the reference shape (293 M rows x 512, 600 GB in fp32): nothing here
        # may touch the weight's values.
        self.weight = nn.Parameter(torch.empty(sum(table_sizes), dim))
        starts = [0]
        for n in self.table_sizes[:-1]:
            starts.append(starts[-1] + n)
        self.starts = tuple(starts)

    def table_rows(self, t: int) -> slice:
        return slice(self.starts[t], self.starts[t] + self.table_sizes[t])

    def rows(self, ids: torch.Tensor, tables: tuple[int, ...]) -> torch.Tensor:
        """ids [..., len(tables)] of per-table row ids, column c in table `tables[c]` -> rows of `weight`."""
        base = torch.tensor([self.starts[t] for t in tables], dtype=torch.long, device=ids.device)
        return ids.long() + base

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [...] of `weight` (from `rows`) -> [..., dim]; one call per step, so one sparse gradient."""
        return F.embedding(rows, self.weight, sparse=True)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """TorchRec's default for a table without explicit bounds, U(-sqrt(1/rows), sqrt(1/rows)) per table
        (dlrm_v4/configs.py:526-536, _uniform_init_bounds), drawn table by table from `generator`."""
        for t, rows in enumerate(self.table_sizes):
            self.weight[self.table_rows(t)].uniform_(
                -table_bound(rows), table_bound(rows), generator=generator
            )


def table_bound(rows: int) -> float:
    return math.sqrt(1.0 / rows)
