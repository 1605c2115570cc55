"""Pipeline with expert slices sharded over their holders, `pp=2,ep=2,fsdp=4` on 8 gloo ranks (two stages of
four ranks; each stage's experts split over 2 ranks, each slice sharded by FSDP2 over its 2 holders), against
one process through the harness's own build and step, gpt_oss_20b at the small shape of
tests/test_layouts_pp_moe.py, 20 steps of 2 micro-batches: every step's global train_loss at rtol 1e-5 and
the trained weights gathered whole.

With it, what `--set pp_reduce=experts` (the default, train/pipeline_reduce.py) changes: after every
micro-batch's backward each expert slice's wrap is resharded and holds its gradient as a shard only (torch's
schedule alone would keep the slice gathered and its gradient whole until the step's last micro-batch).
Run as a script (by torchrun) this file is the worker."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_trains_as_one_process, layout_results_written, layout_workers
from test_layouts_pp_moe import GPT_OSS, SEQ, assemble, whole

from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss

pytestmark = pytest.mark.distributed

NAME, STEPS, GBS, WORLD, SPEC = "gpt_oss_20b", 20, 8, 8, "pp=2,ep=2,fsdp=4"


def tier():
    """The tiny tier at the small shape, two micro-batches of one sample per data-parallel rank (of 4)."""
    bench = get(NAME)
    tiny = bench.tier("tiny")
    shape = dict(model=GPT_OSS, data=dataclasses.replace(tiny.data, seq_len=SEQ), global_batch_size=GBS)
    return bench, dataclasses.replace(
        tiny, **shape, micro_batch_size=1, lr=3e-3, warmup_steps=3, max_steps=100
    )


def expert_wraps_state(stage) -> list[tuple[bool, bool, bool]]:
    """(resharded, gradient whole, gradient sharded) of every expert parameter FSDP2 shards in `stage`."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    from timetotrain.models.common.moe import MoE

    out = []
    for m in stage.modules():
        if isinstance(m, MoE) and isinstance(m.experts, FSDPModule):
            for group in m.experts._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    unsharded = getattr(p, "_unsharded_param", None)
                    held = p.unsharded_accumulated_grad is not None or (
                        unsharded is not None and unsharded.grad is not None
                    )
                    out.append(
                        (p.sharded_state == ShardedState.SHARDED, held, p.sharded_param.grad is not None)
                    )
    return out


def train(plan, rank: int = 0) -> dict:
    from timetotrain.train.step import build_training

    bench, t = tier()
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    accum = GBS // plan.data_parallel // t.micro_batch_size
    two = torch.randint(0, 128, (2, GBS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    mine = [two[s % 2].chunk(plan.data_parallel)[plan.data_rank(rank)] for s in range(STEPS)]
    fn = lambda m, b: lm_loss(m, b["tokens"], None)  # noqa: E731
    losses = [tr.step(s, {"tokens": b}, accum, fn)[0].item() for s, b in enumerate(mine)]
    return {"losses": losses, "weights": whole(tr.bare, grads=False)}


@pytest.mark.slow
def test_sharded_expert_slices_reduce_per_micro_batch_and_train_as_one_process(tmp_path):
    from timetotrain.train import parallel

    ranks, weights = layout_workers(__file__, tmp_path, WORLD)
    one = train(parallel.Plan())
    assert_trains_as_one_process(ranks, weights, NAME, one["losses"], assemble([one["weights"]]))
    for r in ranks:
        # Every micro-batch's backward (the warm-up step's and the first step's, 2 each) left every expert
        # slice resharded with its gradient a shard, none whole.
        assert len(r["after_backward"]) == 4 and all(r["after_backward"]), r["after_backward"]
        assert all(state == [True, False, True] for seen in r["after_backward"] for state in seen)


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel
    from timetotrain.train.pipeline_reduce import ReducingStage

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = []
    backward = ReducingStage.backward_maybe_with_nosync

    def spied(self, *args, **kwargs):
        result = backward(self, *args, **kwargs)
        if len(seen) < 4:
            seen.append([list(s) for s in expert_wraps_state(self.submod)])
        return result

    ReducingStage.backward_maybe_with_nosync = spied
    trained = train(parallel.parse(SPEC, world), rank)
    every = [None] * world
    dist.all_gather_object(every, trained["weights"])
    results = {NAME: trained["losses"], "after_backward": seen}
    layout_results_written(out, results, {NAME: assemble(every)})


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


@pytest.mark.bad_input
def test_pp_reduce_names_its_choices():
    from timetotrain.errors import UserError
    from timetotrain.spec.benchmark import apply_overrides, validate

    bench = get(NAME)
    assert apply_overrides(bench, bench.tier("tiny"), ["pp_reduce=stage"]).pp_reduce == "stage"
    with pytest.raises(UserError, match=r"--set pp_reduce=block: choose one of experts, stage, step") as e:
        validate(bench, apply_overrides(bench, bench.tier("tiny"), ["pp_reduce=block"]))
    assert "\n" not in str(e.value)
