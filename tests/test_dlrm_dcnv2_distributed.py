"""dlrm_dcnv2 scale-out on gloo: `--parallel dp=2` (dense DDP, model-parallel tables, all-to-all of the
pooled rows) logs the same train_loss as one process over 20 steps at rtol 1e-5; the sharded embedding
with row-wise splits forced equals the whole table, forward, gradient and three Adagrad steps; the
placement puts every row on exactly one rank."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import free_port, ttt_run

from timetotrain.models import dlrm_dcnv2 as dl
from timetotrain.train.adagrad import SparseAdagrad
from timetotrain.train.embedding_parallel import place, rank_rows, shard_embeddings

pytestmark = pytest.mark.distributed


def test_placement_covers_every_row_once():
    sizes = dl.CRITEO_TABLE_SIZES
    shards = place(sizes, 8)
    for t, n in enumerate(sizes):
        ranges = sorted(s.rows for s in shards if s.table == t)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    split = {s.table for s in shards if s.rows != (0, sizes[s.table])}
    assert split == {t for t, n in enumerate(sizes) if n == 40_000_000}  # the five 40M tables, row-wise
    rows = rank_rows(shards, 8)
    assert sum(rows) == sum(sizes) and max(rows) - min(rows) < 4_000_000


CFG = dl.DLRMConfig(
    table_sizes=(300, 7, 3, 120, 11, 2, 5, 90) + (4,) * 18, multi_hot=(3, 1, 2, 5, 1, 1, 2, 4) + (1,) * 18,
    dim=8, bottom=(16, 8), top=(16, 1), dcn_layers=1, dcn_rank=4,
)  # fmt: skip


def _batch(step, n=12):
    g = torch.Generator().manual_seed(step)
    sparse = torch.cat(
        [
            torch.randint(0, r, (n, k), generator=g)
            for r, k in zip(CFG.table_sizes, CFG.multi_hot, strict=True)
        ],
        1,
    ).int()
    return torch.randn(n, 13, generator=g), sparse, (torch.rand(n, generator=g) < 0.3).float()


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    whole = dl.DLRMDCNv2(CFG)
    dl.init(whole, torch.Generator().manual_seed(3))
    sharded = dl.DLRMDCNv2(CFG)
    sharded.load_state_dict(whole.state_dict())
    sharded.embedding.fill_buffers()
    shard_embeddings(sharded, rank, world, split_rows=50)  # tables 0, 3 and 7 row-wise
    emb_whole = SparseAdagrad([whole.embedding.weight], lr=0.1)
    emb_sharded = SparseAdagrad([sharded.embedding.weight], lr=0.1)
    worst = 0.0
    for step in range(3):
        dense, sparse, labels = _batch(step)
        b = len(labels) // world
        mine = slice(rank * b, (rank + 1) * b)
        with torch.no_grad():
            pooled_whole = whole.embedding(sparse)
        emb_whole.zero_grad()
        F.binary_cross_entropy_with_logits(whole(dense, sparse), labels).backward()
        emb_whole.step()
        emb_sharded.zero_grad()
        pooled = sharded.embedding(sparse[mine])
        worst = max(worst, (pooled - pooled_whole[mine]).abs().max().item())
        loss = F.binary_cross_entropy_with_logits(sharded(dense[mine], sparse[mine]), labels[mine])
        loss.backward()  # the dense grads are not reduced here: only the tables are compared
        emb_sharded.step()
        shard = sharded.embedding
        for s in shard.shards:
            if s.rank != rank:
                continue
            rows = whole.embedding.table_rows(s.table)
            ref = whole.embedding.weight.data[rows.start + s.rows[0] : rows.start + s.rows[1]]
            at = sum(x.rows[1] - x.rows[0] for x in shard.shards if x.rank == rank and x.table < s.table)
            got = shard.weight.data[at : at + s.rows[1] - s.rows[0]]
            worst = max(worst, (got - ref).abs().max().item())
    (out / f"{rank}.json").write_text(json.dumps({"worst": worst, "tables": shard.tables_of}))
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned gloo processes: ~18 s
def test_sharded_tables_with_row_wise_splits_equal_the_whole_table(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), tmp_path), nprocs=2, join=True)
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert all(r["worst"] < 1e-6 for r in res), res
    tables = res[0]["tables"]
    assert {0, 3, 7} <= set(tables[0]) & set(tables[1])  # split tables live on both ranks


def _losses(path):
    out = []
    for line in path.read_text().splitlines():
        if ":::MLLOG" in line:
            rec = json.loads(line.split(":::MLLOG ", 1)[1])
            if rec["key"] == "train_loss":
                out.append(rec["value"])
    return out


@pytest.mark.slow
def test_dp2_train_loss_equals_one_process_for_20_steps(tmp_path, criteo_tiny):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def ttt(*argv, nproc=1):
        return ttt_run(*argv, nproc=nproc, env=env)

    made, data = criteo_tiny  # conftest's, shared with tests/test_dlrm_dcnv2_tiny.py
    assert made.returncode == 0, made.stderr
    common = ["run", "dlrm_dcnv2", "--tier", "tiny", "--data", str(data), "--seed", "7", "--max-steps",
              "20", "--quiet"]  # fmt: skip
    one = ttt(*common, "--logdir", str(tmp_path / "one"))
    two = ttt(*common, "--logdir", str(tmp_path / "two"), "--parallel", "dp=2", nproc=2)
    a = _losses(tmp_path / "one" / "dlrm_dcnv2" / "tiny" / "result_0.txt")
    b = _losses(tmp_path / "two" / "dlrm_dcnv2" / "tiny" / "result_0.txt")
    assert len(a) == len(b) == 20, (one.stderr[-1500:], two.stderr[-1500:])
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=0)
