"""Checkpoints of embedding tables (train/table_checkpoint.py) across rank counts, on gloo.

hstu's unpooled tables under `dp=2` (every table row-wise over the ranks), built in the harness's order and
trained 2 steps with the optimizer pair (Adam on the dense part, row-wise Adagrad on the tables), are saved;
one process loads them and holds every rank's rows, their accumulators and the dense weights and Adam state
bit for bit. The other way, a one-process checkpoint loaded under `dp=2` gives each rank exactly its rows
and accumulators, and each rank reads those rows and no others. dlrm_dcnv2's pooled bags take the same path
(table-wise and row-wise shards, element-wise Adagrad, a padding row), both ways. Damaged or mismatched
checkpoints are refused in one line naming the file.

Run as a script (by `forked.run_ranks`) this file is the worker: it asserts and exits non-zero on a
mismatch, and leaves each rank's state in safetensors files for the test to compare."""

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import free_port
from forked import run_ranks
from safetensors.torch import load_file, save_file
from test_dlrm_dcnv2_distributed import CFG as DLRM_CFG
from test_dlrm_dcnv2_distributed import _batch as _dlrm_batch
from test_hstu_tables_parallel import CFG, _batch, _slice

from timetotrain.errors import UserError
from timetotrain.models import dlrm_dcnv2 as dl
from timetotrain.models import hstu
from timetotrain.train import checkpoint as ckpt
from timetotrain.train import parallel, table_checkpoint
from timetotrain.train.adagrad import SparseAdagrad
from timetotrain.train.checkpoint import load_checkpoint, save_checkpoint
from timetotrain.train.embedding_parallel import local_spans, place, shard_embeddings
from timetotrain.train.optim import OptimizerPair, set_lr

pytestmark = pytest.mark.distributed

STEPS = 2
DLRM_SPLIT = 50  # tables 0, 3 and 7 row-wise over the ranks, the others whole on one


def _pair(model) -> OptimizerPair:
    return OptimizerPair(
        torch.optim.Adam(hstu.dense_parameters(model), lr=1e-3, betas=(0.95, 0.999), eps=1e-8),
        SparseAdagrad(hstu.table_parameters(model), lr=0.05, rowwise=True),
    )


def _train(call, model, opt, batches) -> None:
    for batch in batches:
        opt.zero_grad()
        model.loss(call(batch), batch).backward()
        opt.step()


def _hstu(seed: int) -> hstu.HSTU:
    model = hstu.HSTU(CFG)
    hstu.init(model, torch.Generator().manual_seed(seed))
    return model


def _sharded_hstu(seed: int, world: int):
    """The harness's order (tests/test_hstu_tables_parallel.py): meta build, shard, fill, DDP."""
    plan = parallel.Plan(dp=world)
    with torch.device("meta"):
        model = hstu.HSTU(CFG)
    parallel.shard_tables_before_fill(model, plan)
    model.to_empty(device="cpu")
    hstu.init(model, torch.Generator().manual_seed(seed))
    wrapped, _ = parallel.apply(model, plan, torch.device("cpu"), hstu.FAMILY)
    return model, wrapped


def _dlrm(seed: int) -> dl.DLRMDCNv2:
    model = dl.DLRMDCNv2(DLRM_CFG)
    dl.init(model, torch.Generator().manual_seed(seed))
    model.embedding.fill_buffers()
    return model


def _dlrm_step(model, opt, dense, sparse, labels) -> None:
    """One Adagrad step on the tables alone (the dense part stays at its init, equal on every rank)."""
    opt.zero_grad()
    F.binary_cross_entropy_with_logits(model(dense, sparse), labels).backward()
    opt.step()


def _state(model, *opts) -> dict:
    """Every weight of `model` and tensor of its optimizers' state, by name, for a bitwise comparison."""
    out = {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    for opt in opts:
        for p, st in opt.state.items():
            name = next(n for n, q in model.named_parameters() if q is p)
            out |= {f"state/{name}/{k}": v for k, v in st.items() if torch.is_tensor(v)}
    return {k: v.contiguous().clone() for k, v in out.items()}


def _rows_of(module, name: str, full: dict) -> dict:
    """This rank's rows of the one-process tensors `full` (weight and accumulator of table module `name`)."""
    out = {}
    for key in (f"param/{name}.weight", f"state/{name}.weight/sum"):
        local = []
        for t, (first, end), _ in local_spans(module):
            start = sum(module.table_sizes[:t])
            local.append(full[key][start + first : start + end])
        out[key] = torch.cat(local)
    return out


def _worker(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    read = []  # rows each read of the loads below takes from the files
    real_read = table_checkpoint.read_rows

    def counting(f, dtype, start, shape, first, end):
        read.append(end - first)
        return real_read(f, dtype, start, shape, first, end)

    table_checkpoint.read_rows = counting

    # hstu: 2 steps under dp=2, saved; its state left for the test.
    model, wrapped = _sharded_hstu(5, world)
    opt = _pair(model)
    batches = [_batch(s) for s in range(STEPS)]
    half = [_slice(b, rank * (b.size // world), (rank + 1) * (b.size // world)) for b in batches]
    _train(wrapped, model, opt, half)
    save_checkpoint(out / "hstu_dp2", model, opt, STEPS, {"layout": "dp=2"})
    save_file(_state(model, opt.tables, opt.dense), out / f"hstu_rank{rank}.safetensors")

    # A one-process checkpoint (the test's) into dp=2: each rank gets exactly its rows, and reads no others.
    fresh, _ = _sharded_hstu(9, world)
    fresh_opt = _pair(fresh)
    read.clear()
    assert load_checkpoint(out / "hstu_one", fresh, fresh_opt) == (STEPS, {"layout": "one"})
    local = fresh.embedding.weight.shape[0]
    assert local < CFG.rows and sum(read) == 2 * local, (read, local)  # rows and accumulators, once each
    full = load_file(out / "hstu_one_state.safetensors")
    got = _state(fresh, fresh_opt.tables, fresh_opt.dense)
    want = {k: v for k, v in full.items() if "embedding" not in k} | _rows_of(
        fresh.embedding, "embedding", full
    )
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for k in want:
        assert torch.equal(got[k], want[k]), k

    # dlrm_dcnv2's bags: table-wise and row-wise shards, element-wise Adagrad, both ways.
    sharded = _dlrm(3)
    shard_embeddings(sharded, rank, world, split_rows=DLRM_SPLIT)
    emb_opt = SparseAdagrad([sharded.embedding.weight], lr=0.1)
    dense, sparse, labels = _dlrm_batch(0)
    b = len(labels) // world
    _dlrm_step(
        sharded,
        emb_opt,
        dense[rank * b : (rank + 1) * b],
        sparse[rank * b : (rank + 1) * b],
        labels[rank * b : (rank + 1) * b],
    )
    save_checkpoint(out / "dlrm_dp2", sharded, emb_opt, 1)
    save_file(_state(sharded, emb_opt), out / f"dlrm_rank{rank}.safetensors")
    fresh = _dlrm(4)
    shard_embeddings(fresh, rank, world, split_rows=DLRM_SPLIT)
    fresh_opt = SparseAdagrad([fresh.embedding.weight], lr=0.1)
    load_checkpoint(out / "dlrm_one", fresh, fresh_opt)
    full = load_file(out / "dlrm_one_state.safetensors")
    got = _state(fresh, fresh_opt)
    rows = _rows_of(fresh.embedding, "embedding", full)
    for k, v in rows.items():  # the padding row after this rank's rows stays zero, its accumulator too
        assert torch.equal(got[k][:-1], v) and not got[k][-1].any(), k
    assert all(torch.equal(got[k], full[k]) for k in full if "embedding" not in k)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


@pytest.mark.slow  # two forked gloo ranks: ~3 s on 2 idle cores
def test_tables_load_across_rank_counts_and_damage_is_one_line(tmp_path):
    # One process: hstu trained on the global batches, dlrm's tables one step; saved, their state left.
    model = _hstu(5)
    opt = _pair(model)
    _train(model, model, opt, [_batch(s) for s in range(STEPS)])
    save_checkpoint(tmp_path / "hstu_one", model, opt, STEPS, {"layout": "one"})
    save_file(_state(model, opt.tables, opt.dense), tmp_path / "hstu_one_state.safetensors")
    dlrm = _dlrm(3)
    emb_opt = SparseAdagrad([dlrm.embedding.weight], lr=0.1)
    _dlrm_step(dlrm, emb_opt, *_dlrm_batch(1))
    save_checkpoint(tmp_path / "dlrm_one", dlrm, emb_opt, 1)
    save_file(_state(dlrm, emb_opt), tmp_path / "dlrm_one_state.safetensors")

    run_ranks(__file__, [str(tmp_path)], 2, free_port())

    # dp=2 -> one process: every rank's rows and accumulators, the dense weights and Adam's state, bitwise.
    ranks = [load_file(tmp_path / f"hstu_rank{r}.safetensors") for r in range(2)]
    files = sorted(p.name for p in (tmp_path / "hstu_dp2").glob("tables-*"))
    assert files == ["tables-00000.safetensors", "tables-00001.safetensors"]  # each rank wrote its rows
    one = _hstu(9)
    one_opt = _pair(one)
    assert load_checkpoint(tmp_path / "hstu_dp2", one, one_opt) == (STEPS, {"layout": "dp=2"})
    _equal_to_ranks(_state(one, one_opt.tables, one_opt.dense), ranks, "embedding", 0)
    set_lr(one_opt, 0.125)  # the load gave both optimizers new param groups: the schedule still reaches them
    assert [g["lr"] for o in (one_opt.dense, one_opt.tables) for g in o.param_groups] == [0.125, 0.125]
    dlrm_ranks = [load_file(tmp_path / f"dlrm_rank{r}.safetensors") for r in range(2)]
    one = _dlrm(4)
    one_opt = SparseAdagrad([one.embedding.weight], lr=0.1)
    load_checkpoint(tmp_path / "dlrm_dp2", one, one_opt)
    _equal_to_ranks(_state(one, one_opt), dlrm_ranks, "embedding", 1, split=DLRM_SPLIT, dlrm=True)

    _damage_is_one_line(tmp_path / "hstu_dp2", tmp_path)


def _equal_to_ranks(got: dict, ranks: list, name: str, pad: int, split: int = 0, dlrm: bool = False) -> None:
    """`got` (one process) holds each rank's shards of table module `name` at their global rows (a rank's
    `pad` rows after its shards hold zeros), and every other tensor as each rank has it."""
    sizes = DLRM_CFG.table_sizes if dlrm else CFG.table_sizes
    shards = place(sizes, 2, split)
    for key in (f"param/{name}.weight", f"state/{name}.weight/sum"):
        covered = 0
        for s in shards:
            at = sum(x.rows[1] - x.rows[0] for x in shards if x.rank == s.rank and x.table < s.table)
            n, lo = s.rows[1] - s.rows[0], sum(sizes[: s.table]) + s.rows[0]
            assert torch.equal(got[key][lo : lo + n], ranks[s.rank][key][at : at + n]), (key, s)
            covered += n
        assert covered == sum(sizes) == got[key].shape[0]
        assert all(not r[key][r[key].shape[0] - pad :].any() for r in ranks), key
    for k, v in got.items():
        if f"{name}.weight" not in k:
            assert all(torch.equal(v, r[k]) for r in ranks), k


def _damage_is_one_line(good: Path, tmp: Path) -> None:
    """A damaged or mismatched table record or file: one line naming the file, before anything is read in
    (the preflight of `--init-checkpoint` too, for the record)."""

    def refused(edit, match: str, model=None) -> None:
        bad = tmp / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(good, bad)
        edit(bad)
        with pytest.raises(UserError, match=match) as e:
            load_checkpoint(bad, model or _hstu(0), None)
        assert "\n" not in str(e.value)

    def meta(edit):
        def change(folder):
            doc = json.loads((folder / ckpt.META).read_text())
            edit(doc["tables"]["embedding"])
            (folder / ckpt.META).write_text(json.dumps(doc))

        return change

    def truncate(folder):
        f = folder / "tables-00001.safetensors"
        f.write_bytes(f.read_bytes()[:-8])

    def nan(folder):
        f = folder / "tables-00000.safetensors"
        header, start = table_checkpoint.check_safetensors_layout(f)
        at = start + header["embedding/weight/3"]["data_offsets"][0]
        data = bytearray(f.read_bytes())
        data[at : at + 4] = torch.tensor([float("nan")]).numpy().tobytes()
        f.write_bytes(bytes(data))

    def gap(rec):
        rec["ranges"] = [r for r in rec["ranges"] if not (r[1] == 3 and r[2] == 0)]

    def rewritten(change):  # a file whose tensor differs from what the record says
        def edit(folder):
            f = folder / "tables-00000.safetensors"
            tensors = load_file(f)
            tensors["embedding/weight/2"] = change(tensors["embedding/weight/2"])
            save_file(tensors, f)

        return edit

    refused(truncate, r"tables-00001\.safetensors: not a whole safetensors file")
    refused(nan, r"tables-00000\.safetensors: tensor embedding/weight/3 holds NaN")
    refused(
        rewritten(lambda t: t[1:]),
        r"tables-00000\.safetensors: tensor embedding/weight/2 is \[\d+, 8\], expected",
    )
    refused(rewritten(lambda t: t.double()), r"tensor embedding/weight/2 is F64, the record says F32")
    refused(meta(gap), r"ranges of table 3 do not cover its \d+ rows exactly once")
    refused(meta(lambda rec: rec.update(ranges="all")), r"ranges must be \[file, table, first, end\]")
    refused(lambda f: (f / "tables-00001.safetensors").unlink(), r"tables-00001\.safetensors: missing")
    other = hstu.HSTU(replace(CFG, tables=hstu.tiny_tables(32, 24)))
    refused(lambda f: None, r"in the checkpoint, .* in this model; build the model with the config", other)
    # The preflight of --init-checkpoint reads the record before any log line.
    bad = tmp / "bad"
    shutil.rmtree(bad)
    shutil.copytree(good, bad)
    meta(gap)(bad)
    with pytest.raises(UserError, match="do not cover"):
        ckpt.check_init_source(bad, hstu.FAMILY)
