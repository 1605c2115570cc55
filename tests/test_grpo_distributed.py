"""qwen35_397b_grpo tiny on 2 processes (gloo under torchrun, `--parallel fsdp=2`) against one process.

Each rollout is sampled from its own stream (seeded by the run's seed, the step and its global generation
index: tasks/grpo.py `stream_seed`), so the ranks draw the rollouts one process draws. What data parallelism
must not change is the step: the same rollouts, split across the ranks by whole groups, must give the loss,
the logged figures and the update one process gives over all of them (a group split over ranks:
tests/test_grpo_split.py). So one process replays the 2-process run (`ttt run`): at each step it makes
rank 0's and rank 1's rollouts from its own weights with the ranks' shares (`_Rollouts.rollouts`, the part
of `prepare` that holds no collective where a rank holds whole groups),
joins them into the global batch (the token-level mean's denominator over both) and takes one optimizer
step on it. The logged train_loss and ttt_rollout_stats of every step, and the weights the 2-process run
saved after its last step (`--save-checkpoint`), must equal the replay's: a later step's rollouts come from
the weights of the steps before, so equal steps also mean the two processes' weights stayed the replay's.

FSDP2 rather than DDP: its forwards are collectives, so the ranks decode in lockstep (every step run, only
unfinished rows sampled: the draws the replay's early-stopping decode makes), and the saved weights come
from shards. `dp=2` passes the same test (run by hand with the layout changed; one layout keeps the suite's
time down).
"""

import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import mllog, ttt_command

from timetotrain.data import arithmetic
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.tasks.grpo import rollout_figures
from timetotrain.train.base_model import check_init_base
from timetotrain.train.checkpoint import load_checkpoint
from timetotrain.train.step import build_training

pytestmark = [pytest.mark.distributed, pytest.mark.e2e, pytest.mark.slow]

BENCH = get("qwen35_397b_grpo")
TINY = BENCH.tier("tiny")
STEPS, SEED, WORLD = 3, 5, 2


def _join(parts: list[dict]) -> dict:
    """The ranks' rollouts as one global batch: rows in rank order, completions padded to the longest (padding
    is masked out and, at the end of a causal sequence, changes no earlier position)."""
    width = max(p["tokens"].shape[1] for p in parts)

    def cat(key, value=0.0, extra=0):
        return torch.cat([F.pad(p[key], (0, width - extra - p[key].shape[1]), value=value) for p in parts])

    out = {
        "tokens": cat("tokens", arithmetic.PAD),
        "mask": cat("mask", extra=1),
        "gen_logp": cat("gen_logp", extra=1),
    }
    out.update({k: torch.cat([p[k] for p in parts]) for k in ("adv", "sample_mask")})
    rows = out["adv"].shape[0]
    out["norm"] = sum(p["norm"][0] for p in parts).expand(rows).clone()
    out["rows"] = torch.full((rows,), float(rows))
    return out


def assert_adam_close(got: torch.Tensor, want: torch.Tensor, lr: float, steps: int, name: str) -> None:
    """Weights after `steps` AdamW steps taken two ways agree at fp32 rounding, but for a few elements: Adam
    divides by sqrt(v) + eps, so a gradient near eps (1e-8) has its rounding amplified by up to lr / eps, and
    its update may part by up to its own size (lr a step). Measured on an AMD EPYC (AVX2): 1 element of
    12,800 at 4.2e-6, every other one within 1e-6; on the Xeon none. A real mismatch moves many more."""
    d = (got - want).abs()
    off = int((d > 1e-6 + 1e-5 * want.abs()).sum())
    assert off <= max(1, got.numel() // 1000), (name, off, float(d.max()))
    assert float(d.max()) <= 2 * lr * steps, (name, float(d.max()))


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-problems")
    BENCH.task.data_recipe(TINY, out).call(out)
    return out


def test_two_processes_take_the_step_one_process_takes_over_their_rollouts(problems, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [
        "run",
        BENCH.name,
        "--tier",
        "tiny",
        "--data",
        str(problems),
        "--logdir",
        str(tmp_path),
        "--quiet",
    ]
    argv += ["--seed", str(SEED), "--max-steps", str(STEPS), "--parallel", f"fsdp={WORLD}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ttt_command(*argv, "--save-checkpoint", str(ckpt), nproc=WORLD)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "ttt: error" not in proc.stderr, proc.stderr[-3000:]  # aborted at the cap
    (log,) = (tmp_path / BENCH.name / "tiny").glob("result_*.txt")  # one log, from rank 0
    recs = mllog(log)
    value = {r["key"]: r["value"] for r in recs}
    assert f"fsdp={WORLD}" in value["ttt_parallel"] and value["global_batch_size"] == TINY.global_batch_size
    losses = [r["value"] for r in recs if r["key"] == "train_loss"]
    stats = [r["value"] for r in recs if r["key"] == "ttt_rollout_stats"]
    assert len(losses) == len(stats) == STEPS

    # The replay: one process, the same base and seed, both ranks' rollouts at every step.
    cpu = torch.device("cpu")
    base = check_init_base(BENCH, TINY, None)
    torch.manual_seed(SEED)
    tr = build_training(BENCH, TINY, cpu, SEED, init_checkpoint=base.folder)
    res = BENCH.task.resolve(TINY, problems, verify=False)
    ranks = [
        BENCH.task.open(TINY, res, SEED, Share.of(TINY.global_batch_size, r, WORLD), cpu)
        for r in range(WORLD)
    ]
    one = BENCH.task.open(
        TINY, res, SEED, Share.of(TINY.global_batch_size), cpu
    )  # the loss of one process over the global batch
    accum = TINY.global_batch_size // TINY.micro_batch_size
    for step in range(STEPS):
        parts = [d.rollouts(tr.bare, d.batch(step)) for d in ranks]
        # Whole groups per rank, the ranks' prompts disjoint: together, the prompts one process would take.
        assert torch.equal(torch.cat([d.batch(step)["index"] for d in ranks]), one.batch(step)["index"])
        sums = sum(d.step_sums() for d in ranks)
        loss, _, *_ = tr.step(step, _join(parts), accum, one.loss, sums=sums).tolist()
        assert loss == pytest.approx(losses[step], rel=1e-5, abs=1e-7), step
        assert stats[step] == pytest.approx(rollout_figures(sums.tolist()), abs=1e-6), step
    saved = BENCH.family.build(TINY.model)
    load_checkpoint(ckpt, saved, None)
    ours = dict(tr.bare.named_parameters())
    for name, p in saved.named_parameters():
        assert_adam_close(p.detach(), ours[name].detach(), TINY.lr, STEPS, name)
    assert any(s["reward"] > 0 for s in stats)  # the steps had a gradient to take
