"""Tensor with expert parallelism for the MoE families beyond gpt_oss (issue 36): deepseekv3_671b (MLA,
dense-first layer, group-limited router with its balancing bias, shared expert, MTP) and qwen35_397b_grpo's
model (a Gated DeltaNet layer, then a gated attention one, gated shared expert; trained as a causal LM with
llama31_8b's task, as tests/test_layouts_cp.py does) under `tp=2,ep=2` on 4 gloo ranks (two TP groups of 2,
FSDP2 over the 2 data-parallel ranks, the experts split over them, one expert-parallel group per TP index),
against one process through the harness's own build and step, 20 steps: every step's global train_loss at
rtol 1e-5 and every trained weight gathered whole, with the placements asserted.

The small shapes keep what the plans have to get right: 2 attention heads (one per TP rank) whose MLA
down-projections are replicated and whose one rotary key is read by both ranks' heads (its gradient summed
over TP); a dense SwiGLU layer cut column/row-wise, and so the shared experts (their outputs summed over
TP, Qwen's sigmoid gate replicated); DeltaNet with 2 key heads serving 4 value heads, its
fused input projection and short convolution cut by heads (unequal parts stacked per rank), its per-head
decay parameters sharded and its gated norm's weight shared by the heads (gradient summed over TP); top-2 of
4 experts routed on whole tokens. Run as a script (by torchrun) this file is the worker, both models in one
launch."""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import layout_results_written, layout_workers, moe_layout_trained, trained_weights

from timetotrain.models.common.layers import YarnScaling
from timetotrain.models.deepseek_v3 import DeepSeekV3Config
from timetotrain.models.qwen3_5_moe import Qwen35MoeConfig
from timetotrain.spec.registry import get

pytestmark = pytest.mark.distributed

STEPS, GBS, SEQ, WORLD, SPEC = 20, 4, 16, 4, "tp=2,ep=2"
DEEPSEEK = DeepSeekV3Config(
    dim=32, n_layers=2, n_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8,
    v_head_dim=8, ffn_dim=48, n_experts=4, top_k=2, expert_ffn_dim=16, n_groups=2, topk_groups=1,
    first_dense=1, vocab_size=128, max_seq_len=SEQ + 1, bias_rate=1e-2, init_std=0.05, mtp_layers=1,
    rope_scaling=YarnScaling(factor=4.0, original_max_position=8),
)  # fmt: skip
QWEN = Qwen35MoeConfig(
    dim=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=8, lin_k_heads=2, lin_v_heads=4, lin_k_dim=8,
    lin_v_dim=6, n_experts=4, top_k=2, expert_ffn_dim=16, shared_ffn_dim=16, vocab_size=128,
    max_seq_len=SEQ + 1, full_attention_interval=2,
)  # fmt: skip
MODELS = {"deepseekv3_671b": DEEPSEEK, "qwen": QWEN}
# Placements of trained parameters: TP-cut weights (Shard over tp, FSDP2's _StridedShard over it), the
# replicated ones sharded over FSDP2's ranks only, the experts plain slices.
LAYOUT = {
    "deepseekv3_671b": {
        "layers.0.attn.q_down.weight": "(Shard(dim=0),)",
        "layers.0.attn.kv_norm.weight": "(Shard(dim=0),)",
        "layers.0.attn.q_up.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.0.attn.kv_up.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.0.attn.proj.weight": "(Shard(dim=0), Shard(dim=1))",
        "layers.0.attn_norm.weight": "(Shard(dim=0), Replicate())",
        "layers.0.ffn.fc1.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.0.ffn.fc2.weight": "(Shard(dim=0), Shard(dim=1))",
        "layers.1.ffn.router.weight": "(Shard(dim=0),)",
        "layers.1.ffn.shared.fc1.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.1.ffn.shared.fc2.weight": "(Shard(dim=0), Shard(dim=1))",
        "mtp.0.block.ffn.shared.fc1.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.1.ffn.experts.w1": "plain",
        "mtp.0.eh_proj.weight": "(Shard(dim=0),)",
        "mtp.0.block.attn.kv_up.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "mtp.0.block.ffn.experts.w2": "plain",
    },
    "qwen": {
        "layers.0.attn.in_proj.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.0.attn.conv_weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.0.attn.A_log": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.0.attn.norm.weight": "(Shard(dim=0), Replicate())",
        "layers.0.attn.out_proj.weight": "(Shard(dim=0), Shard(dim=1))",
        "layers.1.attn.qkv.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.1.attn.q_norm.weight": "(Shard(dim=0), Replicate())",
        "layers.1.attn.o_proj.weight": "(Shard(dim=0), Shard(dim=1))",
        "layers.1.ffn.shared.gate.weight": "(Shard(dim=0),)",
        "layers.0.ffn.shared.ffn.fc1.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "layers.1.ffn.shared.ffn.fc2.weight": "(Shard(dim=0), Shard(dim=1))",
        "layers.1.ffn.experts.w1": "plain",
    },
}
# The final weights' absolute tolerance (seen: DeepSeek 1.2e-7, Qwen 6.6e-7 at the DeltaNet layer's input
# side, whose small gradients Adam scales up; a weight whose gradient misses its other TP rank's part is off by
# ~1e-3).
WEIGHT_ATOL = 1e-5


def tier(name: str):
    bench = get("llama31_8b" if name == "qwen" else name)
    if name == "qwen":
        from timetotrain.models.qwen3_5_moe import FAMILY

        bench = dataclasses.replace(bench, family=FAMILY)
    t = bench.tier("tiny")
    return bench, dataclasses.replace(
        t, model=MODELS[name], data=dataclasses.replace(t.data, seq_len=SEQ), global_batch_size=GBS,
        micro_batch_size=GBS // 2, lr=3e-3, warmup_steps=3, max_steps=100, base=None,
    )  # fmt: skip


def batches(data_rank: int, data_world: int) -> list[torch.Tensor]:
    """Two random global batches in turn: memorised within 20 steps, so the loss falls."""
    two = torch.randint(0, 128, (2, GBS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return [two[s % 2].chunk(data_world)[data_rank] for s in range(STEPS)]


def train(name: str, plan, rank: int = 0) -> dict:
    """The global train_loss of every step, the trained weights gathered whole (every rank calls), the
    placements of the trained parameters."""
    mine = batches(plan.data_rank(rank), plan.data_parallel)
    tr, losses, placed = moe_layout_trained(*tier(name), plan, rank, mine)
    return {"losses": losses, "weights": trained_weights(tr.bare), "placements": placed, "model": tr.bare}


@functools.cache
def one_process(name: str) -> dict:
    """One process's run, on one thread as each rank runs (OMP_NUM_THREADS=1): on a loaded 2-core host two
    threads took 36-50 s here against 1 s."""
    from timetotrain.train import parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = train(name, parallel.Plan())
        del out["model"]
        return out
    finally:
        torch.set_num_threads(threads)


@functools.cache
def workers(root: Path) -> tuple[list[dict], dict]:
    return layout_workers(__file__, root, WORLD)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts_moe_tp")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_tp_ep_trains_as_one_process(root, name):
    every, all_weights = workers(root)
    ranks, weights = [r[name] for r in every], all_weights[name]
    one = one_process(name)
    expected, final = one["losses"], one["weights"]
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]  # every rank reports the same global loss
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
    for param, placements in LAYOUT[name].items():  # the layout is the one named, not a fallback
        assert ranks[0]["placements"][param] == placements, param
    assert expected[-1] < expected[0] - 0.5  # it trained
    assert weights.keys() == final.keys() and final
    for n, w in final.items():
        assert weights[n].shape == w.shape, n
        torch.testing.assert_close(weights[n], w, rtol=1e-4, atol=WEIGHT_ATOL, msg=n)


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel
    from timetotrain.train.checkpoint import save_checkpoint

    dist.init_process_group("gloo")
    results, weights = {}, {}
    for name in MODELS:
        results[name] = train(name, parallel.parse(SPEC, dist.get_world_size()), dist.get_rank())
        weights[name] = results[name].pop("weights")
        # The model alone (optimizer state under EP is refused), its stacked rows recorded for the reader.
        save_checkpoint(out / name, results[name].pop("model"), None, STEPS)
    layout_results_written(out, results, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_tp_ep_checkpoint_reads_into_one_process(root, name):
    """The checkpoint the `tp=2,ep=2` ranks wrote (the fused rows stacked per TP rank, Qwen's in unequal
    parts; the expert slices) reads into one process as the trained model, bit for bit."""
    from timetotrain.train import parallel
    from timetotrain.train.step import build_training

    _, all_weights = workers(root)
    one = build_training(*tier(name), torch.device("cpu"), 8, parallel.Plan(), init_checkpoint=root / name)
    loaded = dict(one.bare.named_parameters())
    assert loaded.keys() == all_weights[name].keys()
    for n, w in all_weights[name].items():
        torch.testing.assert_close(loaded[n].detach(), w, rtol=0, atol=0, msg=n)


# -- the shape checks, the task that decodes, the plan's count --


@pytest.mark.bad_input
def test_tp_shape_checks_and_decoding_task_refuse_in_one_line():
    from timetotrain.errors import UserError
    from timetotrain.train.memory import plan

    deepseek, qwen = get("deepseekv3_671b").family, get("qwen35_397b_grpo").family
    with pytest.raises(
        UserError,
        match=r"^--parallel tp=4: n_heads 2 \(layers.\*.attn.q_up.weight\) and ffn_dim 50 .* and the shared "
        r"experts' width 18 \(layers.\*.ffn.shared.fc1.weight\) of the model do not divide by 4$",
    ):
        deepseek.tensor_parallel_check(dataclasses.replace(DEEPSEEK, ffn_dim=50, expert_ffn_dim=18), 4)
    with pytest.raises(
        UserError, match=r"^--parallel tp=4: n_kv_heads 2 .* and lin_k_heads 2 .* do not divide by 4$"
    ):
        qwen.tensor_parallel_check(QWEN, 4)
    with pytest.raises(
        UserError, match=r"^--parallel tp=2: shared_ffn_dim 17 \(layers.\*.ffn.shared.ffn.fc1"
    ):
        qwen.tensor_parallel_check(dataclasses.replace(QWEN, shared_ffn_dim=17), 2)
    deepseek.tensor_parallel_check(DEEPSEEK, 2), qwen.tensor_parallel_check(QWEN, 2)  # these divide
    # GRPO decodes its rollouts through the model, which the TP plans do not cut (training only).
    bench = get("qwen35_397b_grpo")
    with pytest.raises(
        UserError, match="this task decodes rollouts, which the qwen3_5_moe tensor-parallel plan"
    ):
        plan(bench, bench.tier("reference"), 512, 141, "tp=2,ep=64")


def test_plan_counts_deepseek_tp_with_ep_per_rank():
    """`ttt plan deepseekv3_671b --gpus 1024 --parallel tp=2,ep=256`: TP halves what it cuts (MLA's
    up-projections and output, the dense-first FFNs, the shared experts, the block norms) and nothing else:
    the rest (the latent down-projections, routers, embedding, head, MTP projections) is that of
    `ep=256,fsdp=512` on 512 GPUs, where each rank's data-parallel share is the same; the expert slices are
    1/256 of the experts there and here, but whole under tp, where the hybrid shards each over its 2
    holders (train/parallel.py `Plan.expert_shards`)."""
    from timetotrain.train.memory import expert_params, plan

    bench = get("deepseekv3_671b")
    ref = bench.tier("reference")
    cfg = ref.model
    _, rows, _ = plan(bench, ref, 1024, 141, "tp=2,ep=256")
    _, hybrid, _ = plan(bench, ref, 512, 141, "ep=256,fsdp=512")
    assert {r.parallel for r in rows} == {"tp=2,ep=256,fsdp=512"}
    H, layers = cfg.n_heads, cfg.n_layers + cfg.mtp_layers
    heads = cfg.q_lora_rank * H * cfg.qk_head_dim + cfg.kv_lora_rank * H * (cfg.qk_nope_dim + cfg.v_head_dim)
    cut = (
        layers * (heads + H * cfg.v_head_dim * cfg.dim + 2 * cfg.dim)
        + cfg.first_dense * 3 * cfg.dim * cfg.ffn_dim
        + (layers - cfg.first_dense) * cfg.n_shared_experts * 3 * cfg.dim * cfg.expert_ffn_dim
    )
    whole = 16 * expert_params(bench.family, cfg)[0] * (1 / 256 - 1 / 512)  # a slice whole, not half
    for tp, one in zip(rows, hybrid, strict=True):
        assert (tp.ac, tp.micro_batch) == (one.ac, one.micro_batch)
        assert tp.states == pytest.approx(one.states + whole - 16 * cut / 1024)
        assert one.activations / 2 < tp.activations < one.activations  # the MoE's activations are not cut
