"""Pipeline parallelism (train/pipeline.py) on gloo against one process through the harness's own build and
step, 20 steps each at a 4-layer llama31_8b shape: the global train_loss at rtol 1e-5, the final trained
weights gathered whole, the first batch's gradients, and an evaluation forward-only through the stages. `pp=2` (1F1B, two stages of two layers), `pp=2,vpp=2` (interleaved 1F1B, four
stages of one layer, two per rank), `pp=2,fsdp=2` and `pp=2,tp=2` (each stage sharded or cut over its own
two ranks). Four micro-batches of one sample per step (two per rank under fsdp=2), as the one process
accumulates them. Run as a script (by torchrun) this file is the worker; it writes its losses per rank
and rank 0 the gathered weights."""

import dataclasses
import functools
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import first_backward, layout_workers, random_hf_llama, small_llama

from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss

pytestmark = pytest.mark.distributed

STEPS, GBS, SEQ = 20, 4, 32
CFG = small_llama(n_layers=4, max_seq_len=SEQ + 1)
SCENARIOS = {"pp": "pp=2", "pp_vpp": "pp=2,vpp=2", "pp_fsdp": "pp=2,fsdp=2", "pp_tp": "pp=2,tp=2"}
BY_WORLD = {2: ["pp", "pp_vpp"], 4: ["pp_fsdp", "pp_tp"]}
CHECKPOINTED = ("pp_vpp", "pp_fsdp")  # saved after training (--save-checkpoint), loaded (--init-checkpoint)
# Where some parameters live: (the pipeline ranks holding it, its placements there).
LAYOUT = {
    "pp": {"embed.weight": ([0], "plain"), "layers.1.ffn.fc1.weight": ([0], "plain"), "head.weight": ([1], "plain")},
    "pp_vpp": {"layers.0.attn.qkv.weight": ([0], "plain"), "layers.1.attn.qkv.weight": ([1], "plain"),
               "layers.2.attn.qkv.weight": ([0], "plain"), "head.weight": ([1], "plain")},
    "pp_fsdp": {"layers.3.attn.qkv.weight": ([2, 3], "(Shard(dim=0),)"), "embed.weight": ([0, 1], "(Shard(dim=0),)")},
    "pp_tp": {"layers.0.attn.qkv.weight": ([0, 1], "(Shard(dim=0),)"), "layers.2.attn.proj.weight": ([2, 3], "(Shard(dim=1),)")},
}  # fmt: skip


def tier():
    bench = get("llama31_8b")
    t = bench.tier("tiny")
    return bench, dataclasses.replace(
        t, model=CFG, data=dataclasses.replace(t.data, seq_len=SEQ), global_batch_size=GBS, micro_batch_size=1,
        lr=3e-3, warmup_steps=3, max_steps=100,
    )  # fmt: skip


def batches(data_rank: int, data_world: int) -> list[torch.Tensor]:
    """Two random global batches in turn: memorised within 20 steps, so the loss falls."""
    g = torch.Generator().manual_seed(3)
    two = [torch.randint(0, CFG.vocab_size, (GBS, SEQ + 1), generator=g) for _ in range(2)]
    return [two[s % 2].chunk(data_world)[data_rank] for s in range(STEPS)]


def train(plan, rank: int = 0):
    """The global train_loss of every step and then an evaluation's metric, this rank's first gradients
    and trained weights gathered whole over its stage's ranks, and their placements."""
    from torch.distributed.tensor import DTensor

    from timetotrain.spec.task import evaluate_ratio
    from timetotrain.train.step import build_training
    from timetotrain.train.tensor_parallel import unstack

    bench, t = tier()
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    accum = GBS // plan.data_parallel // t.micro_batch_size
    mine = batches(plan.data_rank(rank), plan.data_parallel)
    fn = lambda m, b: lm_loss(m, b["tokens"], None)  # noqa: E731
    # The first batch's gradients, before any step: AdamW and clipping hardly see a gradient's scale, so
    # the trained weights alone would not catch micro-batch gradients summed instead of averaged.
    first_backward(tr, {"tokens": mine[0]}, accum, fn)

    def full(t, p):
        return (unstack(t.full_tensor(), p) if isinstance(t, DTensor) else t).detach().clone()

    weights, placed = {}, {}
    for n, p in tr.bare.named_parameters():
        if p.device.type != "meta":  # else another stage's
            weights[f"grad of {n}"] = full(p.grad, p)
    tr.opt.zero_grad(set_to_none=True)
    losses = [tr.step(s, {"tokens": b}, accum, fn)[0].item() for s, b in enumerate(mine)]
    for n, p in tr.bare.named_parameters():
        if p.device.type != "meta":
            weights[n], placed[n] = full(p, p), str(getattr(p, "placements", "plain"))

    def sums(model, chunk):  # as the causal LM's Evaluator: loss sum and token count per eval micro-batch
        return model(chunk[:, :-1], labels=chunk[:, 1:], reduction="sum"), chunk[:, 1:].numel()

    # Evaluation forward-only through the stages, in micro-batches of 3 and a shorter last one.
    metric = evaluate_ratio(tr.model, mine[0].split(3), sums, torch.device("cpu"), plan.data_parallel)
    return losses + [metric], weights, placed, tr


def loaded(plan, path: Path) -> dict[str, torch.Tensor]:
    """This rank's weights of a model built with `--init-checkpoint path`, gathered whole."""
    from torch.distributed.tensor import DTensor

    from timetotrain.train.step import build_training
    from timetotrain.train.tensor_parallel import unstack

    bench, t = tier()
    tr = build_training(bench, t, torch.device("cpu"), 8, plan, init_checkpoint=path)
    return {
        n: (unstack(p.full_tensor(), p) if isinstance(p, DTensor) else p).detach().clone()
        for n, p in tr.bare.named_parameters()
    }


@functools.cache
def one_process():
    from timetotrain.train import parallel

    return train(parallel.Plan())[:3]


@functools.cache
def workers(root: Path, nproc: int) -> tuple[list[dict], dict]:
    return layout_workers(__file__, root, nproc)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts_pp")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pipeline_trains_as_one_process(root, name):
    nproc = next(w for w, names in BY_WORLD.items() if name in names)
    folder = root / str(nproc)
    folder.mkdir(exist_ok=True)
    ranks, weights = workers(folder, nproc)
    expected, final, _ = one_process()
    for r in ranks:
        assert r[name] == ranks[0][name]  # every rank reports the same global loss
        torch.testing.assert_close(torch.tensor(r[name]), torch.tensor(expected), rtol=1e-5, atol=0)
    for param, (holders, placements) in LAYOUT[name].items():  # the layout is the one named
        assert [r for r in range(nproc) if param in ranks[r]["placements"][name]] == holders, param
        assert ranks[holders[0]]["placements"][name][param] == placements, param
    assert expected[-2] < expected[0] - 0.2  # it trained (the last figure is the evaluation's)
    got = weights[name]
    assert got.keys() == final.keys() and final
    for n, w in final.items():  # the first batch's gradients and the trained weights
        torch.testing.assert_close(got[n], w, rtol=1e-4, atol=1e-6, msg=n)


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel
    from timetotrain.train.checkpoint import save_checkpoint

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results, weights = {"placements": {}}, {}
    for name in BY_WORLD[world]:
        plan = parallel.parse(SCENARIOS[name], world)
        results[name], mine, results["placements"][name], tr = train(plan, rank)
        every = [None] * world
        dist.all_gather_object(every, mine)
        weights[name] = {n: w for part in every for n, w in part.items()}
        if name in CHECKPOINTED:  # each stage writes its own entries; read back under the same layout
            save_checkpoint(out / name, tr.bare, tr.opt, STEPS)
            every = [None] * world
            dist.all_gather_object(every, loaded(plan, out / name))
            weights[f"{name} loaded"] = {n: w for part in every for n, w in part.items()}
    if world == 2:  # a Hugging Face checkpoint loaded into the stages (each reads its own tensors)
        if rank == 0:
            random_hf_llama(CFG).save_pretrained(out / "hf", safe_serialization=True)
        dist.barrier()
        every = [None] * world
        dist.all_gather_object(every, loaded(parallel.parse("pp=2", world), out / "hf"))
        weights["hf loaded"] = {n: w for part in every for n, w in part.items()}
    if rank == 0:
        torch.save(weights, out / "weights.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


def test_split_balances_the_head_against_blocks():
    from timetotrain.train.pipeline import describe_split, split_layers

    assert split_layers([1.0] * 4, 0.5, 2) == [(0, 2), (2, 4)]
    # A head worth three blocks takes blocks off the last stage; every stage keeps at least one.
    assert split_layers([1.0] * 8, 3.0, 2) == [(0, 5), (5, 8)]
    assert split_layers([1.0] * 4, 10.0, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    line = describe_split([(0, 1), (1, 2), (2, 3), (3, 4)], 2)
    assert line.startswith("pipeline: stage 0 on rank 0 layer 0 (+embed), stage 1 on rank 1 layer 1")
    assert line.endswith("stage 3 on rank 1 layer 3 (+norm, head)")


@pytest.mark.bad_input
def test_pipeline_preflight():
    from timetotrain.errors import UserError
    from timetotrain.train import memory, parallel
    from timetotrain.train.pipeline import check

    bench, t = tier()  # 4 layers
    pp2, interleaved = parallel.parse("pp=2", 2), parallel.parse("pp=2,vpp=2", 2)
    # The tier's micro-batch is an upper bound: the largest that gives the schedule enough micro-batches.
    assert check(bench, t, pp2, 16, 16, False, "--set micro_batch_size") == 8
    assert check(bench, t, interleaved, 12, 16, False, "--set micro_batch_size") == 6
    assert check(bench, t, pp2, 16, 4, True, "--set micro_batch_size") == 4
    for plan, local, micro, explicit, needle in [
        (pp2, 16, 16, True, "needs 2 or more micro-batches per step"),
        (interleaved, 12, 4, True, "needs a multiple of 2 micro-batches"),
        (pp2, 1, 1, False, "does not split into 2 or more micro-batches"),
        (parallel.parse("pp=4,vpp=2", 4), 16, 16, False, "8 stages but the model has 4 layers"),
        (parallel.parse("pp=2,dp=2", 4), 16, 16, False, "with dp (use fsdp) is not built yet"),
        (
            parallel.parse("pp=2,dp_replicate=2,fsdp=2", 8),
            16,
            16,
            False,
            "with dp_replicate is not built yet",
        ),
    ]:
        with pytest.raises(UserError, match=re.escape(needle)) as e:
            check(bench, t, plan, local, micro, explicit, "--set micro_batch_size")
        assert "\n" not in str(e.value)
    # LoRA fine-tuning has a stage build (tests/test_layouts_pp_adapt.py); GRPO's rollouts do not.
    lora = get("llama2_70b_lora")
    assert check(lora, lora.tier("tiny"), pp2, 16, 16, False, "--set micro_batch_size") == 8
    grpo = get("qwen35_397b_grpo")
    with pytest.raises(UserError, match="qwen35_397b_grpo has no pipeline split yet"):
        check(grpo, grpo.tier("tiny"), pp2, 16, 16, False, "--set micro_batch_size")
    # The plan estimates stages, not a dp layout (tests/test_plan.py checks the arithmetic).
    _, rows, _ = memory.plan(bench, bench.tier("reference"), 2, 80.0, "pp=2")
    assert {r.parallel for r in rows} == {"pp=2"}


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTED)
def test_pipeline_checkpoint_is_the_model(root, name):
    """A checkpoint saved by the stages holds the trained model: loaded under the same layout and into one
    process, the weights are the trained ones."""
    from timetotrain.train import parallel

    nproc = next(w for w, names in BY_WORLD.items() if name in names)
    folder = root / str(nproc)
    folder.mkdir(exist_ok=True)
    _, weights = workers(folder, nproc)
    trained = {n: w for n, w in weights[name].items() if not n.startswith("grad of")}
    assert weights[f"{name} loaded"].keys() == trained.keys()
    one = loaded(parallel.Plan(), folder / name)
    assert one.keys() == trained.keys()
    for n, w in trained.items():
        torch.testing.assert_close(weights[f"{name} loaded"][n], w, rtol=0, atol=0, msg=n)
        torch.testing.assert_close(one[n], w, rtol=0, atol=0, msg=n)


@pytest.mark.slow
def test_pipeline_loads_a_hugging_face_checkpoint(root):
    from timetotrain.train import parallel

    folder = root / "2"
    folder.mkdir(exist_ok=True)
    _, weights = workers(folder, 2)
    one = loaded(parallel.Plan(), folder / "hf")
    assert weights["hf loaded"].keys() == one.keys()
    for n, w in one.items():
        torch.testing.assert_close(weights["hf loaded"][n], w, rtol=0, atol=0, msg=n)
