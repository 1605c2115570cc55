"""Pipeline with tensor and expert parallelism, `pp=2,tp=2,ep=2,fsdp=2` on 8 gloo ranks: two stages of four
ranks, each stage two TP groups of 2 (attention cut, the MoE whole on whole tokens) over 2 data-parallel ranks
that FSDP2 shards the rest over and that split the experts (one expert-parallel group per TP index), against
one process through the harness's own build and step, gpt_oss_20b and deepseekv3_671b at the small shapes of
tests/test_layouts_pp_moe.py, 20 steps of 2 micro-batches: every step's global train_loss at rtol 1e-5, the
first batch's gradients and the trained weights gathered whole, the routers' balancing biases. DeepSeek puts
its MTP block on the last stage, its embedded inputs carried across the boundary as each TP rank's sequence
shard, and an MoE layer's aux loss on the first. Run as a script (by torchrun) this file is the worker; both
models in one launch."""

import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_trains_as_one_process, layout_results_written, layout_workers
from test_layouts_pp_moe import MODELS, assemble, one_process, train

pytestmark = pytest.mark.distributed

WORLD, SPEC = 8, "pp=2,tp=2,ep=2,fsdp=2"
REDUCE = {"gpt_oss_20b": "stage"}  # (the worker's tier: see `_worker`)


@functools.cache
def workers(root: Path) -> tuple[list[dict], dict]:
    return layout_workers(__file__, root, WORLD)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts_pp_ep_tp")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_with_tensor_and_expert_parallelism_trains_as_one_process(root, name):
    ranks, weights = workers(root)
    one = one_process(name)
    assert_trains_as_one_process(ranks, weights, name, one["losses"], one["weights"])
    grads = weights[f"{name} gradients"]
    assert grads.keys() == one["grads"].keys()
    for n, g in one["grads"].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=f"gradient of {n}")
    if one["bias"] is not None:
        for r in ranks:
            torch.testing.assert_close(
                torch.tensor(r[f"{name} bias"]), torch.tensor(one["bias"]), rtol=0, atol=1e-7
            )
    # The layout is the one named: attention (and DeepSeek's shared expert) cut by TP and sharded by FSDP2,
    # experts plain slices.
    placed = ranks[0][f"{name} placements"]
    attn = "layers.0.attn.qkv.weight" if name == "gpt_oss_20b" else "layers.0.attn.q_up.weight"
    assert placed[attn] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    if name != "gpt_oss_20b":
        assert placed["layers.1.ffn.shared.fc1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert (
        placed["layers.0.ffn.experts.w1" if name == "gpt_oss_20b" else "layers.1.ffn.experts.w1"] == "plain"
    )


def _worker(out: Path) -> None:
    import dataclasses

    import test_layouts_pp_moe
    import torch.distributed as dist

    from timetotrain.train import parallel

    # gpt_oss_20b with every wrap of a stage reduced and resharded per micro-batch (`--set pp_reduce=stage`,
    # train/pipeline_reduce.py), DeepSeek at the default (`experts`, which under tp, the slices whole, is
    # torch's schedule as `step`): the one-process run has no such setting.
    small = test_layouts_pp_moe.tier

    def tier(name: str = "deepseekv3_671b"):
        bench, t = small(name)
        return bench, dataclasses.replace(t, pp_reduce=REDUCE.get(name, t.pp_reduce))

    test_layouts_pp_moe.tier = tier

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = parallel.parse(SPEC, world)
    assert (plan.pp, plan.tp, plan.ep, plan.fsdp) == (2, 2, 2, 2)
    results, weights = {}, {}
    for name in MODELS:
        got = train(name, plan, rank)
        # The wraps reduced per micro-batch: every one of the stage's under `stage`, none under `experts`
        # (no slice is sharded under tp).
        per_micro = got.pop("training").model.schedule._stage.per_micro
        assert (len(per_micro) > 0) == (name in REDUCE), (name, per_micro)
        results[name] = got["losses"]
        results[f"{name} bias"] = got["bias"]
        results[f"{name} placements"] = got["placements"]
        for kind, key in (("weights", name), ("grads", f"{name} gradients")):
            every = [None] * world
            dist.all_gather_object(every, got[kind])
            weights[key] = assemble(every)
    layout_results_written(out, results, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


@pytest.mark.bad_input
def test_pipeline_with_tensor_and_expert_parallelism_flags():
    from conftest import assert_parse_refuses

    from timetotrain.train import parallel

    plan = parallel.parse("pp=2,tp=2,ep=2", WORLD)  # a stage's data-parallel ranks: world / (pp x tp)
    assert (plan.pp, plan.tp, plan.ep, plan.fsdp, plan.data_parallel) == (2, 2, 2, 2, 2)
    assert [plan.coords(r)["tp"] for r in range(WORLD)] == [0, 1] * 4
    assert parallel.parse("pp=4,tp=2,ep=32,fsdp=64", 512).world == 512
    assert_parse_refuses(
        [
            ("pp=2,tp=2,ep=4,fsdp=6", 24, "ep must divide fsdp"),
            ("pp=2,tp=2,ep=2,vpp=2", WORLD, r"built as pp=P\[,tp=T\],ep=E\[,fsdp=N\] only"),
            ("pp=2,tp=2,ep=4", WORLD, "needs 16 processes"),
        ]
    )
