"""deepseek_v3 under expert parallelism on gloo: `ep=2` (2 ranks, 8 experts each) trains as 1 process.

Both go through the harness's own build and step (`train/step.py`: the MTP and sequence aux losses, clipping
by the global norm, and the router bias update from loads summed over the ranks), one process with two
micro-batches, two ranks with one each, so the same per-micro-batch means are taken."""

import dataclasses
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import small_deepseek_v3

from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss
from timetotrain.train.parallel import Plan
from timetotrain.train.step import build_training

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test reads the gloo runs' fixture

BENCH = get("deepseekv3_671b")
WORLD, STEPS = 2, 6
CFG = small_deepseek_v3()
TIER = dataclasses.replace(
    BENCH.tier("tiny"), model=CFG, data=dataclasses.replace(BENCH.tier("tiny").data, seq_len=32), global_batch_size=8, micro_batch_size=4, lr=1e-2, warmup_steps=1,
    max_steps=50, base=None,
)  # fmt: skip


def _batches():
    # One batch, seen every step: the loss then falls, so the comparison is of a model that trains.
    tokens = torch.randint(0, CFG.vocab_size, (8, 33), generator=torch.Generator().manual_seed(1))
    return [tokens] * STEPS


def _loss(model, batch):
    return lm_loss(model, batch["tokens"], None)


def _train(plan: Plan, rank: int) -> dict:
    tr = build_training(BENCH, TIER, torch.device("cpu"), seed=3, plan=plan)
    losses = []
    for step, tokens in enumerate(_batches(), start=1):
        local = tokens.chunk(plan.world)[rank]
        out = tr.step(
            step, {"tokens": local}, TIER.global_batch_size // plan.world // TIER.micro_batch_size, _loss
        )
        losses.append(out[0].item())
    bias = torch.stack([r.bias for r in tr.bare.routers()]).tolist()
    return {"loss": losses, "bias": bias}


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        res = {"ep": _train(Plan(dp=WORLD, ep=WORLD), rank)}
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds-ep")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=True)
        torch.set_num_threads(1)
        single = _train(Plan(), 0)
    return single, [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


def test_ep2_train_loss_equals_one_process(results):
    single, ranks = results
    one = torch.tensor(single["loss"], dtype=torch.float64)
    assert one[-1] < one[0]  # it trains
    for res in ranks:
        two = torch.tensor(res["ep"]["loss"], dtype=torch.float64)
        torch.testing.assert_close(two, one, rtol=1e-5, atol=0)
        # the balancing biases moved, identically on every rank and as in one process
        bias = torch.tensor(res["ep"]["bias"])
        assert bias.abs().sum() > 0
        torch.testing.assert_close(bias, torch.tensor(single["bias"]), rtol=0, atol=1e-7)
