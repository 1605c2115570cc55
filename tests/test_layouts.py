"""The two layouts real submissions run (issue 36), on gloo against one process through the harness's own
build and step (`train/step.py`), 20 steps each: train_loss at rtol 1e-5 and the final trained weights.

- llama2_70b_lora under `tp=2`: the LoRA adapters placed beside the TP-cut frozen base
  (models/common/lora_parallel.py), on every linear kind: per-part q/v adapters on the column-cut fused
  qkv, one on the column-cut, stacked (gate, up) `fc1`, and on the row-cut `proj` and `fc2`, with the
  tier's dropout (each TP rank draws the whole mask, so the masks equal one process's) and clipping;
- llama2_70b_lora under `tp=2,fsdp=2` (4 ranks), the tier's adapters on qkv and proj, dropout 0 (data
  parallel ranks draw their own masks, so no layout over several sample streams can match with it);
- llama31_8b under HSDP, `dp_replicate=2,fsdp=2` (4 ranks): FSDP2 on a (replicate, shard) mesh;
- llama31_8b and llama2_70b_lora (adapters on qkv and proj, dropout 0) under HSDP x TP, `dp_replicate=2,tp=2`
  (4 ranks): one (replicate, shard, tp) mesh, FSDP2 over its (replicate, shard) sub-mesh of (2, 1), TP
  innermost. `dp_replicate=2,fsdp=2,tp=2` takes 8 ranks, ~40 s on 2 loaded cores: it is built for one rank
  under the fake process group instead (tests/test_plan_builds.py); it matched one process when run by hand.

The harness's tiers at a small Llama shape. Run as a script (by torchrun) this file is the worker; it
writes its losses per rank and rank 0 the gathered weights."""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_parse_refuses,
    assert_trains_as_one_process,
    layout_results_written,
    layout_run,
    small_llama,
)

from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss
from timetotrain.tasks.lora_sft import lm_block_loss

pytestmark = pytest.mark.distributed

STEPS, GBS, SEQ = 20, 4, 32
CFG = small_llama(max_seq_len=SEQ + 1)
ALL_KINDS = ("attn.q", "attn.v", "attn.proj", "ffn.fc1", "ffn.fc2")
# name -> (benchmark, LoRA targets or None, dropout, --parallel); by the world size that runs it
SCENARIOS = {
    "lora_tp": ("llama2_70b_lora", ALL_KINDS, 0.1, "tp=2"),
    "lora_tp_fsdp": ("llama2_70b_lora", ("attn.qkv", "attn.proj"), 0.0, "tp=2,fsdp=2"),
    "hsdp": ("llama31_8b", None, None, "dp_replicate=2,fsdp=2"),
    "hsdp_tp": ("llama31_8b", None, None, "dp_replicate=2,tp=2"),
    "hsdp_tp_lora": ("llama2_70b_lora", ("attn.qkv", "attn.proj"), 0.0, "dp_replicate=2,tp=2"),
    # By hand only (8 ranks, ~40 s on 2 cores): `torchrun --nproc_per_node 8 tests/test_layouts.py OUT`.
    "hsdp_fsdp_tp": ("llama31_8b", None, None, "dp_replicate=2,fsdp=2,tp=2"),
}
BY_WORLD = {2: ["lora_tp"], 4: ["lora_tp_fsdp", "hsdp", "hsdp_tp", "hsdp_tp_lora"], 8: ["hsdp_fsdp_tp"]}
# Placements of some trained parameters, as Megatron places the adapters (models/common/lora_parallel.py):
# of a column-cut base A whole (a plain tensor) and B cut by rows, of a row-cut one A cut by columns and B
# replicated; HSDP replicates over the first mesh dimension and shards over the second.
LAYOUT = {
    "lora_tp": {
        "layers.0.attn.qkv.lora_A.q.weight": "plain",
        "layers.0.attn.qkv.lora_B.v.weight": "(Shard(dim=0),)",
        "layers.0.ffn.fc1.lora_B.weight": "(Shard(dim=0),)",
        "layers.1.attn.proj.lora_A.weight": "(Shard(dim=1),)",
        "layers.1.ffn.fc2.lora_B.weight": "(Replicate(),)",
    },
    "lora_tp_fsdp": {"layers.0.attn.proj.lora_A.weight": "(Shard(dim=0), Shard(dim=1))"},
    "hsdp": {
        "layers.0.attn.qkv.weight": "(Replicate(), Shard(dim=0))",
        "embed.weight": "(Replicate(), Shard(dim=0))",
    },
    # HSDP x TP on one (replicate, shard, tp) mesh: FSDP2's (Replicate, Shard) over its shard dimension of
    # one rank, then TP's column cut.
    "hsdp_tp": {"layers.0.attn.qkv.weight": "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"},
    "hsdp_tp_lora": {"layers.0.attn.proj.lora_A.weight": "(Replicate(), Shard(dim=0), Shard(dim=1))"},
}


def tier(name: str):
    bench_name, targets, dropout, _ = SCENARIOS[name]
    bench = get(bench_name)
    t = bench.tier("tiny")
    if targets is None:
        data = dataclasses.replace(t.data, seq_len=SEQ)
    else:
        data = dataclasses.replace(t.data, block=SEQ + 1, targets=targets, dropout=dropout, vocab_keep=None)
    return bench, dataclasses.replace(
        t, model=CFG, data=data, global_batch_size=GBS, micro_batch_size=GBS, lr=3e-3, warmup_steps=3,
        max_steps=100, base=None,
    )  # fmt: skip


def batches(data_rank: int, data_world: int) -> list[torch.Tensor]:
    """Two random global batches in turn: memorised within 20 steps, so the loss falls."""
    g = torch.Generator().manual_seed(3)
    two = [torch.randint(0, CFG.vocab_size, (GBS, SEQ + 1), generator=g) for _ in range(2)]
    return [two[s % 2].chunk(data_world)[data_rank] for s in range(STEPS)]


def loss_fn(bench_name: str):
    if bench_name == "llama2_70b_lora":
        return lambda m, ids: lm_block_loss(m, ids, ids)
    return lambda m, ids: lm_loss(m, ids, None)


def train(name: str, plan, rank: int = 0) -> tuple[list[float], dict[str, torch.Tensor], dict[str, str]]:
    """The global train_loss of every step, the trained weights gathered whole (every rank calls), and the
    placements of the trained parameters."""
    from timetotrain.train.step import build_training

    bench, t = tier(name)
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    # The dropout masks' RNG, the same on every rank, seeded after the build: the whole-model build draws
    # from it (`apply_lora` initialises each adapter once before `init_lora` draws them from the seed), the
    # sharded one, on the meta device, does not.
    torch.manual_seed(0)
    fn = loss_fn(bench.name)
    steps = enumerate(batches(plan.data_rank(rank), plan.data_parallel))
    losses = [tr.step(s, {"ids": b}, 1, lambda m, b: fn(m, b["ids"]))[0].item() for s, b in steps]
    placed = {
        n: str(getattr(p, "placements", "plain")) for n, p in tr.bare.named_parameters() if p.requires_grad
    }
    return losses, trained_weights(tr.bare), placed


def trained_weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from timetotrain.train.tensor_parallel import unstack

    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            full = unstack(p.full_tensor(), p) if isinstance(p, DTensor) else p
            out[n] = full.detach().clone()
    return out


@functools.cache
def one_process(name: str):
    from timetotrain.train import parallel

    return train(name, parallel.Plan())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora_tp", "lora_tp_fsdp", "hsdp", "hsdp_tp", "hsdp_tp_lora"])
def test_layout_trains_as_one_process(root, name):
    ranks, weights = layout_run(__file__, root, BY_WORLD, name)
    expected, final, _ = one_process(name)
    for param, placements in LAYOUT[name].items():  # the layout is the one named, not a fallback
        assert ranks[0]["placements"][name][param] == placements, param
    assert_trains_as_one_process(ranks, weights, name, expected, final)


def _worker(out: Path) -> None:

    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results, weights = {"placements": {}}, {}
    for name in BY_WORLD[world]:
        plan = parallel.parse(SCENARIOS[name][3], world)
        results[name], weights[name], results["placements"][name] = train(name, plan, rank)
    layout_results_written(out, results, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


@pytest.mark.bad_input
def test_parallel_flag_for_hsdp():
    from timetotrain.errors import UserError
    from timetotrain.mlperf.keys import parallel_keys
    from timetotrain.train import parallel

    plan = parallel.parse("dp_replicate=2,fsdp=4", 8)
    assert (plan.dp_replicate, plan.fsdp, plan.world, plan.data_parallel) == (2, 4, 8, 8) and plan.sharded
    assert [plan.data_rank(r) for r in range(8)] == list(range(8))  # every rank reads its own samples
    assert "dp_replicate=2, fsdp=4" in plan.describe()
    with pytest.raises(UserError, match="not divisible by 8 data-parallel ranks"):
        parallel.check_batch_split(12, plan)
    # HSDP x TP: tp innermost, then the shard ranks, the replicas outermost (`Plan.coords`)
    hsdp_tp = parallel.parse("dp_replicate=2,fsdp=2,tp=2", 8)
    assert (hsdp_tp.data_parallel, hsdp_tp.shard_ranks, hsdp_tp.fully_sharded) == (4, 2, True)
    assert [hsdp_tp.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert parallel.parse("dp_replicate=2,tp=2", 4).fully_sharded  # FSDP2 replicates at fsdp=1
    hsdp_ep = parallel.parse("dp_replicate=2,fsdp=4,ep=2", 8)
    # The 6.1 disclosure keys carry the real degrees.
    for p, tp, ep in ((hsdp_tp, 2, 1), (hsdp_ep, 1, 2)):
        keys = dict(parallel_keys(p, 1))
        assert (keys["tensor_parallelism"], keys["expert_parallelism"], keys["pipeline_parallelism"]) == (
            tp,
            ep,
            1,
        )
    assert_parse_refuses(
        [
            ("dp_replicate=2", 2, "dp_replicate is HSDP's replica count and combines with fsdp or tp"),
            ("dp_replicate=2,dp=2", 4, "combines with fsdp or tp"),
            ("dp_replicate=2,fsdp=2,tp=2,ep=2", 8, "built without ep and cp"),
            ("dp_replicate=2,ep=2", 4, "or dp_replicate=R,fsdp=S,ep=E"),
            ("dp_replicate=2,fsdp=2,ep=4", 4, "ep must divide fsdp"),
            ("dp_replicate=2,fsdp=2,cp=2,ep=2", 8, "not with tp, pp or dp_replicate yet"),
            ("dp=2,fsdp=2", 4, "use HSDP, dp_replicate=R,fsdp=S"),
            ("dp_replicate=2,fsdp=2", 8, "needs 4 processes"),
            ("dp_replicate=x,fsdp=2", 2, "comma-separated degrees"),
        ]
    )


@pytest.mark.bad_input
def test_parallel_flag_places_pipeline_and_context_ranks():
    from timetotrain.train import parallel

    plan = parallel.parse("pp=2,vpp=2,fsdp=2,cp=2,tp=2", 16)
    assert (plan.pp, plan.vpp, plan.cp, plan.world, plan.data_parallel) == (2, 2, 2, 16, 2)
    # tp innermost, then cp, then the data-parallel ranks, pipeline stages outermost
    assert plan.coords(0) == {"tp": 0, "cp": 0, "data": 0, "pp": 0}
    assert plan.coords(13) == {"tp": 1, "cp": 0, "data": 1, "pp": 1}
    assert [plan.data_rank(r) for r in range(16)] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    assert "pp=2, fsdp=2, cp=2, tp=2, vpp=2" in plan.describe()
    assert_parse_refuses(
        [
            ("vpp=2,fsdp=2", 2, "use it with pp"),
            ("pp=2,ep=2,tp=2,vpp=2", 16, "not with dp, dp_replicate or vpp yet"),
            ("cp=2", 4, "needs 2 processes"),
        ]
    )
