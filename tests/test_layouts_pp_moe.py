"""Pipeline with expert parallelism (train/pipeline_moe.py): deepseekv3_671b and gpt_oss_20b under `pp=2,ep=2` on 4 gloo ranks
(two stages, each sharded by FSDP2 over its two ranks, which split its MoE layers' experts), against one
process through the harness's own build and step, 20 steps: every step's global train_loss at rtol 1e-5, the
first batch's gradients and the trained weights gathered whole, the routers' balancing biases, and an
evaluation forward-only through the stages.

The small shape keeps what the layout has to get right: a dense first layer and MoE layers split over the
stages by their cost (one MoE layer on the first stage, whose aux loss must reach the backward and the
logged loss from there), MLA, top-2 of 4 experts in 2 groups, the sequence aux loss, the auxiliary-loss-free
bias (its loads summed per stage), and MTP on the last stage (its inputs embedded on the first and carried
across the boundary). gpt_oss_20b: sliding-window and full layers alternating, top-2 of 4 experts, one layer
per stage. Run as a script (by torchrun) this file is the worker; both layouts in one launch."""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_parse_refuses, first_backward, layout_results_written, layout_workers

from timetotrain.models.common.layers import YarnScaling
from timetotrain.models.deepseek_v3 import DeepSeekV3Config
from timetotrain.models.gpt_oss import GptOssConfig
from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss

pytestmark = pytest.mark.distributed

STEPS, GBS, SEQ, WORLD, SPEC = 20, 4, 16, 4, "pp=2,ep=2"
DEEPSEEK = DeepSeekV3Config(
    dim=32, n_layers=3, n_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8,
    v_head_dim=8, ffn_dim=48, n_experts=4, top_k=2, expert_ffn_dim=16, n_groups=2, topk_groups=1,
    first_dense=1, vocab_size=128, max_seq_len=SEQ + 1, bias_rate=1e-2, init_std=0.05, mtp_layers=1,
    rope_scaling=YarnScaling(factor=4.0, original_max_position=8),
)  # fmt: skip
GPT_OSS = GptOssConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4, top_k=2, expert_ffn_dim=16,
    vocab_size=128, max_seq_len=SEQ + 1, sliding_window=8, init_std=0.05,
)  # fmt: skip
MODELS = {"deepseekv3_671b": DEEPSEEK, "gpt_oss_20b": GPT_OSS}
# Where parameters live: (global ranks holding them, placements). Stage 0: ranks 0-1, stage 1: ranks 2-3.
LAYOUT = {
    "gpt_oss_20b": {
        "embed.weight": ([0, 1], "(Shard(dim=0),)"),
        "layers.0.ffn.experts.w2": ([0, 1], "plain"),
        "layers.1.attn.qkv.weight": ([2, 3], "(Shard(dim=0),)"),
        "layers.1.ffn.experts.w1": ([2, 3], "plain"),
        "head.weight": ([2, 3], "(Shard(dim=0),)"),
    }
}
LAYOUT["deepseekv3_671b"] = {
    "embed.weight": ([0, 1], "(Shard(dim=0),)"),
    "layers.0.ffn.fc1.weight": ([0, 1], "(Shard(dim=0),)"),
    "layers.1.ffn.experts.w1": ([0, 1], "plain"),
    "layers.2.ffn.router.weight": ([2, 3], "(Shard(dim=0),)"),
    "mtp.0.block.ffn.experts.w2": ([2, 3], "plain"),
    "head.weight": ([2, 3], "(Shard(dim=0),)"),
}


def tier(name: str = "deepseekv3_671b"):
    """The benchmark's tiny tier at the small shape: micro-batches of one sample, a high LR."""
    bench = get(name)
    tiny = bench.tier("tiny")
    shape = dict(model=MODELS[name], data=dataclasses.replace(tiny.data, seq_len=SEQ), global_batch_size=GBS)
    return bench, dataclasses.replace(
        tiny, **shape, micro_batch_size=1, lr=3e-3, warmup_steps=3, max_steps=100
    )


def batches(data_rank: int, data_world: int) -> list[torch.Tensor]:
    """Two random global batches in turn (memorised within 20 steps, so the loss falls); this rank's part."""
    two = torch.randint(0, 128, (2, GBS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return [two[step % 2].chunk(data_world)[data_rank] for step in range(STEPS)]


def whole(model, grads: bool) -> dict:
    """This rank's parameters (or their gradients): DTensors gathered over their stage's ranks (a TP plan's
    stacked rows put back), expert slices as (first expert, rows) for rank 0 to put together; another
    stage's (meta) left out."""
    from torch.distributed.tensor import DTensor

    from timetotrain.train.expert_parallel import expert_slice
    from timetotrain.train.tensor_parallel import unstack

    out = {}
    for n, p in model.named_parameters():
        if p.device.type == "meta":
            continue
        t = p.grad if grads else p
        t = (unstack(t.full_tensor(), p) if isinstance(t, DTensor) else t).detach().clone()
        out[n] = (expert_slice(p)[1], t) if expert_slice(p) else (0, t)
    return out


def assemble(parts: list[dict]) -> dict[str, torch.Tensor]:
    """The ranks' `whole` parts as whole tensors: expert slices concatenated in expert order."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for part in parts:
        for n, (first, t) in part.items():
            pieces.setdefault(n, {})[first] = t
    return {n: torch.cat([by[k] for k in sorted(by)]) for n, by in pieces.items()}


def train(name: str, plan, rank: int = 0) -> dict:
    from timetotrain.spec.task import evaluate_ratio
    from timetotrain.train.step import build_training

    bench, t = tier(name)
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    accum = GBS // plan.data_parallel // t.micro_batch_size
    mine = batches(plan.data_rank(rank), plan.data_parallel)
    fn = lambda m, b: lm_loss(m, b["tokens"], None)  # noqa: E731
    # The first batch's gradients (AdamW hardly sees a gradient's scale: expert gradients left summed over
    # the expert-parallel ranks would not show in the weights). Its loads count towards the first bias step
    # in both runs alike.
    first_backward(tr, {"tokens": mine[0]}, accum, fn)
    grads = whole(tr.bare, grads=True)
    tr.opt.zero_grad(set_to_none=True)
    losses = [tr.step(s, {"tokens": b}, accum, fn)[0].item() for s, b in enumerate(mine)]
    figures, _ = bench.family.telemetry(tr.bare)  # every stage's routers, in one process's order
    trained = whole(tr.bare, grads=False)
    placed = {
        n: str(getattr(p, "placements", "plain"))
        for n, p in tr.bare.named_parameters()
        if p.device.type != "meta"
    }

    def sums(model, chunk):  # as the causal LM's Evaluator: loss sum and token count per eval micro-batch
        return model(chunk[:, :-1], labels=chunk[:, 1:], reduction="sum"), chunk[:, 1:].numel()

    metric = evaluate_ratio(tr.model, mine[0].split(1), sums, torch.device("cpu"), plan.data_parallel)
    return {
        "losses": losses + [metric], "grads": grads, "weights": trained, "placements": placed,
        "bias": figures.get("ttt_router_bias"), "tokens": figures["ttt_tokens_per_expert"], "training": tr,
    }  # fmt: skip


@functools.cache
def one_process(name: str) -> dict:
    from timetotrain.train import parallel

    out = train(name, parallel.Plan())
    del out["training"]
    out["grads"], out["weights"] = assemble([out["grads"]]), assemble([out["weights"]])
    return out


@functools.cache
def workers(root: Path) -> tuple[list[dict], dict]:
    return layout_workers(__file__, root, WORLD)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts_pp_moe")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_with_expert_parallelism_trains_as_one_process(root, name):
    every, all_weights = workers(root)
    ranks, weights = [r[name] for r in every], all_weights[name]
    one = one_process(name)
    moe_layers = 3 if name == "deepseekv3_671b" else 2  # (DeepSeek: two main layers and the MTP block)
    expected = one["losses"]
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]  # every rank reports the same global loss
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        # The balancing biases of every MoE layer (main, then MTP), gathered from both stages.
        if one["bias"] is not None:
            torch.testing.assert_close(torch.tensor(r["bias"]), torch.tensor(one["bias"]), rtol=0, atol=1e-7)
        # The last forward's tokens per expert, every stage's layers: two ranks' micro-batches of one
        # sample, top-2.
        assert [sum(row) for row in r["tokens"]] == [2 * SEQ * 2] * moe_layers
    assert expected[-2] < expected[0] - 0.5  # it trained (the last figure is the evaluation's)
    for param, (holders, placements) in LAYOUT[name].items():  # the layout is the one named
        assert [r for r in range(WORLD) if param in ranks[r]["placements"]] == holders, param
        assert ranks[holders[0]]["placements"][param] == placements, param
    for kind in ("grads", "weights"):
        assert weights[kind].keys() == one[kind].keys() and one[kind]
        for n, w in one[kind].items():
            assert weights[kind][n].shape == w.shape, n
            torch.testing.assert_close(weights[kind][n], w, rtol=1e-4, atol=1e-6, msg=f"{kind} of {n}")


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel
    from timetotrain.train.checkpoint import save_checkpoint
    from timetotrain.train.step import build_training

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results, weights = {}, {}
    for name in MODELS:
        plan = parallel.parse(SPEC, world)
        results[name] = train(name, plan, rank)
        # Each stage writes its own entries (the model alone: optimizer state under EP is refused), read
        # back under the same layout.
        save_checkpoint(out / name, results[name].pop("training").bare, None, STEPS)
        back = build_training(*tier(name), torch.device("cpu"), 8, plan, init_checkpoint=out / name)
        results[name]["loaded"] = whole(back.bare, grads=False)
        weights[name] = {}
        for kind in ("grads", "weights", "loaded"):
            every = [None] * world
            dist.all_gather_object(every, results[name].pop(kind))
            weights[name][kind] = assemble(every)
    layout_results_written(out, results, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_with_expert_parallelism_checkpoint_is_the_model(root, name):
    """The checkpoint the stages wrote holds the trained model: read back under `pp=2,ep=2` and into one
    process, every weight is the trained one bit for bit (expert slices put together), and DeepSeek's
    routers get their trained biases."""
    from timetotrain.train import parallel
    from timetotrain.train.step import build_training

    every, all_weights = workers(root)
    trained = all_weights[name]["weights"]
    one = build_training(*tier(name), torch.device("cpu"), 8, parallel.Plan(), init_checkpoint=root / name)
    loaded = {
        "pp=2,ep=2": all_weights[name]["loaded"],
        "one process": assemble([whole(one.bare, grads=False)]),
    }
    for where, got in loaded.items():
        assert got.keys() == trained.keys(), where
        for n, w in trained.items():
            torch.testing.assert_close(got[n], w, rtol=0, atol=0, msg=f"{n} loaded {where}")
    if every[0][name]["bias"] is not None:
        assert one.bare.router_biases().tolist() == every[0][name]["bias"]


def test_split_counts_dense_layers_experts_and_mtp():
    """The split weighs DeepSeek's layers by what a token computes: the dense first layer against top-k
    experts, the head twice (trunk and MTP) and the MTP block on the last stage."""
    from timetotrain.train.pipeline import split_layers, stage_costs

    bench, t = tier()
    costs, head = stage_costs(bench, DEEPSEEK)
    assert costs[0] != costs[1] == costs[2] and head > 2 * DEEPSEEK.dim * DEEPSEEK.vocab_size
    assert split_layers(costs, head, 2) == [(0, 2), (2, 3)]


@pytest.mark.bad_input
def test_pipeline_with_expert_parallelism_flags():
    from timetotrain.errors import UserError
    from timetotrain.train import parallel
    from timetotrain.train.pipeline import check

    plan = parallel.parse(SPEC, 4)  # a stage's data-parallel ranks are FSDP2's
    assert (plan.pp, plan.ep, plan.fsdp, plan.data_parallel) == (2, 2, 2, 2)
    assert parallel.parse("pp=4,ep=32,fsdp=64", 256).world == 256
    assert_parse_refuses(
        [
            ("pp=2,ep=2,dp=2", 8, r"built as pp=P\[,tp=T\],ep=E\[,fsdp=N\] only"),
            ("pp=2,vpp=2,ep=2", 4, r"built as pp=P\[,tp=T\],ep=E\[,fsdp=N\] only"),
            ("pp=2,ep=4", 4, "needs 8 processes"),
            ("pp=2,ep=2", 1, "needs 4 processes"),
            ("pp=2,ep=4,fsdp=6", 12, "ep must divide fsdp"),
            ("pp=2,cp=2,ep=2", 8, "cp with ep is built as cp=C,ep=E with dp or fsdp only"),
        ]
    )
    bench, t = tier()
    assert check(bench, t, plan, 2, 1, True, "--set micro_batch_size") == 1
    for name, spec, world, needle in [
        ("deepseekv3_671b", "pp=2,fsdp=2", 4, "not for deepseekv3_671b without ep"),
        ("qwen35_397b_grpo", SPEC, 4, "no pipeline split yet"),
        ("llama31_8b", SPEC, 4, "llama31_8b has none"),
    ]:
        b = get(name)
        with pytest.raises(UserError, match=needle) as e:
            check(b, b.tier("tiny"), parallel.parse(spec, world), 16, 1, False, "--set micro_batch_size")
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_plan_counts_a_stage_with_its_expert_slices():
    """`ttt plan deepseekv3_671b --gpus 256 --parallel pp=4,ep=32,fsdp=64` estimates it: a stage of about a
    quarter of the layers holds 1/32 of their experts (the rest sharded over its 64 GPUs), so its states
    are about a quarter of those of `ep=32,fsdp=64` over the whole model, plus the stage's non-expert
    gradients whole (the schedule defers FSDP2's reduction)."""
    from timetotrain.train.memory import plan

    bench = get("deepseekv3_671b")
    ref = bench.tier("reference")
    _, rows, _ = plan(bench, ref, 256, 80, "pp=4,ep=32,fsdp=64")
    _, whole_model, _ = plan(bench, ref, 64, 80, "ep=32,fsdp=64")
    assert rows and {r.parallel for r in rows} == {"pp=4,ep=32,fsdp=64"}
    for staged, one in zip(rows, whole_model, strict=True):
        assert one.states / 4 < staged.states < one.states / 2


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_simulate_builds_both_ends_of_the_pipeline(name):
    """`ttt plan --parallel pp=2,ep=2 --simulate` builds and steps the first and the last rank under the fake
    process group (train/simulate.py), at the benchmark's tiny tier: the path `tests/test_plan_builds.py`
    takes for the kinds the search suggests (the search does not try pp with ep)."""
    from timetotrain.train import prepare
    from timetotrain.train.simulate import _in_child, simulate_rank

    bench, t = prepare.resolve_tier(name, "tiny", [])
    t = dataclasses.replace(t, global_batch_size=2 * WORLD, eval_samples=2 * WORLD)
    for rank in (0, WORLD - 1):
        got = _in_child(simulate_rank, bench, t, WORLD, SPEC, rank, "fp32", False)
        assert got.parameters > 0 and got.gradients > 0 and got.optimizer > 0, rank
