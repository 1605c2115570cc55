"""HSDP with expert parallelism (issue 36): gpt_oss_20b under `dp_replicate=2,fsdp=2,ep=2` (4 ranks: two
replicas of a 2-rank FSDP2 shard group; the experts split over the 2 ranks of a shard group, each slice
held by one rank per replica, whose gradients `average_expert_replicas` averages), on gloo against one
process through the harness's own build and step, 20 steps: train_loss at rtol 1e-5 and the final trained
weights gathered whole. The shape is tests/test_layouts_moe.py's, one sample per micro-batch (4 data-parallel
ranks share a global batch of 4). Run as a script (by torchrun) this file is the worker."""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
from conftest import (
    assert_trains_as_one_process,
    layout_results_written,
    layout_workers,
    moe_layout_trained,
    trained_weights,
)
from test_layouts_moe import batches
from test_layouts_moe import tier as moe_tier

pytestmark = pytest.mark.distributed

WORLD, SPEC, NAME = 4, "dp_replicate=2,fsdp=2,ep=2", "hsdp_ep"
# The rest replicated over the first mesh dimension and sharded over the second, the experts plain slices.
LAYOUT = {
    "layers.0.attn.qkv.weight": "(Replicate(), Shard(dim=0))",
    "layers.1.ffn.router.weight": "(Replicate(), Shard(dim=0))",
    "layers.1.ffn.experts.w1": "plain",
}


def tier():
    bench, t = moe_tier()
    return bench, dataclasses.replace(t, micro_batch_size=1)


def train(plan, rank: int = 0) -> dict:
    from timetotrain.train.expert_parallel import expert_slice

    tr, losses, placed = moe_layout_trained(
        *tier(), plan, rank, batches(plan.data_rank(rank), plan.data_parallel)
    )
    first = (expert_slice(tr.bare.layers[0].ffn.experts.w1) or (0, 0))[1]
    return {NAME: losses, "weights": trained_weights(tr.bare), "placements": placed, "first_expert": first}


@functools.cache
def one_process():
    from timetotrain.train import parallel

    return train(parallel.Plan())


@pytest.mark.slow
def test_hsdp_ep_trains_as_one_process(tmp_path):
    ranks, weights = layout_workers(__file__, tmp_path, WORLD)
    one = one_process()
    for param, placements in LAYOUT.items():  # the layout is the one named, not a fallback
        assert ranks[0]["placements"][param] == placements, param
    # Consecutive ranks of a shard group split the experts; each replica holds both slices.
    assert [r["first_expert"] for r in ranks] == [0, 2, 0, 2]
    assert_trains_as_one_process(ranks, weights, NAME, one[NAME], one["weights"])


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    result = train(parallel.parse(SPEC, dist.get_world_size()), dist.get_rank())
    layout_results_written(out, result, {NAME: result.pop("weights")})


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
