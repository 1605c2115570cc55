"""Embedding tables in a ttt checkpoint, beside its DCP part: each rank writes the row ranges it holds and
reads the rows it owns, whatever the saving and the loading rank counts; no rank ever holds a whole table
it does not own (dlrmv4's are ~600 GB at the reference shape).

Why not DCP (train/checkpoint.py's `save_checkpoint` before these files): a sharded table's weight is a plain
tensor of this rank's rows (train/embedding_parallel.py), which DCP takes for a replicated one: it kept one
rank's rows and dropped the others', and read back under the same layout it gave every rank that one
rank's rows. DCP's own sharded types do not fit either: a rank holds one row range of each of many tables in
one weight, DTensor has one contiguous shard per rank, and a DCP read of a saved chunk loads the whole chunk
(a `torch.load`, a pickle) before it narrows it to the rows asked for.

So, for each table module (`embedding_parallel.TABLE_MODULES`, under its checkpoint name, e.g. `embedding`):
- each rank writes `tables-RRRRR.safetensors` (R its rank) holding, for each row range it holds, the rows
  (`{module}/weight/{table}`) and, when the optimizer is saved, their Adagrad accumulator
  (`{module}/adagrad/{table}`: [rows] row-wise, [rows, dim] element-wise; zeros where the optimizer has
  not made it yet, which is the value it starts from), streamed in chunks (`safetensors_file`);
- rank 0 records in `ttt_checkpoint.json`'s "tables" the table sizes, dim, dtype, Adagrad kind and every
  range as [file, table, first, end], from the placement every rank knows (`Shard`s);
- a load checks the record (untrusted input: each table tiled by its ranges exactly once, sizes and dim the
  model's) and, for each range the rank holds, reads only the overlapping rows from the files that hold
  them, each checked before it is read (layout, dtype, shape, byte range) and each chunk of values after
  (finite; accumulators not negative).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from timetotrain import trees
from timetotrain.errors import UserError
from timetotrain.train.adagrad import SparseAdagrad
from timetotrain.train.embedding_parallel import (
    FILL_ROWS,
    TABLE_MODULES,
    ShardedEmbedding,
    ShardedEmbeddingBag,
    local_spans,
)
from timetotrain.train.optim import parts
from timetotrain.train.safetensors_file import (
    DTYPES,
    check_safetensors_layout,
    read_rows,
    tensor_entry,
    write_safetensors,
)

KEY = "tables"  # in the checkpoint's META
CHUNK_ROWS = FILL_ROWS  # rows copied at a time, on the host, when writing and reading
_SAVE_AGAIN = "save the checkpoint again"
_KINDS = ("row", "element")  # the Adagrad accumulator: one per row, or one per element


def file_name(rank: int) -> str:
    return f"tables-{rank:05d}.safetensors"


def _sharded(module: nn.Module) -> bool:
    return isinstance(module, (ShardedEmbedding, ShardedEmbeddingBag))


def is_table(module: nn.Module) -> bool:
    """A table module whose weight is a plain tensor (FSDP2's DTensor tables are DCP's: it shards them)."""
    return isinstance(module, TABLE_MODULES) and not isinstance(module.weight, DTensor)


@contextlib.contextmanager
def frozen(tables: dict[str, nn.Module]):
    """Table weights marked not trainable for a moment: torch's `get_state_dict` / `set_state_dict` then
    neither make a dense zero gradient and an accumulator for them in an optimizer that has no state yet
    (its `_init_optim_state` takes a step) nor look for their state in the DCP part."""
    weights = [m.weight for m in tables.values()]
    before = [w.requires_grad for w in weights]
    try:
        for w in weights:
            w.requires_grad_(False)
        yield
    finally:
        for w, was in zip(weights, before, strict=True):
            w.requires_grad_(was)


def _adagrad(optimizer, weight: torch.Tensor, name: str) -> tuple[SparseAdagrad, str] | None:
    """The optimizer that trains `weight` and its accumulator kind; None where no optimizer is given."""
    if optimizer is None:
        return None
    for opt in parts(optimizer):
        for group in opt.param_groups:
            if any(p is weight for p in group["params"]):
                if not isinstance(opt, SparseAdagrad):
                    raise UserError(
                        f"table {name} is trained by {type(opt).__name__}: a checkpoint holds the state of "
                        "SparseAdagrad only (train/adagrad.py); save the model alone (optimizer=None)"
                    )
                return opt, "row" if group["rowwise"] else "element"
    return None


def _accumulator(opt: SparseAdagrad, weight: torch.Tensor, kind: str) -> torch.Tensor:
    state = opt.state.get(weight, {}).get("sum")
    if state is not None:
        return state
    return torch.zeros(
        weight.shape[:1] if kind == "row" else weight.shape, dtype=weight.dtype, device=weight.device
    )


def record(tables: dict[str, nn.Module], optimizer) -> dict:
    """The "tables" entry of the checkpoint's META: what `save` writes on every rank, for every rank."""
    out = {}
    for name, m in tables.items():
        held = _adagrad(optimizer, m.weight, name)
        if _sharded(m):
            ranges = [[s.rank, s.table, *s.rows] for s in m.shards]
        else:  # a whole table: rank 0's file holds it (every rank holds the same)
            ranges = [[0, t, first, end] for t, (first, end), _ in local_spans(m)]
        out[name] = {
            "table_sizes": list(m.table_sizes), "dim": m.dim, "dtype": DTYPES[m.weight.dtype],
            "adagrad": held[1] if held else None, "ranges": sorted(ranges, key=lambda r: (r[1], r[2])),
        }  # fmt: skip
    return out


def save(folder: Path, tables: dict[str, nn.Module], optimizer, rank: int) -> None:
    """This rank's file of the rows it holds (and their accumulators); nothing where it holds none."""
    tensors = []
    for name, m in tables.items():
        if not _sharded(m) and rank != 0:
            continue  # a whole table: rank 0 writes it
        if _sharded(m) and m.rank != rank:
            raise ValueError(f"table {name} is rank {m.rank}'s shard on rank {rank}")
        held = _adagrad(optimizer, m.weight, name)
        acc = _accumulator(held[0], m.weight, held[1]) if held else None
        for t, (first, end), at in local_spans(m):
            tensors.append((f"{name}/weight/{t}", m.weight.detach()[at : at + end - first]))
            if acc is not None:
                tensors.append((f"{name}/adagrad/{t}", acc[at : at + end - first]))
    if tensors:
        write_safetensors(folder / file_name(rank), tensors, CHUNK_ROWS)


def parse(where: Path, meta: dict) -> dict | None:
    """The checked "tables" record of the checkpoint META `meta` read from file `where` (untrusted), or None
    for a checkpoint saved before tables were written apart (its tables are DCP entries). Every file it
    names exists."""
    if KEY not in meta:
        return None
    got, final = meta[KEY], where.parent

    def bad(why: str) -> UserError:
        return UserError(f"{where}: '{KEY}' {why}; not a ttt checkpoint: {_SAVE_AGAIN}")

    if not isinstance(got, dict):
        raise bad("is not a map of table modules")
    files = set()
    for name, rec in got.items():
        keys = {"table_sizes", "dim", "dtype", "adagrad", "ranges"}
        if not isinstance(rec, dict) or set(rec) != keys:
            raise bad(f"entry {name!r} does not hold exactly {sorted(keys)}")
        sizes, dim = rec["table_sizes"], rec["dim"]
        if not isinstance(sizes, list) or not sizes or not all(_count(n) for n in sizes) or not _count(dim):
            raise bad(f"entry {name!r}: table_sizes and dim must be positive integers")
        if rec["dtype"] not in DTYPES.values() or rec["adagrad"] not in (None, *_KINDS):
            raise bad(f"entry {name!r}: dtype {rec['dtype']!r} or adagrad {rec['adagrad']!r} is unknown")
        ranges = rec["ranges"]
        if not isinstance(ranges, list) or not all(
            isinstance(r, list) and len(r) == 4 and all(type(x) is int and x >= 0 for x in r) for r in ranges
        ):
            raise bad(f"entry {name!r}: ranges must be [file, table, first, end] of non-negative integers")
        for t, n in enumerate(sizes):
            mine = sorted((r[2], r[3]) for r in ranges if r[1] == t)
            tiled = [0] + [e for _, e in mine] == [f for f, _ in mine] + [n]
            if not tiled or any(f >= e for f, e in mine):
                raise bad(f"entry {name!r}: the ranges of table {t} do not cover its {n} rows exactly once")
        if any(r[1] >= len(sizes) for r in ranges) or len({(r[0], r[1]) for r in ranges}) != len(ranges):
            raise bad(
                f"entry {name!r}: a range names a table it does not have, or a file holds a table twice"
            )
        files |= {r[0] for r in ranges}
    for f in sorted(files):
        path = final / file_name(f)
        if not path.is_file():
            raise UserError(f"{path}: missing (the checkpoint's tables name it); {_SAVE_AGAIN}")
        trees.check_inside(path, final, "copy the real file into the checkpoint folder")
    return got


def _count(x) -> bool:
    return type(x) is int and x >= 1


def check_fits(final: Path, rec: dict | None, tables: dict[str, nn.Module], optimizer) -> None:
    """The record's tables are the model's (names, sizes, dim) and, with an optimizer, hold the
    accumulator it keeps; one line naming the checkpoint otherwise."""
    if rec is None:
        sharded = [n for n, m in tables.items() if _sharded(m)]
        if sharded:
            raise UserError(
                f"{final}: saved before ttt wrote tables apart, so it cannot be read into sharded tables "
                f"({sharded[0]}); load it into one process (no --parallel dp=N)"
            )
        return
    if set(rec) != set(tables):
        raise UserError(
            f"{final}: holds tables {sorted(rec)}, this model has {sorted(tables)}; it was saved from another model"
        )
    for name, m in tables.items():
        saved = rec[name]
        if tuple(saved["table_sizes"]) != tuple(m.table_sizes) or saved["dim"] != m.dim:
            raise UserError(
                f"{final}: table module {name} has {len(saved['table_sizes'])} tables of "
                f"{sum(saved['table_sizes']):,} rows x {saved['dim']} in the checkpoint, "
                f"{len(m.table_sizes)} of {sum(m.table_sizes):,} x {m.dim} in this model; build the model with "
                "the config the checkpoint was saved from"
            )
        held = _adagrad(optimizer, m.weight, name)
        if held is not None and saved["adagrad"] != held[1]:
            raise UserError(
                f"{final}: table module {name} was saved with {saved['adagrad'] or 'no'} Adagrad state, this "
                f"optimizer keeps it {held[1]}-wise; load the model alone (optimizer=None)"
            )


def load(final: Path, rec: dict, tables: dict[str, nn.Module], optimizer) -> None:
    """Each table module's rows that this rank holds (and their accumulators, with an optimizer) from the
    files that hold them: only the overlapping rows are read."""
    with contextlib.ExitStack() as stack, torch.no_grad():
        opened: dict[int, tuple] = {}

        def source(f: int):
            if f not in opened:
                path = final / file_name(f)
                opened[f] = (path, check_safetensors_layout(path), stack.enter_context(open(path, "rb")))
            return opened[f]

        for name, m in tables.items():
            saved, dim, want = rec[name], rec[name]["dim"], rec[name]["dtype"]
            held = _adagrad(optimizer, m.weight, name)
            acc = None
            if held is not None:
                shape = m.weight.shape[:1] if held[1] == "row" else m.weight.shape
                acc = torch.zeros(shape, dtype=m.weight.dtype, device=m.weight.device)
            for t, (lo, hi), at in local_spans(m):
                for f, _, first, end in (r for r in saved["ranges"] if r[1] == t):
                    a, z = max(first, lo), min(end, hi)
                    if a >= z:
                        continue
                    n = end - first
                    rows, into = (a - first, z - first), at + a - lo
                    _copy(source(f), f"{name}/weight/{t}", (n, dim), want, rows, m.weight, into)
                    if acc is not None:
                        shape = (n,) if held[1] == "row" else (n, dim)
                        _copy(source(f), f"{name}/adagrad/{t}", shape, want, rows, acc, into)
            if acc is not None:
                held[0].state[m.weight] = {"sum": acc}


def _copy(src, tensor: str, shape, want: str, rows: tuple[int, int], dest: torch.Tensor, at: int) -> None:
    """Rows [first, end) of `tensor` (of `shape` and dtype `want` by the record) in the open file `src` into
    `dest` from row `at`, a chunk at a time."""
    path, layout, f = src
    first, end = rows
    dtype, start = tensor_entry(path, layout, tensor, shape, _SAVE_AGAIN)
    if DTYPES[dtype] != want:
        raise UserError(f"{path}: tensor {tensor} is {DTYPES[dtype]}, the record says {want}; {_SAVE_AGAIN}")
    for c in range(first, end, CHUNK_ROWS):
        rows = read_rows(f, dtype, start, shape, c, min(c + CHUNK_ROWS, end))
        if not bool(torch.isfinite(rows).all()) or ("/adagrad/" in tensor and bool((rows < 0).any())):
            raise UserError(
                f"{path}: tensor {tensor} holds NaN, inf or a negative accumulator (rows {c} onwards): the "
                f"checkpoint is broken; {_SAVE_AGAIN}"
            )
        dest[at + c - first : at + c - first + rows.shape[0]].copy_(rows)
