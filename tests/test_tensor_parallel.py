"""Tensor parallelism (train/tensor_parallel.py) on gloo against one process: `--parallel tp=2` (2 ranks)
and `tp=2,fsdp=2` (4 ranks) train a small Llama from the same seed to the same `train_loss` for 20 steps
(rtol 1e-5), for llama31_405b's and llama31_8b's harness; plus the fused layouts' row orders. Under
tp=2,fsdp=2 a random HF `LlamaForCausalLM` with a larger vocabulary, saved in 3 safetensors shards, loads
into the llama31_405b harness with its embedding and head cut to the model's rows: the logits equal HF's on
the kept ids (fp32, 1e-5).

Run as a script (by torchrun) this file is the worker; it writes its losses to a file per rank."""

import dataclasses
import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, small_llama
from forked import run_ranks

from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss

pytestmark = pytest.mark.distributed

STEPS, GBS, SEQ = 20, 4, 32
CFG = small_llama(max_seq_len=SEQ)  # 4 heads / 2 KV heads, FFN 128: both split over 2 ranks
HF_VOCAB = 384  # the checkpoint's rows; the model keeps the first CFG.vocab_size (256)


def tier(name: str):
    bench = get(name)
    t = bench.tier("tiny" if "tiny" in bench.tiers else "reference")
    return bench, dataclasses.replace(
        t, model=CFG, data=dataclasses.replace(t.data, seq_len=SEQ), global_batch_size=GBS, micro_batch_size=GBS, lr=3e-3, end_lr=3e-4, warmup_steps=3,
        max_steps=100,
    )  # fmt: skip


def batches(data_rank: int, data_world: int) -> list[dict]:
    """Two random global batches in turn: memorised within 20 steps, so the loss falls."""
    g = torch.Generator().manual_seed(3)
    two = [torch.randint(0, CFG.vocab_size, (GBS, SEQ + 1), generator=g) for _ in range(2)]
    return [{"tokens": two[s % 2].chunk(data_world)[data_rank]} for s in range(STEPS)]


@functools.cache
def one_process(name: str) -> tuple[float, ...]:
    from timetotrain.train import parallel

    return tuple(train(name, parallel.Plan()))


def train(name: str, plan, rank: int = 0, save: Path | None = None) -> list[float]:
    """The global train_loss of every step; with `save`, the trained model saved there as a checkpoint and,
    by rank 0, its weights gathered whole beside it (`weights.pt`)."""
    from timetotrain.train.checkpoint import save_checkpoint
    from timetotrain.train.step import build_training

    bench, t = tier(name)
    torch.manual_seed(0)
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    data = batches(plan.data_rank(rank), plan.data_parallel)
    losses = [
        tr.step(s, b, 1, lambda m, b: lm_loss(m, b["tokens"], None))[0].item() for s, b in enumerate(data)
    ]
    if save is not None:
        from torch.distributed.tensor import DTensor

        from timetotrain.train.tensor_parallel import unstack

        save_checkpoint(save / "ckpt", tr.bare, None, STEPS)
        whole = {
            n: unstack(p.full_tensor(), p) if isinstance(p, DTensor) else p
            for n, p in tr.bare.named_parameters()
        }
        if rank == 0:
            torch.save({n: w.detach().clone() for n, w in whole.items()}, save / "weights.pt")
    return losses


def run_workers(tmp_path, nproc: int, spec: str) -> list[dict]:
    run_ranks(__file__, [str(tmp_path), spec], nproc, free_port())
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def hf_reference():
    from conftest import random_hf_llama

    return random_hf_llama(dataclasses.replace(CFG, vocab_size=HF_VOCAB))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One torchrun of 4 ranks under tp=2,fsdp=2: the training curve and the loaded checkpoint's logits."""
    root = tmp_path_factory.mktemp("tp_fsdp")
    hf = hf_reference()
    hf.save_pretrained(root / "hf", safe_serialization=True, max_shard_size=200_000)
    assert len(list((root / "hf").glob("*.safetensors"))) == 3
    return run_workers(root, 4, "tp=2,fsdp=2"), hf, root


@pytest.mark.slow
def test_hf_checkpoint_loads_into_tp_fsdp_shards_with_truncated_rows(four_ranks):
    ranks, hf, root = four_ranks
    logits = torch.load(root / "logits.pt")
    assert logits.shape == (2, SEQ, CFG.vocab_size)
    with torch.no_grad():
        expected = hf(tokens()).logits[..., : CFG.vocab_size]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert all(r["load_seconds"] > 0 for r in ranks)


def tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "spec"), [(2, "tp=2"), (4, "tp=2,fsdp=2")])
def test_tensor_parallel_trains_as_one_process(tmp_path, request, nproc, spec):

    ranks = run_workers(tmp_path, nproc, spec) if nproc == 2 else request.getfixturevalue("four_ranks")[0]
    names = ["llama31_405b", "llama31_8b"] if nproc == 2 else ["llama31_405b"]
    for name in names:
        expected = list(one_process(name))
        for r in ranks:
            assert r[name] == ranks[0][name]  # every rank reports the same global loss
            torch.testing.assert_close(torch.tensor(r[name]), torch.tensor(expected), rtol=1e-5, atol=0)
        assert expected[-1] < expected[0] - 0.5  # it trained: a plan that froze weights would not match
    if nproc == 2:
        _a_tp_checkpoint_reads_into_one_process(tmp_path)


def _a_tp_checkpoint_reads_into_one_process(out: Path) -> None:
    """A checkpoint saved under tp=2 holds fc1's rows in the TP-stacked order (train/tensor_parallel.py);
    read into one process they are put back: every weight equals the trained model's, gathered whole."""
    from timetotrain.train.checkpoint import load_checkpoint
    from timetotrain.train.step import build_training

    bench, t = tier("llama31_8b")
    tr = build_training(bench, t, torch.device("cpu"), 1, None)
    load_checkpoint(out / "ckpt", tr.bare, None)
    want = torch.load(out / "weights.pt")
    for n, p in tr.bare.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=0, msg=n)


def test_stacked_rows_round_trip():
    from timetotrain.train.tensor_parallel import STACKED, logical, unstack

    full = torch.arange(16.0).view(8, 2)  # gate rows 0-3, up rows 4-7
    param = torch.nn.Parameter(torch.empty(8, 2))
    setattr(param, STACKED, (2, 2))
    reordered = logical(full, param)
    # rank 0: gate 0-1, up 4-5; rank 1: gate 2-3, up 6-7
    assert reordered[:, 0].tolist() == [0, 2, 8, 10, 4, 6, 12, 14]
    assert torch.equal(unstack(reordered, param), full)
    # Unequal parts named by their rows (qwen3_5_moe's fused [q+gate | k | v]): 4 + 2 + 2 rows, each rank
    # the r-th half of every part.
    setattr(param, STACKED, ((4, 2, 2), 2))
    reordered = logical(full, param)
    assert reordered[:, 0].tolist() == [0, 2, 8, 12, 4, 6, 10, 14]
    assert torch.equal(unstack(reordered, param), full)


def _worker(out: Path, spec: str) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = parallel.parse(spec, world)
    names = ["llama31_405b", "llama31_8b"] if plan.fsdp == 1 else ["llama31_405b"]
    # tp=2 alone: llama31_8b's trained model saved for the one-process read
    results = {name: train(name, plan, rank, out if name == "llama31_8b" else None) for name in names}
    if (out / "hf").is_dir():  # the checkpoint scenario (tp=2,fsdp=2)
        from timetotrain.train.step import build_training

        bench, t = tier("llama31_405b")
        tr = build_training(bench, t, torch.device("cpu"), 7, plan, out / "hf")
        results["load_seconds"] = tr.load_seconds
        with torch.no_grad():
            logits = tr.model(tokens())
        if rank == 0:
            torch.save(logits, out / "logits.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2])


def test_parallel_flag_for_tensor_parallelism():
    from timetotrain.errors import UserError
    from timetotrain.models.llama.parallelize import check_shape
    from timetotrain.train import parallel

    plan = parallel.parse("tp=2,fsdp=2", 4)
    assert (plan.tp, plan.fsdp, plan.world, plan.data_parallel) == (2, 2, 4, 2)
    assert [plan.data_rank(r) for r in range(4)] == [0, 0, 1, 1] and plan.sharded
    assert "tp=2" in plan.describe()
    for spec, world, needle in [
        ("tp=2,dp=2", 4, "tp does not combine with dp"),
        ("tp=2,ep=2", 2, "ep must divide fsdp"),  # (tp with ep: tests/test_layouts_moe.py)
        ("tp=2", 4, "needs 2 processes"),
    ]:
        with pytest.raises(UserError, match=needle):
            parallel.parse(spec, world)
    with pytest.raises(UserError, match="n_kv_heads 2 .* do not divide by 4"):
        check_shape(CFG, 4)


def test_a_family_without_a_plan_refuses_tp():
    # The plan is the family's (ModelFamily.tensor_parallel); flux has none (the decoders and MoE families
    # have one: tests/test_layouts_moe*.py), and the harness says so in one line before it builds a mesh.
    from timetotrain.errors import UserError
    from timetotrain.models import flux
    from timetotrain.train import parallel

    assert flux.FAMILY.tensor_parallel is None
    with pytest.raises(UserError, match="--parallel tp=2: the flux family has no tensor-parallel plan"):
        parallel.apply(torch.nn.Linear(2, 2), parallel.Plan(tp=2), torch.device("cpu"), flux.FAMILY)
