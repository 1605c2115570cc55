"""FSDP2 over more ranks than an MoE model has experts, without expert parallelism: gpt_oss_20b's tiny shape
with 2 experts under `fsdp=4` (4 gloo ranks) trains as one process over 20 steps (train_loss at rtol 1e-5,
the final weights), and each rank holds exactly a quarter of every stacked expert weight: FSDP2 cuts it on
the FFN rows or the model width (train/expert_fsdp.py), not on the experts, where it would give two ranks
an expert each and two an empty shard, all padded to one expert for the gathers. The step clips (a clip
far below the gradient norm), so the global norm over the dim-1 shards must be right; the trained model is
saved by DCP (`save_checkpoint`) and read into one process, whose weights must then equal the run's.

gpt_oss rather than qwen35_397b_grpo (4 tiny experts): both stack their experts in the same
`GroupedExperts` under the same FSDP2 wrap; gpt_oss trains as a causal LM through the harness's own build
and step (tests/conftest.py `moe_layout_trained`'s path), where GRPO would add its rollouts.
Run as a script (by torchrun) this file is the worker; it writes its losses per rank and rank 0 the
gathered weights."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_trains_as_one_process, layout_results_written, layout_workers, trained_weights

from timetotrain.models.gpt_oss import GptOssConfig
from timetotrain.spec.registry import get

pytestmark = pytest.mark.distributed

STEPS, GBS, SEQ, WORLD, SPEC, CLIP = 20, 4, 16, 4, "fsdp=4", 0.05
CFG = GptOssConfig(
    dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=2, top_k=1, expert_ffn_dim=16,
    vocab_size=128, max_seq_len=SEQ + 1, sliding_window=8, init_std=0.05,
)  # fmt: skip


def tier():
    bench = get("gpt_oss_20b")
    t = bench.tier("tiny")
    data = dataclasses.replace(t.data, seq_len=SEQ)
    return bench, dataclasses.replace(
        t, model=CFG, data=data, global_batch_size=GBS, micro_batch_size=1, lr=3e-3, warmup_steps=3,
        max_steps=100,
    )  # fmt: skip


def batches(data_rank: int, data_world: int) -> list[torch.Tensor]:
    """Two random global batches in turn: memorised within 20 steps, so the loss falls."""
    two = torch.randint(0, CFG.vocab_size, (2, GBS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return [two[s % 2].chunk(data_world)[data_rank] for s in range(STEPS)]


def train(plan, rank: int = 0, save: Path | None = None) -> dict:
    """The global train_loss of every step, the trained weights gathered whole (every rank calls), and the
    local and global shapes of the first layer's expert weights; with `save`, a DCP checkpoint there."""
    from torch.distributed.tensor import DTensor

    from timetotrain.tasks.causal_lm import lm_loss
    from timetotrain.train.checkpoint import save_checkpoint
    from timetotrain.train.step import build_training

    bench, t = tier()
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    tr.clip = CLIP  # far below the gradient norm: every step clips
    accum = (t.global_batch_size // plan.data_parallel) // t.micro_batch_size
    losses = [
        tr.step(s, {"ids": b}, accum, lambda m, b: lm_loss(m, b["ids"], None))[0].item()
        for s, b in enumerate(batches(plan.data_rank(rank), plan.data_parallel))
    ]
    if save is not None:
        save_checkpoint(save, tr.bare, tr.opt, STEPS)
    experts = tr.bare.layers[0].ffn.experts
    shapes = {}
    for w in ("w1", "w2"):
        p = getattr(experts, w)
        local = p.to_local() if isinstance(p, DTensor) else p
        # FSDP2's padded storage: what the rank holds (a padded shard's view is short, its storage is not).
        held = local.untyped_storage().nbytes() // local.element_size()
        shapes[w] = {"global": list(p.shape), "local": list(local.shape), "held": held}
    return {"losses": losses, "weights": trained_weights(tr.bare), "experts": shapes}


@pytest.mark.slow
def test_fsdp_over_more_ranks_than_experts_trains_as_one_process(tmp_path):
    from timetotrain.train import parallel
    from timetotrain.train.checkpoint import load_checkpoint
    from timetotrain.train.step import build_training

    ranks, weights = layout_workers(__file__, tmp_path, WORLD)
    one = train(parallel.Plan())
    losses = [{SPEC: r["losses"]} for r in ranks]
    assert_trains_as_one_process(losses, {SPEC: weights}, SPEC, one["losses"], one["weights"])
    for r in ranks:
        for w, shape in r["experts"].items():  # a quarter of the stack each, no padded or empty shard
            numel = torch.Size(shape["global"]).numel()
            assert torch.Size(shape["local"]).numel() * WORLD == numel, (w, shape)
            assert shape["held"] * WORLD == numel, (w, shape)
            assert shape["local"][0] == CFG.n_experts, (w, shape)  # cut within the experts, not across
    # The 4-rank DCP checkpoint, experts saved as their dim-1 shards, read into one process.
    fresh = build_training(*tier(), torch.device("cpu"), 8, parallel.Plan())  # another seed: other weights
    load_checkpoint(tmp_path / "ckpt", fresh.bare, None)
    for n, p in fresh.bare.named_parameters():
        torch.testing.assert_close(p.detach(), weights[n], rtol=0, atol=0, msg=n)


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    result = train(parallel.parse(SPEC, dist.get_world_size()), dist.get_rank(), out / "ckpt")
    weights = result.pop("weights")
    layout_results_written(out, result, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
