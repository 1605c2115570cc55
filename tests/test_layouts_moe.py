"""Tensor parallelism for the MoE families (issue 36): gpt_oss_20b under `tp=2,ep=2` (4 ranks: two TP groups
of 2, FSDP2 over the 2 data-parallel ranks, the experts split over them by expert parallelism, one
expert-parallel group per TP index), on gloo against one process through the harness's own build and step
(`train/step.py`), 20 steps: train_loss at rtol 1e-5 and the final trained weights gathered whole.

The small shape keeps what the plan has to get right: alternating sliding-window (8 of 32 tokens, the
blocked band) and full attention, per-head QK-norms (their weight's gradient summed over the TP ranks),
top-2 of 4 experts (the router must pick the same on both TP ranks, the experts' gradients reach the
rank holding them through the all-to-all), the clipping norm over TP shards, FSDP shards and expert slices.
Run as a script (by torchrun) this file is the worker; it writes its losses per rank and rank 0 the
gathered weights."""

import dataclasses
import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_parse_refuses, layout_workers, moe_layout_trained, trained_weights

from timetotrain.models.gpt_oss import GptOssConfig
from timetotrain.spec.registry import get

pytestmark = pytest.mark.distributed

STEPS, GBS, SEQ, WORLD, SPEC = 20, 4, 32, 4, "tp=2,ep=2"
CFG = GptOssConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4, top_k=2, expert_ffn_dim=32,
    vocab_size=256, max_seq_len=SEQ + 1, sliding_window=8, init_std=0.05,
)  # fmt: skip
# Placements of trained parameters: attention cut by TP (and its rows by FSDP2), the QK-norm and router
# whole within a TP group (sharded over FSDP2's ranks only), the experts plain slices of 2 of the 4 experts.
LAYOUT = {
    "layers.0.attn.qkv.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
    "layers.0.attn.proj.weight": "(Shard(dim=0), Shard(dim=1))",
    "layers.0.attn.q_norm.weight": "(Shard(dim=0), Replicate())",
    "layers.1.ffn.router.weight": "(Shard(dim=0),)",
    "layers.1.ffn.experts.w1": "plain",
    "embed.weight": "(Shard(dim=0),)",
}


def tier():
    bench = get("gpt_oss_20b")
    t = bench.tier("tiny")
    data = dataclasses.replace(t.data, seq_len=SEQ)
    return bench, dataclasses.replace(
        t, model=CFG, data=data, global_batch_size=GBS, micro_batch_size=GBS // 2, lr=3e-3, warmup_steps=3,
        max_steps=100,
    )  # fmt: skip


def batches(data_rank: int, data_world: int) -> list[torch.Tensor]:
    """Two random global batches in turn: memorised within 20 steps, so the loss falls."""
    g = torch.Generator().manual_seed(3)
    two = [torch.randint(0, CFG.vocab_size, (GBS, SEQ + 1), generator=g) for _ in range(2)]
    return [two[s % 2].chunk(data_world)[data_rank] for s in range(STEPS)]


def train(plan, rank: int = 0) -> dict:
    """The global train_loss of every step ("losses"), the trained weights gathered whole (every rank
    calls), the placements of the trained parameters, the experts each layer holds here and the first."""
    from timetotrain.train.expert_parallel import expert_slice

    tr, losses, placed = moe_layout_trained(
        *tier(), plan, rank, batches(plan.data_rank(rank), plan.data_parallel)
    )
    experts = [block.ffn.experts.w1.shape[0] for block in tr.bare.layers]
    first = (expert_slice(tr.bare.layers[0].ffn.experts.w1) or (0, 0))[1]
    return {
        "losses": losses, "weights": trained_weights(tr.bare), "placements": placed, "experts": experts,
        "first_expert": first,
    }  # fmt: skip


@functools.cache
def one_process():
    from timetotrain.train import parallel

    return train(parallel.Plan())


@functools.cache
def workers(root: Path) -> tuple[list[dict], dict]:
    return layout_workers(__file__, root, WORLD)


@pytest.mark.slow
def test_tp_ep_trains_as_one_process(tmp_path):
    ranks, weights = workers(tmp_path)
    one = one_process()
    expected, final = one["losses"], one["weights"]
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]  # every rank reports the same global loss
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        assert r["experts"] == [CFG.n_experts // 2] * CFG.n_layers  # EP holds half the experts per rank
    assert one["experts"] == [CFG.n_experts] * CFG.n_layers
    for param, placements in LAYOUT.items():  # the layout is the one named, not a fallback
        assert ranks[0]["placements"][param] == placements, param
    # The TP ranks of a group hold the same expert slice, the data-parallel ranks different ones.
    assert [r["first_expert"] for r in ranks] == [0, 0, 2, 2]
    assert expected[-1] < expected[0] - 0.5  # it trained
    assert weights.keys() == final.keys() and final
    for n, w in final.items():
        torch.testing.assert_close(weights[n], w, rtol=1e-4, atol=1e-6, msg=n)


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = train(parallel.parse(SPEC, world), rank)
    weights = result.pop("weights")
    if rank == 0:
        torch.save(weights, out / "weights.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


# -- the flag, the plan's estimate, the logged degrees, the families without a plan --


@pytest.mark.bad_input
def test_parallel_flag_for_tp_with_ep():
    from timetotrain.mlperf.keys import parallel_keys
    from timetotrain.train import parallel

    plan = parallel.parse("tp=2,ep=2", 4)  # the data-parallel ranks are FSDP2's (train/parallel.py)
    assert (plan.tp, plan.ep, plan.fsdp, plan.dp, plan.data_parallel) == (2, 2, 2, 1, 2) and plan.sharded
    assert [plan.data_rank(r) for r in range(4)] == [0, 0, 1, 1]  # TP peers read the same samples
    assert parallel.parse("tp=2,ep=2,fsdp=4", 8).world == 8
    # The 6.1 disclosure keys carry the degrees of the plan.
    keys = dict(parallel_keys(plan, 1))
    assert (keys["tensor_parallelism"], keys["expert_parallelism"]) == (2, 2)
    assert_parse_refuses(
        [
            ("tp=2,ep=2,dp=2", 4, "tp does not combine with dp"),
            ("tp=2,ep=4", 4, "ep must divide fsdp"),
            ("tp=2,ep=2", 6, "ep must divide fsdp"),
            ("tp=2,ep=2,fsdp=2", 8, "needs 4 processes"),
            ("tp=2,ep=2,dp_replicate=2", 8, "dp_replicate with tp is built without ep and cp"),
        ]
    )


def test_plan_counts_tp_with_ep_per_rank(capsys):
    """`ttt plan gpt_oss_20b --gpus 64 --gpu-mem 80 --parallel tp=2,ep=4` (GBS 32: 32 data-parallel ranks):
    TP halves what it cuts, the attention and the norms, and nothing else: the router is that of
    `ep=4,fsdp=32` on 32 GPUs, and so is the MoE's share of the activations, which every TP rank keeps
    whole; the expert slices (1/4 of the experts) are whole on each rank under tp, where the hybrid shards
    each over its 8 holders (train/parallel.py `Plan.expert_shards`)."""
    from timetotrain.cli import main
    from timetotrain.models.common.layers import attention_matmul_params
    from timetotrain.spec.benchmark import apply_overrides
    from timetotrain.train.memory import expert_params, plan

    bench = get("gpt_oss_20b")
    ref = apply_overrides(bench, bench.tier("reference"), ["global_batch_size=32"])
    cfg = ref.model
    _, rows, _ = plan(bench, ref, 64, 80, "tp=2,ep=4")
    _, hybrid, _ = plan(bench, ref, 32, 80, "ep=4,fsdp=32")
    assert {r.parallel for r in rows} == {"tp=2,ep=4,fsdp=32"}
    cut = cfg.n_layers * (attention_matmul_params(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim))
    cut += cfg.n_layers * (2 * cfg.dim + 2 * cfg.head_dim)  # the block norms and QK-norms
    tokens = cfg.max_seq_len  # micro-batch 1 of one 8,192-token sample on both
    moe_whole = bench.family.tensor_parallel_elements(cfg, 2)
    whole = 16 * expert_params(bench.family, cfg)[0] * (1 / 4 - 1 / 32)  # slices whole, not 1/8 each
    for tp, one in zip(rows, hybrid, strict=True):
        assert (tp.ac, tp.micro_batch) == (one.ac, one.micro_batch)
        assert tp.states == pytest.approx(one.states + whole - 16 * cut / 64)
        if not tp.ac:
            kept = (bench.family.activation_elements(cfg) - moe_whole) * cfg.n_layers * tokens * 2
            assert tp.activations == pytest.approx(one.activations - kept)
            assert tp.activations > one.activations / 2  # the MoE's activations are not cut
    # At 80 GiB the states alone (71.7 GiB: a quarter of the experts' fp32 weights, gradients and moments on
    # every GPU, replicated over the 8 expert-parallel groups) leave no room; at 141 GiB it fits.
    argv = ["plan", "gpt_oss_20b", "--tier", "reference", "--gpus", "64", "--parallel", "tp=2,ep=4"]
    argv += ["--set", "global_batch_size=32", "--json", "--gpu-mem"]
    assert main([*argv, "80"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert {r["parallel"] for r in doc["rows"]} == {"tp=2,ep=4,fsdp=32"}
    assert all(r["total_gib"] > r["states_gib"] > 70 for r in doc["rows"])
    assert main([*argv, "141"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "--parallel tp=2,ep=4,fsdp=32" in doc["suggestion"]["launch"]["command"]
