"""A rank's share of the data is computed once, by the harness (`train/parallel.batch_share` ->
`spec.task.Share`), and the tasks only read it: the ranks' shares of a global batch tile it exactly once, the
ranks' batches of a step are together the one-process batch, sample for sample, and each way of splitting an
eval set covers it as its reference does. Its micro-batch is settled once too, from the tier's bound
(`Benchmark.micro_batch`, `train/prepare.settle_micro_batch`)."""

import dataclasses
import random
import types

import numpy as np
import pytest
import torch

from timetotrain.data import arithmetic
from timetotrain.errors import UserError
from timetotrain.spec.benchmark import apply_overrides
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.suite import qwen35_397b_grpo as Q
from timetotrain.tasks.answer_sft import _Answers
from timetotrain.tasks.grpo import _Rollouts
from timetotrain.tasks.lora_sft import _Blocks
from timetotrain.tasks.node_classification import GraphData, _Seeds
from timetotrain.train import distributed, parallel, prepare

CPU = torch.device("cpu")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_the_ranks_shares_tile_the_global_batch_once(world):
    gbs = 12
    rows = [
        i
        for r in range(world)
        for s in [Share.of(gbs, r, world)]
        for i in range(s.offset, s.offset + s.local)
    ]
    assert rows == list(range(gbs))


def test_a_batch_that_does_not_split_is_refused():
    with pytest.raises(ValueError):
        Share.of(10, 0, 4)
    with pytest.raises(UserError, match="global_batch_size 10 is not divisible by 4"):
        parallel.batch_share(10, parallel.parse("dp=4", 4))


def test_the_ranks_of_a_tensor_parallel_group_share_one_stream():
    plan = parallel.parse("fsdp=2,tp=2", 4)
    shares = [parallel.batch_share(8, plan, r) for r in range(4)]
    assert shares[0] == shares[1] == Share.of(8, 0, 2) and shares[2] == shares[3] == Share.of(8, 1, 2)
    assert parallel.check_batch_split(8, plan) == 4


@pytest.mark.parametrize("n", [0, 1, 7, 12, 1003])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_eval_split_covers_its_items_as_its_reference(n, world):
    shares = [Share.of(world * 2, r, world) for r in range(world)]
    items = list(range(n))
    # part: contiguous, as even as it goes (Megatron, HF): every item once.
    assert [i for s in shares for i in items[s.part(n)]] == items
    # equal_part: rgat's `val_idx.split(len // world)`: equal, the last n % world in none.
    assert [i for s in shares for i in items[s.equal_part(n)]] == items[: n - n % world]
    # padded_part: DLRM's equal chunks covering every item; past n, the caller pads.
    padded = [i for s in shares for i in s.padded_part(n)]
    assert padded == list(range(len(padded))) and n <= len(padded) < n + world
    # strided: round robin, every item once; padded: as many positions on every rank.
    assert sorted(i for s in shares for i in s.strided(n)) == items
    counts = {len(s.strided(n, padded=True)) for s in shares}
    assert len(counts) == 1 and sorted(i for s in shares for i in s.strided(n, padded=True) if i < n) == items


def _problems(n, seed=0):
    return arithmetic.draw(n, Q.DIGITS, random.Random(seed), kind=Q.KIND)


GBS = 32  # whole GRPO groups of 8 on each of 4 ranks; on 8, half a group each


def _opened(world: int):
    """Each in-memory task's data on every rank of `world`: (name, [RunData], the sample rows of a batch)."""
    train, val = _problems(40), _problems(10, seed=1)
    graph = types.SimpleNamespace(csc={}, num_nodes={"paper": 100})
    ids = np.arange(30 * 5).reshape(30, 5)
    shares = [Share.of(GBS, r, world) for r in range(world)]
    tier = dataclasses.replace(Q.TINY, global_batch_size=GBS)
    return {
        "answer_sft": (
            [_Answers(train, val, 2 * Q.DIGITS + 9, GBS, s, CPU) for s in shares],
            lambda d, k: d.batch(k)["tokens"],
        ),
        "lora_sft": (
            [_Blocks(ids, ids, ids[:7], ids[:7], GBS, s, 3, CPU) for s in shares],
            lambda d, k: d.batch(k)["input_ids"],
        ),
        "node_classification": (
            [
                _Seeds(graph, torch.arange(100, 170), torch.arange(9), GraphData(), GBS, s, 3, CPU)
                for s in shares
            ],
            lambda d, k: d.seeds(k),
        ),
        "grpo": (
            [_Rollouts(tier, train, val, 3, s, CPU, None, None) for s in shares],
            lambda d, k: d.batch(k)["index"],
        ),
    }


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_ranks_batches_of_a_step_are_the_one_process_batch(world):
    one = _opened(1)
    for name, (ranks, rows) in _opened(world).items():
        for step in (0, 1, 5):
            together = torch.cat([rows(d, step) for d in ranks])
            assert torch.equal(together, rows(one[name][0][0], step)), (name, step)


def test_the_micro_batch_is_settled_once_from_the_tiers_bound(tmp_path):
    """`--set global_batch_size` leaves the tier's micro_batch_size as given (a bound); one process runs at
    most its GBS, a rank at most its share, and a task whose batch does not cut (rgat) all of it at once."""
    bench = get("llama31_8b")
    declared = bench.tier("tiny")
    tier = apply_overrides(bench, declared, ["global_batch_size=8"])
    assert tier.micro_batch_size == declared.micro_batch_size > 8
    assert (bench.micro_batch(tier), bench.grad_accum(tier), bench.micro_batch(tier, 4)) == (8, 1, 4)
    ranks = distributed.Dist(rank=1, world=2, local_rank=0)
    prep = prepare.preflight(bench, tier, tmp_path, None, "fp32", 0, False, device="cpu", ranks=ranks)
    assert (prep.share, prep.tier.micro_batch_size, prep.accum) == (Share(1, 2, 4, 4), 4, 1)
    assert dict(prep.hyperparameters)["gradient_accumulation_steps"] == 1
    with pytest.raises(UserError, match="must divide the per-rank batch 4"):
        prepare.settle_micro_batch(bench, tier, prep.plan, 4, given=3)
    rgat = get("rgat")
    gbs = rgat.tier("tiny").global_batch_size
    whole = apply_overrides(rgat, rgat.tier("tiny"), [f"global_batch_size={2 * gbs}"])
    assert (rgat.micro_batch(whole), rgat.micro_batch(whole, gbs)) == (2 * gbs, gbs)
