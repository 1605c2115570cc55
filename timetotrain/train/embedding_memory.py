"""`ttt plan` for a model with embedding tables sharded by `--parallel dp=N` (train/embedding_parallel.py):
per rank, the bytes of its table shards, their Adagrad state and sparse gradient, the data-parallel dense
part (weights, gradients, Adagrad state, DDP's gradient buckets) and the step's activations and exchange
buffers, for the placement `ttt run` would build. fp32 throughout (the reference trains in fp32).

The activations are counted from the shapes the step keeps for the backward: the bottom MLP's and top MLP's
layer outputs, each cross layer's x_l, V x_l and W V x_l, the pooled rows; the exchange is the all-gathered
ids of the global batch and this rank's pooled partials for every sample of it (forward and gradient). The
sparse gradient holds one row per looked-up id before its coalesce (an upper bound: repeated ids merge),
values and int64 indices, twice (the coalesced copy)."""

from __future__ import annotations

import math

from timetotrain.errors import UserError
from timetotrain.train.embedding_parallel import place
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


def per_rank(bench, tier, gpus: int, gpu_mem_gib: float, gpus_per_node: int = 8) -> dict:
    cfg, gbs = tier.model, tier.global_batch_size
    if gpus < 1 or gbs % gpus:
        raise UserError(
            f"--gpus {gpus}: global_batch_size {gbs} does not split over {gpus} data-parallel ranks"
        )
    if not (math.isfinite(gpu_mem_gib) and gpu_mem_gib > 0):
        raise UserError(f"--gpu-mem {gpu_mem_gib:g} must be a positive, finite number of GiB")
    local = gbs // gpus
    tables = bench.family.embedding_tables(cfg)
    if not tables.pooled:
        raise UserError(f"ttt plan {bench.name}: {unsharded(bench, tables)}")
    rowwise = bench.optimizer.rowwise
    shards = place(tables.sizes, gpus) if gpus > 1 else None
    dense = bench.family.block_params(cfg)
    all_hots = sum(tables.hots)
    ranks = []
    for r in range(gpus):
        if shards is None:
            rows, mine_tables = sum(tables.sizes), list(range(len(tables.sizes)))
        else:
            mine = [s for s in shards if s.rank == r]
            rows, mine_tables = sum(s.rows[1] - s.rows[0] for s in mine), sorted({s.table for s in mine})
        hots = sum(tables.hots[t] for t in mine_tables)
        weights = (rows + 1) * tables.dim * 4
        state = (rows + 1) * 4 if rowwise else weights
        grad = 2 * gbs * hots * (tables.dim * 4 + 8)
        exchange = gbs * all_hots * 4 + 2 * 2 * gbs * len(mine_tables) * tables.dim * 4
        ranks.append(
            {
                "rank": r,
                "table_rows": rows,
                "tables": len(mine_tables),
                "embedding_weights": weights,
                "embedding_optimizer": state,
                "embedding_gradient": grad,
                "dense_weights_grads_optimizer": 3 * 4 * dense,
                "ddp_buckets": 4 * dense if gpus > 1 else 0,
                "activations": 4 * local * tables.sample_activation_elements,
                "exchange": exchange if gpus > 1 else 0,
            }
        )
    for d in ranks:
        d["total"] = sum(v for k, v in d.items() if k not in ("rank", "table_rows", "tables"))
    worst = max(ranks, key=lambda d: d["total"])
    cap = gpu_mem_gib * GiB
    return {
        "benchmark": bench.name,
        "tier": tier.name,
        "gpus": gpus,
        "gpu_mem_gib": gpu_mem_gib,
        "parallel": f"dp={gpus}",
        "optimizer": "row-wise Adagrad" if rowwise else "Adagrad (element-wise, EXACT_ADAGRAD)",
        "placement": "single process"
        if shards is None
        else "table-wise, row-wise above a quarter of the rows per rank",
        "ranks": ranks,
        "worst_rank": worst["rank"],
        "fits": worst["total"] <= HEADROOM * cap,
        "launch": launch_lines(
            bench.name, tier.name, f"--parallel dp={gpus}", gpus, gpus_per_node, before_launch(bench, tier)
        ),
    }


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
    lines.append("launch:")
    lines.extend(f"  {line}" for line in format_launch(doc["launch"]))
    return "\n".join(lines)
