"""qwen35_397b_grpo tiny with a group of generations split over data-parallel ranks (`--parallel dp=2`, 2 gloo
ranks) against one process, through the harness's own build, rollouts (`prepare`) and step.

The tier with the reference's 16 generations a prompt, at GBS 16 = one prompt a step: each rank holds 8 of
the group's rollouts (2 micro-batches; one process 4). Each rollout draws from its own stream (seeded by the
run's seed, the step and its global generation index: tasks/grpo.py `stream_seed`), so the two ranks sample
the rollouts one process samples; the ranks gather the group's rewards (`_Rollouts._group_rewards`) and each
computes the leave-one-out mean and std over all 16. So every step must match one process: the global
train_loss (rtol 1e-5), every ttt_rollout_stats figure (the group counted once), the pass@k of an eval after
the last step, and the final weights. Without the gather (each rank's half of the group beside zeros) the
advantages differ: checked by hand, all 4 losses off, by up to 135%.

The sampler's per-row streams themselves: a row's completion does not depend on the rows it is decoded
with, on whether every step is run (`all_steps`, FSDP2's lockstep) or on the decode loop (the cached
`generate` and the cache-free oracle). Run as a script (by torchrun) this file is the worker."""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import grpo_layout_worker, grpo_problems, grpo_trained, layout_run

from timetotrain.models.qwen3_5_moe import Qwen35Moe, init_weights
from timetotrain.models.qwen3_5_moe.generate import generate
from timetotrain.spec.registry import get
from timetotrain.tasks.rollout import naive_generate

pytestmark = pytest.mark.distributed

STEPS, SEED = 4, 2  # a seed whose 4 groups all have rewards that differ (none zero-std)
BENCH = get("qwen35_397b_grpo")
_tiny = BENCH.tier("tiny")
TINY = dataclasses.replace(
    _tiny, data=dataclasses.replace(_tiny.data, generations=16), global_batch_size=16, micro_batch_size=4,
    eval_samples=16,
)  # fmt: skip
BY_WORLD = {2: ["dp2"]}
SPECS = {"dp2": "dp=2"}


@functools.cache  # the one-process run, once per session
def train(plan, rank: int, problems: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Every step's global train_loss and rollout figures, the eval's pass@k, and the trained weights."""
    from timetotrain.train import parallel
    from timetotrain.train.base_model import check_init_base
    from timetotrain.train.step import build_training

    torch.manual_seed(SEED)
    cpu = torch.device("cpu")
    base = check_init_base(BENCH, TINY, None)
    tr = build_training(BENCH, TINY, cpu, SEED, plan, init_checkpoint=base.folder)
    res = BENCH.task.resolve(TINY, problems, verify=False)
    share = parallel.batch_share(TINY.global_batch_size, plan, rank)
    data = BENCH.task.open(TINY, res, SEED, share, cpu)
    accum = share.local // TINY.micro_batch_size
    result = grpo_trained(tr, data, STEPS, accum)
    return result, {n: p.detach().clone() for n, p in tr.bare.named_parameters()}


def problems_in(folder: Path) -> Path:
    return grpo_problems(BENCH, TINY, folder)


@pytest.mark.slow
def test_a_group_split_over_two_ranks_trains_as_one_process(tmp_path_factory):
    from timetotrain.train.parallel import Plan

    root = tmp_path_factory.getbasetemp() / "grpo_split"
    ranks, weights = layout_run(__file__, root, BY_WORLD, "dp2")
    expected, final = train(Plan(), 0, problems_in(root))
    for r in ranks:
        got = r["dp2"]
        torch.testing.assert_close(
            torch.tensor(got["loss"]), torch.tensor(expected["loss"]), rtol=1e-5, atol=0
        )
        for a, b in zip(got["stats"], expected["stats"], strict=True):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
        assert got["pass"] == expected["pass"]
    # The group's rewards differed (non-zero advantages) at every step: its statistics decided each loss.
    assert all(s["zero_std_groups"] == 0 for s in expected["stats"])
    assert all(abs(x) > 1e-3 for x in expected["loss"])
    # Adam divides by sqrt(v) + eps: an element whose gradient is near 0 may part by up to lr a step.
    off = total = 0
    for n, w in final.items():
        got = weights["dp2"][n]
        torch.testing.assert_close(got, w, rtol=0, atol=STEPS * TINY.lr, msg=n)
        off += int(((got - w).abs() > 1e-6 + 1e-5 * w.abs()).sum())
        total += w.numel()
    assert off <= total // 1000, (off, total)


def test_a_rows_own_stream_gives_it_the_same_completion_wherever_it_is_decoded():
    torch.manual_seed(0)
    model = Qwen35Moe(TINY.model)
    init_weights(model, torch.Generator().manual_seed(0))
    prompts = [[1, 5, 6, 2, 7, 3], [1, 9, 4, 2, 8, 3], [1, 5, 6, 2, 7, 3], [1, 2, 2, 2, 3, 3]]

    def streams(rows):
        return [torch.Generator().manual_seed(100 + i) for i in rows]

    kw = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "eos_id": 3}
    every, lps = generate(model, prompts, generator=streams(range(4)), **kw)
    assert any(len(c) < 8 for c in every) and len({tuple(c) for c in every}) > 1  # EOS and rows that differ
    assert generate(model, prompts, generator=streams(range(4)), all_steps=True, **kw)[0] == every
    assert naive_generate(model, prompts, generator=streams(range(4)), **kw)[0] == every
    assert generate(model, prompts[2:], generator=streams(range(2, 4)), **kw)[0] == every[2:]
    for i in range(4):
        alone, lp = generate(model, [prompts[i]], generator=streams([i]), **kw)
        assert alone[0] == every[i]
        torch.testing.assert_close(lp[0], lps[i], rtol=1e-5, atol=1e-6)


def _worker(out: Path) -> None:
    grpo_layout_worker(out, BY_WORLD, SPECS, train, BENCH, TINY)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
