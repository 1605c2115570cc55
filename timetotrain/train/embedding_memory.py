"""`ttt plan` for a model with embedding tables sharded by `--parallel dp=N` (train/embedding_parallel.py):
per rank, the bytes of its table shards, their Adagrad state and sparse gradient, the data-parallel dense
part (weights, gradients, Adagrad state, DDP's gradient buckets) and the step's activations and exchange
buffers, for the placement `ttt run` would build. fp32 throughout (the reference trains in fp32).

The activations are counted from the shapes the step keeps for the backward: the bottom MLP's and top MLP's
layer outputs, each cross layer's x_l, V x_l and W V x_l, the pooled rows; the exchange is the all-gathered
ids of the global batch and this rank's pooled partials for every sample of it (forward and gradient). The
sparse gradient holds one row per looked-up id before its coalesce (an upper bound: repeated ids merge),
values and int64 indices, twice (the coalesced copy).

Unpooled tables (hstu, `EmbeddingTables.pooled` False) exchange rows per id instead (`rank_bytes`), their
optimizer and dense part as the family declares them (row-wise Adagrad on the tables, the benchmark's Adam
with its two states on the rest)."""

from __future__ import annotations

import math

from timetotrain.errors import UserError
from timetotrain.train.embedding_parallel import UNPOOLED_SPLIT_ROWS, place
from timetotrain.train.launch import before_launch, format_launch, launch_lines

GiB = 2**30
HEADROOM = 0.9  # as train/memory.py: suggest only what fits with 10% to spare


def unsharded(bench, tables) -> str:
    """Why a family whose tables are not pooled bags has no multi-rank layout yet, in one line."""
    rows = sum(tables.sizes)
    return (
        f"the {bench.family.name} tables look up one row per id (not pooled), and "
        f"--parallel dp=N shards only pooled bags (train/embedding_parallel.py), so every rank would hold all "
        f"{rows:,} rows ({rows * tables.dim * 4 / 1e9:,.3g} GB in fp32); model-parallel {bench.family.name} "
        "tables are not built yet"
    )


def per_rank(bench, tier, gpus: int, gpu_mem_gib: float, gpus_per_node: int = 8, larger: bool = True) -> dict:
    cfg, gbs = tier.model, tier.global_batch_size
    if gpus < 1 or gbs % gpus:
        raise UserError(
            f"--gpus {gpus}: global_batch_size {gbs} does not split over {gpus} data-parallel ranks"
        )
    if not (math.isfinite(gpu_mem_gib) and gpu_mem_gib > 0):
        raise UserError(f"--gpu-mem {gpu_mem_gib:g} must be a positive, finite number of GiB")
    tables = bench.family.embedding_tables(cfg)
    rowwise = tables.rowwise if tables.rowwise is not None else bench.optimizer.rowwise
    dense = tables.dense_params if tables.dense_params is not None else bench.family.block_params(cfg)
    # Per dense parameter: its weight and gradient, plus Adagrad's one state or Adam's two.
    states = 1 if bench.optimizer.name == "adagrad" else 2
    ranks = rank_bytes(tables, dense, states, rowwise, gbs, gpus)
    shards = gpus > 1
    worst = max(ranks, key=lambda d: d["total"])
    cap = gpu_mem_gib * GiB
    doc = {
        "benchmark": bench.name,
        "tier": tier.name,
        "gpus": gpus,
        "gpu_mem_gib": gpu_mem_gib,
        "parallel": f"dp={gpus}",
        "optimizer": ("row-wise Adagrad" if rowwise else "Adagrad (element-wise, EXACT_ADAGRAD)")
        + ("" if states == 1 else f" on the tables, {bench.optimizer.name} on the rest"),
        "placement": "single process"
        if not shards
        else "table-wise, row-wise above a quarter of the rows per rank",
        "ranks": ranks,
        "worst_rank": worst["rank"],
        "fits": worst["total"] <= HEADROOM * cap,
        # A launch line only for what fits: the plan never suggests what cannot run.
        "launch": launch_lines(
            bench.name, tier.name, f"--parallel dp={gpus}", gpus, gpus_per_node, before_launch(bench, tier)
        )
        if worst["total"] <= HEADROOM * cap
        else None,
    }
    if doc["launch"] is None and larger:  # the smallest larger world that fits, or why none does
        doc["larger"] = _larger(bench, tier, gpus, gpu_mem_gib, gpus_per_node)
    return doc


def _larger(bench, tier, gpus: int, gpu_mem_gib: float, gpus_per_node: int) -> str:
    """'fits from W GPUs' for the smallest world above `gpus` that `ttt run` takes (a divisor of the global
    batch, whole nodes) on which every rank fits; else what the largest rank needs on the largest one."""
    gbs = tier.global_batch_size
    worlds = [
        w for w in range(gpus + 1, gbs + 1) if gbs % w == 0 and (w <= gpus_per_node or w % gpus_per_node == 0)
    ]
    doc = None
    for w in worlds:
        doc = per_rank(bench, tier, w, gpu_mem_gib, gpus_per_node, larger=False)
        if doc["fits"]:
            return f"fits from {w} GPUs"
    if doc is None:
        return "nor on more GPUs: the global batch splits over no more"
    worst = doc["ranks"][doc["worst_rank"]]
    return (
        f"nor on more GPUs: on {doc['gpus']} GPUs ({gbs // doc['gpus']} sample(s) a rank), the largest rank needs "
        f"{worst['total'] / GiB:,.1f} GiB ({worst['activations'] / GiB:,.1f} of activations) of the "
        f"{HEADROOM * gpu_mem_gib:,.0f} usable; needed: GPUs with more memory, or a model whose activations shrink"
    )


def rank_bytes(tables, dense: int, dense_states: int, rowwise: bool, gbs: int, gpus: int) -> list[dict]:
    """Each rank's bytes under `dp=gpus` for `tables` (an EmbeddingTables), `dense` data-parallel parameters
    with `dense_states` optimizer states each, and the global batch `gbs`, for the placement `ttt run` builds.

    Pooled tables (DLRM) exchange the all-gathered ids and the pooled partials of every sample; unpooled ones
    (hstu: train/embedding_parallel.ShardedEmbedding) send the ids a rank looks up to their owners and get
    the rows back, forward and gradient: per rank its own samples' lookups, and the lookups of the global
    batch that land in its rows (table-wise: all of that table's; row-wise: the shard's share of the rows,
    ids taken as uniform over them). `hots` of an unpooled table is its lookups at the longest sample."""
    local = gbs // gpus
    split = None if tables.pooled else UNPOOLED_SPLIT_ROWS  # as train/embedding_parallel places them
    shards = place(tables.sizes, gpus, split) if gpus > 1 else None
    all_hots = sum(tables.hots)
    by_rank: dict[int, list] = {}
    for s in shards or ():
        by_rank.setdefault(s.rank, []).append((s.table, s.rows[1] - s.rows[0], tables.sizes[s.table]))
    ranks = []
    for r in range(gpus):
        if shards is None:
            mine = [(t, n, n) for t, n in enumerate(tables.sizes)]
        else:
            mine = by_rank.get(r, [])
        rows, mine_tables = sum(m[1] for m in mine), sorted({m[0] for m in mine})
        weights = (rows + 1) * tables.dim * 4
        if tables.pooled:
            hots = sum(tables.hots[t] for t in mine_tables)
            grad = 2 * gbs * hots * (tables.dim * 4 + 8)
            exchange = gbs * all_hots * 4 + 2 * 2 * gbs * len(mine_tables) * tables.dim * 4
        else:
            asked = sum(gbs * tables.hots[t] * n / size for t, n, size in mine)  # lookups landing here
            grad = 2 * asked * (tables.dim * 4 + 8)
            sent = local * all_hots  # this rank's own lookups
            exchange = 2 * 8 * (sent + asked) + 2 * 2 * (sent + asked) * tables.dim * 4
        ranks.append(
            {
                "rank": r,
                "table_rows": rows,
                "tables": len(mine_tables),
                "embedding_weights": weights,
                "embedding_optimizer": (rows + 1) * 4 if rowwise else weights,
                "embedding_gradient": grad,
                "dense_weights_grads_optimizer": (2 + dense_states) * 4 * dense,
                "ddp_buckets": 4 * dense if gpus > 1 else 0,
                "activations": 4 * local * tables.sample_activation_elements,
                "exchange": exchange if gpus > 1 else 0,
            }
        )
    for d in ranks:
        d["total"] = sum(v for k, v in d.items() if k not in ("rank", "table_rows", "tables"))
    return ranks


def format_per_rank(doc: dict) -> str:
    g = lambda b: f"{b / GiB:8.2f}"  # noqa: E731
    lines = [
        f"{doc['benchmark']} {doc['tier']}: {doc['gpus']} GPUs x {doc['gpu_mem_gib']:g} GiB, "
        f"{doc['parallel']} ({doc['placement']}), {doc['optimizer']}, fp32",
        "rank  tables   table rows  emb weights  emb optim  emb grad  dense+opt  ddp   activ  exchange   total GiB",
    ]
    for d in doc["ranks"]:
        lines.append(
            f"{d['rank']:>4}  {d['tables']:>6}  {d['table_rows']:>11,}  {g(d['embedding_weights'])}  "
            f"{g(d['embedding_optimizer'])}  {g(d['embedding_gradient'])}  {g(d['dense_weights_grads_optimizer'])}"
            f" {g(d['ddp_buckets'])} {g(d['activations'])} {g(d['exchange'])}  {g(d['total'])}"
        )
    worst = doc["ranks"][doc["worst_rank"]]
    verdict = "fits" if doc["fits"] else "does not fit"
    lines.append(
        f"largest: rank {worst['rank']} at {worst['total'] / GiB:.2f} GiB of {doc['gpu_mem_gib']:g}: {verdict} "
        f"(suggested only with 10% to spare)"
    )
    if doc["launch"] is None:
        lines.append(f"launch: none: {doc['larger']}")
    else:
        lines.append("launch:")
        lines.extend(f"  {line}" for line in format_launch(doc["launch"]))
    return "\n".join(lines)
