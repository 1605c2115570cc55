"""Model-parallel embedding tables for `--parallel dp=N` (DLRM), as TorchRec shards them: each table lives
on one rank (table-wise, placed greedily by size) or, when larger than `split_rows`, is cut into N row
ranges, one per rank (row-wise); the dense part stays data-parallel under DDP, which ignores the shards.

One step, on every rank, for its local batch of B samples:
1. the ids of the whole global batch are all-gathered ([N x B, ids]; TorchRec sends each rank only the ids
   of its tables, an all-to-all of the same information);
2. the rank pools its shards' rows for every sample of the global batch, with one `embedding_bag` (ids
   outside a row-wise shard point at a padding row that adds nothing and gets no gradient);
3. an all-to-all sends each rank the pooled rows of its own samples ([B, tables of the sender, dim] from
   every sender); partial sums of a row-wise table are added. Backward runs the same all-to-all in reverse
   (torch.distributed.nn's autograd collectives), so each shard's gradient is sparse and holds the rows of
   the global batch: the row-sparse Adagrad (train/adagrad.py) updates them on their owner.

The shard's gradient sums the N ranks' local-mean losses; it is divided by N, as DDP averages the dense
gradients, so a step equals one process on the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from timetotrain.models.common.embedding_bag import FusedEmbeddingBag


@dataclass(frozen=True)
class Shard:
    table: int
    rank: int
    rows: tuple[int, int]  # [first, end) of the table's rows


def place(table_sizes: tuple[int, ...], world: int, split_rows: int | None = None) -> list[Shard]:
    """Tables larger than `split_rows` (default: a quarter of all rows over the ranks) split into `world`
    row ranges; the others whole on the rank with the fewest rows so far, largest first."""
    total = sum(table_sizes)
    split_rows = split_rows if split_rows is not None else max(total // (4 * world), 1)
    load = [0] * world
    shards = []
    for t in sorted(range(len(table_sizes)), key=lambda t: -table_sizes[t]):
        n = table_sizes[t]
        if n > split_rows and n >= world:
            bounds = [n * r // world for r in range(world + 1)]
            for r in range(world):
                shards.append(Shard(t, r, (bounds[r], bounds[r + 1])))
                load[r] += bounds[r + 1] - bounds[r]
        else:
            r = min(range(world), key=lambda i: (load[i], i))
            shards.append(Shard(t, r, (0, n)))
            load[r] += n
    return sorted(shards, key=lambda s: (s.rank, s.table))


def rank_rows(shards: list[Shard], world: int) -> list[int]:
    out = [0] * world
    for s in shards:
        out[s.rank] += s.rows[1] - s.rows[0]
    return out


class ShardedEmbeddingBag(nn.Module):
    """This rank's shards of a FusedEmbeddingBag, with the same call: ids [B, hots] -> pooled [B, tables, dim]."""

    def __init__(self, full: FusedEmbeddingBag, shards: list[Shard], rank: int, world: int, group=None):
        super().__init__()
        self.table_sizes, self.multi_hot, self.dim = full.table_sizes, full.multi_hot, full.dim
        self.rank, self.world, self.group = rank, world, group
        self.shards = shards
        mine = [s for s in shards if s.rank == rank]
        self.tables_of = [sorted(s.table for s in shards if s.rank == r) for r in range(world)]
        local = sum(s.rows[1] - s.rows[0] for s in mine)
        w = torch.zeros(local + 1, full.dim, device=full.weight.device, dtype=full.weight.dtype)
        starts, at = [], 0
        with torch.no_grad():
            for s in mine:
                src = full.table_rows(s.table)
                w[at : at + s.rows[1] - s.rows[0]] = full.weight[
                    src.start + s.rows[0] : src.start + s.rows[1]
                ]
                starts.append(at)
                at += s.rows[1] - s.rows[0]
        self.weight = nn.Parameter(w)  # the last row is padding: ids outside this rank's ranges
        self.pad = local
        first_col = [0]
        for k in full.multi_hot[:-1]:
            first_col.append(first_col[-1] + k)
        cols, lo, hi, base = [], [], [], []
        for s, start in zip(mine, starts, strict=True):
            k = full.multi_hot[s.table]
            cols += range(first_col[s.table], first_col[s.table] + k)
            lo += [s.rows[0]] * k
            hi += [s.rows[1]] * k
            base += [start - s.rows[0]] * k
        dev = full.weight.device
        self.register_buffer("cols", torch.tensor(cols, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("lo", torch.tensor(lo, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("hi", torch.tensor(hi, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("base", torch.tensor(base, dtype=torch.long, device=dev), persistent=False)
        self.bag_sizes = [full.multi_hot[s.table] for s in mine]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        everyone = torch.cat(dist_fn.all_gather(ids, group=self.group)) if self.world > 1 else ids
        n = everyone.shape[0]
        mine = self.tables_of[self.rank]
        if mine:
            x = everyone[:, self.cols].long()
            inside = (x >= self.lo) & (x < self.hi)
            local = torch.where(inside, x + self.base, torch.full_like(x, self.pad)).reshape(-1)
            sizes = torch.tensor(self.bag_sizes, device=ids.device)
            per_sample = int(sizes.sum())
            starts = torch.cumsum(sizes, 0) - sizes
            offsets = (torch.arange(n, device=ids.device).unsqueeze(1) * per_sample + starts).reshape(-1)
            pooled = F.embedding_bag(
                local, self.weight, offsets, mode="sum", sparse=True, padding_idx=self.pad
            )
            pooled = pooled.view(n, len(mine), self.dim)
            if pooled.requires_grad and self.world > 1:
                pooled.register_hook(lambda g: g / self.world)  # N local means -> the global mean
        else:
            pooled = self.weight.new_zeros(n, 0, self.dim) + 0 * self.weight.sum()
        if self.world == 1:
            out = ids.new_zeros((b, len(self.table_sizes), self.dim), dtype=self.weight.dtype)
            return out.index_add(1, torch.tensor(mine, device=ids.device), pooled)
        send = pooled.reshape(self.world, b * len(mine) * self.dim)  # samples of rank s: rows s*b .. s*b+b
        recv_sizes = [b * len(t) * self.dim for t in self.tables_of]
        out = torch.empty(sum(recv_sizes), device=ids.device, dtype=pooled.dtype)
        got = dist_fn.all_to_all_single(
            out, send.reshape(-1), recv_sizes, [b * len(mine) * self.dim] * self.world, group=self.group
        )
        result = None
        at = 0
        for src, tables in enumerate(self.tables_of):
            size = recv_sizes[src]
            if tables:
                part = got[at : at + size].view(b, len(tables), self.dim)
                full = part.new_zeros(b, len(self.table_sizes), self.dim).index_add(
                    1, torch.tensor(tables, device=ids.device), part
                )
                result = full if result is None else result + full
            at += size
        return result


def shard_embeddings(model: nn.Module, rank: int, world: int, split_rows: int | None = None) -> list[str]:
    """Replace every FusedEmbeddingBag of `model` by this rank's shards; returns the parameter and buffer
    names DDP must leave alone."""
    names = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, FusedEmbeddingBag):
                shards = place(child.table_sizes, world, split_rows)
                setattr(parent, child_name, ShardedEmbeddingBag(child, shards, rank, world))
                prefix = f"{parent_name}.{child_name}" if parent_name else child_name
                # The shard and its index buffers differ per rank: DDP must neither broadcast nor reduce them.
                names += [f"{prefix}.{n}" for n in ("weight", "cols", "lo", "hi", "base")]
    return names
