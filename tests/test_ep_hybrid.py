"""`--parallel ep=2,fsdp=4` on gloo (4 processes) against 1 process: the expert-data-parallel hybrid
(train/parallel.py), two expert-parallel groups of 2 ranks, each expert slice held by 2 ranks, which FSDP2
shards it over (`expert_parallel.shard_expert_replicas`), FSDP2 sharding the rest over all 4.
deepseekv3_671b's small config (MLA, shared expert, dense first layer, MTP, bias balancing): train_loss and
the clipped gradient norm as one process's at rtol 1e-5 over a few steps, every rank holding half the
experts' rows as a quarter of the expert weights; the same from a Hugging Face checkpoint (every rank
reads its shard of its slice) as one process loading it; and bf16 with activation checkpointing near fp32's
losses, the slices' masters fp32."""

import dataclasses
import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_ep_fsdp import TIERS, _close, _train, write_bases

from timetotrain.train.parallel import Plan

pytestmark = pytest.mark.distributed

WORLD, EP, STEPS = 4, 2, 3


def _two_per_micro_batch() -> None:
    """8 sequences: 2 per rank in one micro-batch; one process takes them as 4 micro-batches of 2."""
    bench, tier = TIERS["ds"]
    TIERS["ds"] = (bench, dataclasses.replace(tier, micro_batch_size=2))


def _worker(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    _two_per_micro_batch()
    root = Path(root)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    plan = Plan(fsdp=WORLD, ep=EP)
    try:
        res = {"seed": _train("ds", plan, rank, STEPS), "hf": _train("ds", plan, rank, 2, init=root / "hf")}
        bf16 = dataclasses.replace(plan, precision="bf16", activation_checkpointing=1)
        res["bf16 ac"] = _train("ds", bf16, rank, STEPS)
        torch.save(res, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ep_smaller_than_fsdp_trains_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setitem(TIERS, "ds", TIERS["ds"])  # restored after the test
    _two_per_micro_batch()
    tier = TIERS["ds"][1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    write_bases(tmp_path)
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    one = _train("ds", Plan(), 0, STEPS)
    loaded = _train("ds", Plan(), 0, 2, init=tmp_path / "hf")
    assert one["loss"][-1] < one["loss"][0]
    n_experts = tier.model.n_experts
    for rank in range(WORLD):
        both = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        res = both["seed"]
        assert set(res["n_experts_local"]) == {n_experts // EP}, rank
        # Each rank stores a quarter of the experts: half its slice of half of them.
        assert res["expert_numel"] * WORLD == res["expert_numel_whole"], rank
        _close(both["hf"]["loss"], loaded["loss"])
        # bf16 with checkpointing: the slices gathered in bf16 (also when recomputed), fp32 masters kept.
        bf16 = both["bf16 ac"]
        assert bf16["expert_dtypes"] == ["torch.float32"] and bf16["expert_numel"] == res["expert_numel"]
        _close(bf16["loss"], one["loss"], rtol=2e-2)
        assert bf16["loss"][-1] < bf16["loss"][0]
        _close(res["loss"], one["loss"])
        _close(res["norm"], one["norm"])
        torch.testing.assert_close(torch.tensor(res["bias"]), torch.tensor(one["bias"]), rtol=0, atol=1e-7)
