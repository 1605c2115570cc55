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

Unpooled tables (`models/common/embedding.FusedEmbedding`, hstu: one row per id, a different number of ids
per sample) are placed the same way and exchanged as TorchRec's sharded EmbeddingCollection does, rows per
id (`ShardedEmbedding`):
1. each rank sorts its ids by the rank that owns their row and sends each owner its ids (an all-to-all of
   the counts, then of the ids);
2. the owner looks the rows up in its shard (one `embedding`, a sparse gradient over its own rows only);
3. a second all-to-all sends the rows back; the backward runs it in reverse, so each owner receives the
   gradients of its rows from every rank and row-wise Adagrad updates them there, its state [own rows].
Nothing travels but the ids a rank looks up and their rows. Such a shard can be made from the meta model
(`shard_tables_before_fill`) and filled by the family's own init (`ShardedEmbedding.reset_parameters`), so
that no rank ever holds a whole table (hstu's reference shape is 600 GB of fp32 rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from timetotrain.fakes import host_sizes
from timetotrain.models.common.embedding import FusedEmbedding, table_bound
from timetotrain.models.common.embedding_bag import FusedEmbeddingBag

# Rows drawn at a time when a shard is filled: every rank draws every table whole, chunk by chunk, and keeps
# its own rows (so the generator stays in step across ranks), never holding more than this many rows x dim.
FILL_ROWS = 1 << 18
# Unpooled tables split row-wise whatever their size (`place`'s split_rows 0): an id still fetches one row
# from one owner, so a row-wise shard costs no more traffic than a whole table, and it spreads the lookups of
# the tables every event reads (hstu's item, artist and album: 4,085 ids per sample each) over all ranks,
# where table-wise placement would send every artist lookup of the global batch to one rank.
UNPOOLED_SPLIT_ROWS = 0


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
        self.mine = mine
        local = sum(s.rows[1] - s.rows[0] for s in mine)
        # `full` may be on the meta device (`shard_tables_before_fill`): then `reset_parameters` fills it.
        w = torch.zeros(local + 1, full.dim, device=full.weight.device, dtype=full.weight.dtype)
        starts, at = [], 0
        with torch.no_grad():
            for s in mine:
                if full.weight.device.type != "meta":
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
        # Python lists, made tensors on the ids' device at the first lookup (as ShardedEmbedding's routing:
        # buffers made on the meta device would come out of `to_empty` uninitialised).
        self.columns = (cols, lo, hi, base)
        self._columns: dict = {}
        self.bag_sizes = [full.multi_hot[s.table] for s in mine]

    def _local_starts(self):
        return ShardedEmbedding._local_starts(self)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """FusedEmbeddingBag's draws, as ShardedEmbedding draws FusedEmbedding's: every table in chunks,
        this rank keeping its rows; the padding row zero."""
        ShardedEmbedding.reset_parameters(self, generator)
        self.weight[self.pad].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        everyone = torch.cat(dist_fn.all_gather(ids, group=self.group)) if self.world > 1 else ids
        n = everyone.shape[0]
        mine = self.tables_of[self.rank]
        if mine:
            if ids.device not in self._columns:
                self._columns[ids.device] = [
                    torch.tensor(c, dtype=torch.long, device=ids.device) for c in self.columns
                ]
            cols, lo, hi, base = self._columns[ids.device]
            x = everyone[:, cols].long()
            inside = (x >= lo) & (x < hi)
            local = torch.where(inside, x + base, torch.full_like(x, self.pad)).reshape(-1)
            sizes = torch.tensor(self.bag_sizes, device=ids.device)
            per_sample = sum(self.bag_sizes)  # on the host (a fake tensor's sum has no value to read)
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


class ShardedEmbedding(nn.Module):
    """This rank's shards of a FusedEmbedding, with the same calls: `rows(ids, tables)` (global rows of the
    whole table, as before) and `forward(rows)` -> [..., dim], one row per id. `full` may be on the meta
    device: then the shard is allocated (meta) and left for `reset_parameters` or a copy to fill."""

    def __init__(self, full: FusedEmbedding, shards: list[Shard], rank: int, world: int, group=None):
        super().__init__()
        self.table_sizes, self.dim, self.starts = full.table_sizes, full.dim, full.starts
        self.rank, self.world, self.group = rank, world, group
        self.shards = shards
        self.mine = [s for s in shards if s.rank == rank]
        local = sum(s.rows[1] - s.rows[0] for s in self.mine)
        self.weight = nn.Parameter(
            torch.empty(local, full.dim, device=full.weight.device, dtype=full.weight.dtype)
        )
        # Where each global row lives: shard k covers global rows [lo[k], next lo), on rank owner[k], at
        # local row (global + shift[k]) there. Python lists, made tensors on the ids' device at the first
        # lookup (buffers made on the meta device would come out of `to_empty` uninitialised).
        at = [0] * world
        spans = []
        for s in sorted(shards, key=lambda s: (s.rank, s.table)):
            lo = full.starts[s.table] + s.rows[0]
            spans.append((lo, s.rank, at[s.rank] - lo))
            at[s.rank] += s.rows[1] - s.rows[0]
        spans.sort()
        self.route = tuple(list(col) for col in zip(*spans, strict=True))
        self._routes: dict = {}
        if full.weight.device.type != "meta":
            with torch.no_grad():
                for s, start in self._local_starts():
                    src = full.starts[s.table]
                    self.weight[start : start + s.rows[1] - s.rows[0]] = full.weight[
                        src + s.rows[0] : src + s.rows[1]
                    ]

    def _local_starts(self):
        at = 0
        for s in self.mine:
            yield s, at
            at += s.rows[1] - s.rows[0]

    def rows(self, ids: torch.Tensor, tables: tuple[int, ...]) -> torch.Tensor:
        return FusedEmbedding.rows(self, ids, tables)

    def _routing(self, device):
        if device not in self._routes:
            self._routes[device] = [torch.tensor(col, dtype=torch.long, device=device) for col in self.route]
        return self._routes[device]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        shape, flat = rows.shape, rows.reshape(-1).long()
        lo, owner, shift = self._routing(flat.device)
        k = torch.searchsorted(lo, flat, right=True) - 1
        local = flat + shift[k]
        if self.world == 1:
            return F.embedding(local, self.weight, sparse=True).view(*shape, self.dim)
        dest = owner[k]
        order = torch.argsort(dest, stable=True)
        send = dest.new_zeros(self.world).index_add_(0, dest, torch.ones_like(dest))  # bincount, static shape
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        # (`ttt plan --simulate`: fake counts read as the ids split evenly over the owners, timetotrain/fakes.py)
        send_sizes, recv_sizes = host_sizes(send, flat.shape[0]), host_sizes(recv, flat.shape[0])
        asked = flat.new_empty(sum(recv_sizes))
        dist.all_to_all_single(asked, local[order], recv_sizes, send_sizes, group=self.group)
        found = F.embedding(asked, self.weight, sparse=True)
        if found.requires_grad:
            found.register_hook(lambda g: g / self.world)  # N local means -> the global mean
        back = dist_fn.all_to_all_single(
            found.new_empty(flat.shape[0], self.dim), found, send_sizes, recv_sizes, group=self.group
        )
        return back.index_select(0, torch.argsort(order)).view(*shape, self.dim)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """FusedEmbedding.reset_parameters' draws, table by table, in chunks of FILL_ROWS rows; this rank keeps
        its rows. On the CPU the chunks draw the whole table's numbers (the same weights as one process, the
        generator left where the whole draw leaves it); on a GPU each chunk is its own Philox call, so the
        numbers differ from a whole-table draw but are the same on every rank."""
        by_table: dict[int, list] = {}
        for s, start in self._local_starts():
            by_table.setdefault(s.table, []).append((s, start))
        for t, n in enumerate(self.table_sizes):
            b = table_bound(n)
            for c in range(0, n, FILL_ROWS):
                e = min(c + FILL_ROWS, n)
                chunk = torch.empty(e - c, self.dim, device=self.weight.device, dtype=self.weight.dtype)
                chunk.uniform_(-b, b, generator=generator)
                for s, start in by_table.get(t, ()):
                    a, z = max(c, s.rows[0]), min(e, s.rows[1])
                    if a < z:
                        self.weight[start + a - s.rows[0] : start + z - s.rows[0]] = chunk[a - c : z - c]


TABLE_MODULES = (FusedEmbedding, FusedEmbeddingBag, ShardedEmbedding, ShardedEmbeddingBag)


def local_spans(module: nn.Module) -> list[tuple[int, tuple[int, int], int]]:
    """(table, its rows [first, end), the row of `module.weight` that holds `first`) for each row range a
    table module (`TABLE_MODULES`) holds: every table whole, or this rank's shards in the order both sharded
    modules lay them out (their `shards` filtered to the rank, packed). Checkpoints read and write by these
    (train/table_checkpoint.py)."""
    if not isinstance(module, (ShardedEmbedding, ShardedEmbeddingBag)):
        return [(t, (0, n), module.table_rows(t).start) for t, n in enumerate(module.table_sizes)]
    out, at = [], 0
    for s in module.shards:
        if s.rank == module.rank:
            out.append((s.table, s.rows, at))
            at += s.rows[1] - s.rows[0]
    return out


def _replace(module: nn.Module, rank: int, world: int, split_rows: int | None) -> nn.Module | None:
    if isinstance(module, FusedEmbeddingBag):
        return ShardedEmbeddingBag(module, place(module.table_sizes, world, split_rows), rank, world)
    if isinstance(module, FusedEmbedding):
        rows = UNPOOLED_SPLIT_ROWS if split_rows is None else split_rows
        return ShardedEmbedding(module, place(module.table_sizes, world, rows), rank, world)
    return None


# What differs per rank in each sharded module: DDP must neither broadcast nor reduce it.
_PER_RANK = {ShardedEmbeddingBag: ("weight",), ShardedEmbedding: ("weight",)}


def shard_embeddings(
    model: nn.Module, rank: int, world: int, split_rows: int | None = None, unpooled_only: bool = False
) -> list[str]:
    """Replace every FusedEmbeddingBag and FusedEmbedding of `model` by this rank's shards (tables already
    sharded stay); returns the parameter and buffer names DDP must leave alone. `unpooled_only`: the
    FusedEmbeddings alone (`shard_tables_before_fill`)."""
    names = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not (unpooled_only and isinstance(child, FusedEmbeddingBag)):
                new = _replace(child, rank, world, split_rows)
                if new is not None:
                    setattr(parent, child_name, new)
                    child = new
            prefix = f"{parent_name}.{child_name}" if parent_name else child_name
            names += [f"{prefix}.{n}" for n in _PER_RANK.get(type(child), ())]
    return names
