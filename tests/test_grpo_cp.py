"""qwen35_397b_grpo tiny under context parallelism (`--parallel cp=2`, 2 gloo ranks) against one process,
through the harness's own build, rollouts (`prepare`) and step (`train/step.py`), from the shipped base.

Under `cp=2` there is one data-parallel rank: both CP ranks decode the whole global batch's prompts with the
data rank's generator, the first rank's rollouts are handed to the other (`SequenceGroup.from_first`), and
the logprob check and the training step run each sequence in two head-tail parts (`completion_logprob_parts`)
with the TIS and logprob-check row sums and the loss summed over the pair. One process draws the same
rollouts from the same weights, so every step must match: the global train_loss (rtol 1e-5), every
ttt_rollout_stats figure (reward, completion length, zero-std groups, truncated, dropped: the logprob
check's drops included), the pass@k of an eval after the last step, and the final weights.

The rollouts' lengths vary by step (prompt 7 + up to 5 completion tokens, less one: 7 to 11 positions), so
most batches do not cut into 4 chunks and are padded (`ContextParallel.per_token`). Run as a script (by
torchrun) this file is the worker."""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import grpo_layout_worker, grpo_problems, grpo_trained, layout_run

from timetotrain.models.qwen3_5_moe.generate import generate
from timetotrain.spec.registry import get
from timetotrain.tasks.grpo import GRPO
from timetotrain.tasks.rollout import TorchRollout

pytestmark = pytest.mark.distributed

STEPS, SEED, EVAL = 4, 5, 16


class Skewed(TorchRollout):
    """The benchmark's engine, its reported log-probabilities moved as a sampler that rounds otherwise
    would move them, so that the row statistics the loss reads over whole sequences decide something: each
    completion token's by +-0.004 in turn (a row's TIS geometric mean over all its tokens stays within
    [0.999, 1.002], over a part of them often not), and every fourth row's first token by 1.2 (its mean
    exp|gen - prev| over 4-5 tokens stays under the logprob check's 2, over 2 tokens not)."""

    def generate(self, *args, **kwargs):
        completions, lps = super().generate(*args, **kwargs)
        out = []
        for i, lp in enumerate(lps):
            d = torch.tensor([0.004 * (-1) ** t for t in range(len(lp))])
            if i % 4 == 0 and len(lp):
                d[0] = 1.2
            out.append(lp + d)
        return completions, out


BENCH = dataclasses.replace(get("qwen35_397b_grpo"), task=GRPO(Skewed(generate)))
# The tier as it runs, with a short eval (16 problems x 4 generations) after the last step.
TINY = dataclasses.replace(BENCH.tier("tiny"), eval_samples=EVAL)
BY_WORLD = {2: ["cp2"]}
SPECS = {"cp2": "cp=2"}


@functools.cache  # the one-process run, once per session
def train(plan, rank: int, problems: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Every step's global train_loss and rollout figures, the eval's pass@k, and the trained weights
    gathered whole (every rank calls)."""
    from timetotrain.train import parallel
    from timetotrain.train.base_model import check_init_base
    from timetotrain.train.step import build_training

    torch.manual_seed(SEED)
    cpu = torch.device("cpu")
    base = check_init_base(BENCH, TINY, None)
    tr = build_training(BENCH, TINY, cpu, SEED, plan, init_checkpoint=base.folder)
    res = BENCH.task.resolve(TINY, problems, verify=False)
    data = BENCH.task.open(TINY, res, SEED, parallel.batch_share(TINY.global_batch_size, plan, rank), cpu)
    accum = TINY.global_batch_size // TINY.micro_batch_size
    start = {n: p.detach().clone() for n, p in tr.bare.named_parameters()}
    grads: dict[str, torch.Tensor] = {}
    step_with = tr.opt.step

    def keep_first_grads(*args, **kwargs):  # the first step's (clipped) gradients, before the update
        if not grads:
            grads.update({n: whole(p.grad) for n, p in tr.bare.named_parameters() if p.grad is not None})
        return step_with(*args, **kwargs)

    tr.opt.step = keep_first_grads
    result = grpo_trained(tr, data, STEPS, accum)
    weights = {n: whole(p) for n, p in tr.bare.named_parameters()}
    result["moved"] = sum(int((w != start[n]).sum()) for n, w in weights.items())  # (unsharded plans)
    return result, {"weights": weights, "grads": grads}


def whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def problems_in(folder: Path) -> Path:
    return grpo_problems(BENCH, TINY, folder)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_grpo_under_cp_trains_as_one_process(tmp_path_factory, name):
    from timetotrain.train.parallel import Plan

    root = tmp_path_factory.getbasetemp() / "grpo_cp"
    ranks, weights = layout_run(__file__, root, BY_WORLD, name)
    expected, final = train(Plan(), 0, problems_in(root))
    for r in ranks:
        got = r[name]
        torch.testing.assert_close(
            torch.tensor(got["loss"]), torch.tensor(expected["loss"]), rtol=1e-5, atol=0
        )
        for a, b in zip(got["stats"], expected["stats"], strict=True):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
        assert got["pass"] == expected["pass"]
    assert any(s["reward"] > 0 for s in expected["stats"]) and expected["moved"]  # it trained
    # The first step's gradients, each tensor at 5e-5 of its largest element (seen: 2.4e-5, DeltaNet's decay
    # parameters A_log and dt_bias of layer 1, whose recurrence cp composes chunk by chunk: another rounding
    # of the same sums, 4e-9 absolute on the smallest gradients of the model, 1.9e-4 at most; every other
    # tensor within 4e-6).
    for n, g in final["grads"].items():
        got = weights[name]["grads"][n]
        torch.testing.assert_close(got, g, rtol=0, atol=5e-5 * float(g.abs().max()), msg=n)
    # The final weights: Adam divides by sqrt(v) + eps, so an element whose gradient is near 0 (rounding
    # its sign) moves by up to lr a step either way; seen on 0.1% of the elements (DeltaNet's in_proj),
    # each within lr. Every other element at rtol 1e-4.
    off = total = 0
    for n, w in final["weights"].items():
        got = weights[name]["weights"][n]
        torch.testing.assert_close(got, w, rtol=0, atol=TINY.lr, msg=n)
        off += int(((got - w).abs() > 1e-6 + 1e-4 * w.abs()).sum())
        total += w.numel()
    assert off <= total // 200, (off, total)


def _worker(out: Path) -> None:
    grpo_layout_worker(out, BY_WORLD, SPECS, train, BENCH, TINY)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
