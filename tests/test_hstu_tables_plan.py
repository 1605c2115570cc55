"""`ttt plan`'s per-rank count (train/embedding_memory.rank_bytes) for hstu's unpooled tables, from the
family's own declaration (`FAMILY.embedding_tables`), at the function level: the dlrmv4 benchmark is not in
the registry yet, so `per_rank(bench, tier, ...)` cannot be reached through it."""

import pytest

from timetotrain.models import hstu
from timetotrain.train.embedding_memory import GiB, rank_bytes

REFERENCE_GBS = 8192  # suite/dlrmv4.py: 8 ranks x 1,024


def _tables(cfg):
    return hstu.FAMILY.embedding_tables(cfg)


def test_reference_shape_fits_only_sharded():
    cfg = hstu.HSTUConfig()
    t = _tables(cfg)
    assert not t.pooled and t.rowwise and t.dense_params == hstu.dense_param_count(cfg)
    one = rank_bytes(t, t.dense_params, 2, True, REFERENCE_GBS, 1)[0]
    assert one["embedding_weights"] / GiB > 500  # 293 M rows x 512 x 4 B: never on one GPU
    ranks = rank_bytes(t, t.dense_params, 2, True, REFERENCE_GBS, 64)
    assert sum(d["table_rows"] for d in ranks) == cfg.rows
    per = [d["embedding_weights"] for d in ranks]
    assert max(per) < 1.01 * one["embedding_weights"] / 64  # every table row-wise: balanced
    for d in ranks:  # row-wise Adagrad: one fp32 accumulator per row
        assert d["embedding_optimizer"] == (d["table_rows"] + 1) * 4
        assert d["dense_weights_grads_optimizer"] == 4 * 4 * t.dense_params  # Adam: weight, grad, 2 states


def test_unpooled_exchange_counts_rows_per_id():
    cfg = hstu.HSTUConfig(tables=hstu.tiny_tables(64, 24), table_dim=8, max_seq_len=32)
    t = _tables(cfg)
    gbs, gpus = 8, 2
    ranks = rank_bytes(t, 100, 2, True, gbs, gpus)
    own = gbs // gpus * sum(t.hots)  # each rank's own lookups, at the longest sample
    # Every lookup of the global batch lands on exactly one owner.
    landed = [d["embedding_gradient"] / (2 * (t.dim * 4 + 8)) for d in ranks]
    assert sum(landed) == pytest.approx(gbs * sum(t.hots))
    for d, a in zip(ranks, landed, strict=True):
        assert d["exchange"] == pytest.approx((own + a) * (2 * 8 + 2 * 2 * t.dim * 4))
