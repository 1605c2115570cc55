"""hstu's unpooled tables under `--parallel dp=2` (train/embedding_parallel.ShardedEmbedding) on gloo against
one process: the harness's order (meta build, `parallel.shard_tables_before_fill`, `to_empty`, the family's
init, `parallel.apply`), then steps of forward, backward, row-wise Adagrad on the tables and Adam on the
dense part. The global loss of each step at rtol 1e-5 (fp32), every row of each rank's shards and every
dense weight after the steps equal one process's, the rows no batch looked up bit for bit; each rank holds
its shard's rows and their Adagrad state only. Every table splits row-wise over the ranks (unpooled tables
always do: train/embedding_parallel.UNPOOLED_SPLIT_ROWS).

Run as a script (by `forked.run_ranks`) this file is the worker: it asserts and exits non-zero on a
mismatch."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from forked import run_ranks

from timetotrain.models import hstu
from timetotrain.train import parallel
from timetotrain.train.adagrad import SparseAdagrad
from timetotrain.train.embedding_parallel import ShardedEmbedding, place, rank_rows

pytestmark = pytest.mark.distributed

STEPS, GBS, CANDIDATES = 6, 4, 2
CFG = hstu.HSTUConfig(
    tables=hstu.tiny_tables(64, 24), table_dim=8, dim=16, heads=2, linear_dim=8, qk_dim=6, layers=1,
    preprocessor_hidden=10, max_seq_len=64, input_dropout=0.0, linear_dropout=0.0, mlp_hidden=12,
    position_buckets=16, time_buckets=24,
)  # fmt: skip


def _batch(step: int) -> hstu.HSTUBatch:
    """GBS samples with CANDIDATES candidates each (so each rank's local mean loss averages to the global
    one), the first of each rank's half with the longest history (HSTU's attention divides by the batch's
    longest sequence, as the reference's does: equal on every rank, a rank's samples score as in the global
    batch); ids from the first 3/4 of each table, so the last quarter is never looked up."""
    rng = np.random.default_rng(step)
    hist = [10 if i % (GBS // 2) == 0 else int(rng.integers(2, 10)) for i in range(GBS)]
    samples = hstu.synthetic_samples(CFG, hist, [CANDIDATES] * GBS, seed=step, id_share=0.75)
    return hstu.collate(samples, CFG.features)


def _train(call, model, batches):
    tables = SparseAdagrad(hstu.table_parameters(model), lr=0.05, rowwise=True)
    dense = torch.optim.Adam(hstu.dense_parameters(model), lr=1e-3, betas=(0.95, 0.999), eps=1e-8)
    losses = []
    for batch in batches:
        tables.zero_grad()
        dense.zero_grad()
        loss = model.loss(call(batch), batch)
        loss.backward()
        tables.step()
        dense.step()
        losses.append(loss.detach())
    return losses, tables


def _worker() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [_batch(s) for s in range(STEPS)]
    whole = hstu.HSTU(CFG)
    hstu.init(whole, torch.Generator().manual_seed(5))
    start = whole.embedding.weight.detach().clone()
    looked_up = torch.zeros(CFG.rows, dtype=torch.bool)
    for b in batches:
        for ids, t in ((b.contextual_ids, whole.contextual_tables), (b.uih_ids, whole.sequence_tables)):
            looked_up[whole.embedding.rows(ids, t).reshape(-1)] = True
        looked_up[whole.embedding.rows(b.candidate_ids, whole.sequence_tables).reshape(-1)] = True
    expected, _ = _train(whole, whole, batches)

    plan = parallel.Plan(dp=world)
    with torch.device("meta"):
        model = hstu.HSTU(CFG)
    parallel.shard_tables_before_fill(model, plan)
    model.to_empty(device="cpu")
    hstu.init(model, torch.Generator().manual_seed(5))
    shard = model.embedding
    assert isinstance(shard, ShardedEmbedding)
    local_rows = rank_rows(place(CFG.table_sizes, world, 0), world)[rank]
    assert shard.weight.shape[0] == local_rows < CFG.rows  # this rank's rows only
    wrapped, _ = parallel.apply(model, plan, torch.device("cpu"), hstu.FAMILY)
    mine = [b.size // world for b in batches]
    local = [_slice(b, rank * m, (rank + 1) * m) for b, m in zip(batches, mine, strict=True)]
    losses, tables = _train(wrapped, model, local)
    assert tables.state[shard.weight]["sum"].shape == (local_rows,)  # Adagrad state of the own rows only

    for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
        dist.all_reduce(got)
        torch.testing.assert_close(got / world, want, rtol=1e-5, atol=0, msg=f"loss of step {step}")
    never = 0
    for s, at in shard._local_starts():
        lo = whole.embedding.starts[s.table] + s.rows[0]
        n = s.rows[1] - s.rows[0]
        got, want = shard.weight.detach()[at : at + n], whole.embedding.weight.detach()[lo : lo + n]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"table {s.table} rows {s.rows}")
        untouched = ~looked_up[lo : lo + n]
        assert torch.equal(got[untouched], start[lo : lo + n][untouched]), f"table {s.table} rows {s.rows}"
        never += int(untouched.sum())
    assert never > 0, "every row was looked up: nothing shows that the others stay"
    ref = dict(whole.named_parameters())
    for name, p in model.named_parameters():
        if not name.startswith("embedding."):
            torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    dist.destroy_process_group()


def _slice(b: hstu.HSTUBatch, first: int, end: int) -> hstu.HSTUBatch:
    """Samples [first, end) of a collated batch."""
    uih = torch.cat([b.uih_lengths.new_zeros(1), b.uih_lengths.cumsum(0)])
    cand = torch.cat([b.num_candidates.new_zeros(1), b.num_candidates.cumsum(0)])
    u, c = slice(int(uih[first]), int(uih[end])), slice(int(cand[first]), int(cand[end]))
    return hstu.HSTUBatch(
        b.uih_lengths[first:end], b.num_candidates[first:end], b.contextual_ids[first:end], b.uih_ids[u],
        b.uih_actions[u], b.uih_timestamps[u], b.candidate_ids[c], b.candidate_actions[c], b.query_times[c],
    )  # fmt: skip


if __name__ == "__main__":
    _worker()


@pytest.mark.slow  # two forked gloo ranks, each also training the one-process model: ~5 s
def test_sharded_tables_train_as_one_process():
    run_ranks(__file__, [], 2, free_port())
