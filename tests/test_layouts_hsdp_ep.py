"""The expert-data-parallel layouts of gpt_oss_20b on 4 gloo ranks (issue 36), in one launch, each against one
process through the harness's own build and step, 20 steps: train_loss at rtol 1e-5 and the final trained
weights gathered whole. The shape is tests/test_layouts_moe.py's, one sample per micro-batch (4
data-parallel ranks share a global batch of 4). Run as a script (by torchrun) this file is the worker.

- "hsdp_ep", HSDP with expert parallelism, `dp_replicate=2,fsdp=2,ep=2`: two replicas of a 2-rank FSDP2
  shard group; the experts split over the 2 ranks of a shard group, each slice held whole by one rank per
  replica, whose gradients `average_expert_replicas` averages.
- "ep_shard", expert slices sharded over their replicas, `ep=2,fsdp=4`: two expert-parallel groups of 2,
  each slice of 2 of the 4 experts held by 2 ranks, which FSDP2 shards it over
  (`expert_parallel.shard_expert_replicas`), the rest sharded over all 4. Also: each rank's expert storage
  half of its slice's, the last step's expert-load telemetry counting the global micro-batch on every rank,
  a ttt checkpoint of the trained model read back by the same layout (the same weights) and by one process
  (the gathered ones), and one MoE layer whose routing leaves one rank without rows while the other holder
  of its slice gets some (tests/test_expert_parallel.py's idle case, one replica idle)."""

import copy
import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_trains_as_one_process,
    layout_results_written,
    layout_run,
    moe_layout_trained,
    trained_weights,
)
from test_layouts_moe import CFG, batches
from test_layouts_moe import tier as moe_tier

pytestmark = pytest.mark.distributed

WORLD, STEPS = 4, 20
SPECS = {"hsdp_ep": "dp_replicate=2,fsdp=2,ep=2", "ep_shard": "ep=2,fsdp=4"}
LAYOUT = {
    # The rest replicated over the first mesh dimension and sharded over the second, the experts plain slices.
    "hsdp_ep": {
        "layers.0.attn.qkv.weight": "(Replicate(), Shard(dim=0))",
        "layers.1.ffn.router.weight": "(Replicate(), Shard(dim=0))",
        "layers.1.ffn.experts.w1": "plain",
    },
    # The experts FSDP2's shards of each rank's slice over its 2 replicas (dim 0: one expert each), the rest
    # sharded over all 4 ranks.
    "ep_shard": {
        "layers.1.ffn.experts.w1": "(Shard(dim=0),)",
        "layers.1.ffn.experts.w2": "(Shard(dim=0),)",
        "layers.0.attn.qkv.weight": "(Shard(dim=0),)",
    },
}


def tier():
    bench, t = moe_tier()
    return bench, dataclasses.replace(t, micro_batch_size=1)


def train(name: str, plan, rank: int = 0, out: Path | None = None) -> dict:
    """The global train_loss of every step (under `name`), the trained weights gathered whole, the
    placements, the first expert of this rank's slice, the bytes of expert weights it stores, the last
    step's expert loads; with `out` (the workers), the trained model saved there as a ttt checkpoint and
    built again from it."""
    from timetotrain.train.checkpoint import save_checkpoint
    from timetotrain.train.expert_parallel import expert_slice, is_expert_sharded
    from timetotrain.train.step import build_training

    bench, t = tier()
    tr, losses, placed = moe_layout_trained(
        bench, t, plan, rank, batches(plan.data_rank(rank), plan.data_parallel)
    )
    experts = [p for p in tr.bare.parameters() if is_expert_sharded(p)]
    result = {
        name: losses, "weights": trained_weights(tr.bare), "placements": placed,
        "first_expert": (expert_slice(tr.bare.layers[0].ffn.experts.w1) or (0, 0))[1],
        "expert_bytes": sum(getattr(p, "_local_tensor", p).untyped_storage().nbytes() for p in experts),
        "loads": tr.bare.tokens_per_expert().tolist(),
    }  # fmt: skip
    if out is not None:
        save_checkpoint(out / name, tr.bare, None, step=STEPS)
        again = build_training(bench, t, torch.device("cpu"), 99, plan, init_checkpoint=out / name)
        result["reloaded"] = trained_weights(again.bare)
    return result


@functools.cache
def one_process():
    from timetotrain.train import parallel

    return train("one", parallel.Plan())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts_hsdp_ep")


def _trained(root: Path, name: str) -> tuple[list[dict], dict]:
    """Every rank's results of scenario `name` (the one launch runs both) and the gathered weights."""
    every, weights = layout_run(__file__, root, {WORLD: list(SPECS)}, name)
    ranks = [r[name] for r in every]
    one = one_process()
    for param, placements in LAYOUT[name].items():  # the layout is the one named, not a fallback
        assert ranks[0]["placements"][param] == placements, param
    # Consecutive ranks split the experts: slice 0-1 on ranks 0 and 2, slice 2-3 on ranks 1 and 3.
    assert [r["first_expert"] for r in ranks] == [0, 2, 0, 2]
    assert_trains_as_one_process(ranks, {name: weights[name]["weights"]}, name, one["one"], one["weights"])
    return ranks, weights[name]


@pytest.mark.slow
def test_hsdp_ep_trains_as_one_process(root):
    _trained(root, "hsdp_ep")


@pytest.mark.slow
def test_ep_shard_trains_as_one_process(root):
    from timetotrain.train.step import build_training

    ranks, weights = _trained(root, "ep_shard")
    # Each rank stores half its slice: 2 of 4 experts, cut over 2 replicas (HSDP: the whole slice).
    whole_slice = 4 * CFG.n_layers * (CFG.n_experts // 2) * 3 * CFG.dim * CFG.expert_ffn_dim
    assert [r["expert_bytes"] for r in ranks] == [whole_slice // 2] * WORLD
    hsdp = layout_run(__file__, root, {WORLD: list(SPECS)}, "hsdp_ep")[0]
    assert [r["hsdp_ep"]["expert_bytes"] for r in hsdp] == [whole_slice] * WORLD
    # The telemetry: the last forward's expert loads over all 4 ranks' micro-batches (one sample each), the
    # same on every rank: each layer counts every token's top-k copies.
    tokens = WORLD * (CFG.max_seq_len - 1) * CFG.top_k
    for r in ranks:
        assert r["loads"] == ranks[0]["loads"] and [sum(x) for x in r["loads"]] == [tokens] * CFG.n_layers
    # The checkpoint: the same layout reads back the trained weights, and so does one process.
    for n, w in weights["reloaded"].items():
        assert torch.equal(w, weights["weights"][n]), n
    single = build_training(*tier(), torch.device("cpu"), 99, init_checkpoint=root / str(WORLD) / "ep_shard")
    for n, w in single.bare.named_parameters():
        assert torch.equal(w.detach(), weights["weights"][n]), n
    # Rank 1 received no rows, rank 3 (the other half of its slice) did: the slice's gradient is the layer's.
    assert [r["idle"]["group picks 2-3"] > 0 for r in ranks] == [False, False, True, True]
    for rank, r in enumerate(ranks):
        assert r["idle"]["w1"] <= 1e-5 and r["idle"]["w2"] <= 1e-5, (rank, r["idle"])


def idle_layer(plan) -> dict:
    """One MoE layer under the layout's expert sharding where the tokens of ranks 0 and 1 (one expert-parallel
    group) never pick experts 2 or 3: rank 1 receives no rows while rank 3, which holds the other half of the
    same slice, does. Rank 1 must still enter the slice's all-gather and reduce-scatter (without it rank 3
    waits forever). Each rank's expert gradients, gathered over its replicas, against one layer on the 4
    ranks' tokens, and how many of its group's tokens picked experts 2 and 3."""
    import torch.distributed as dist
    from test_expert_parallel import _layer_case, _rank_counts

    from timetotrain.train import parallel
    from timetotrain.train.expert_parallel import apply_expert_parallel, shard_expert_replicas

    rank = dist.get_rank()
    moe, x, cotangent = _layer_case([[2, 3], []])  # 24 tokens, the first 12 (ranks 0 and 1) avoid 2 and 3
    ref = copy.deepcopy(moe)
    group = _rank_counts(ref, x.chunk(2)[rank // 2])
    (ref(x) * cotangent).sum().div(x.shape[0]).backward()  # the mean over ranks of each rank's token mean
    mesh = parallel.device_mesh("cpu", (WORLD // plan.ep, plan.ep), ("replica", "ep"))
    apply_expert_parallel(moe, mesh["ep"].get_group(), None, mesh["replica"].get_group(), mesh)
    shard_expert_replicas(moe, None)
    mine = x.chunk(WORLD)[rank]
    (moe(mine) * cotangent.chunk(WORLD)[rank]).sum().div(mine.shape[0]).backward()
    local = moe.n_experts // plan.ep
    rows = slice(rank % plan.ep * local, (rank % plan.ep + 1) * local)
    out = {"group picks 2-3": sum(group[2:])}
    for w in ("w1", "w2"):
        grad = getattr(moe.experts, w).grad.full_tensor()
        want = getattr(ref.experts, w).grad[rows]
        out[w] = (grad - want).abs().max().item() / want.abs().max().item()
    return out


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    results, weights = {}, {}
    for name, spec in SPECS.items():
        plan = parallel.parse(spec, dist.get_world_size())
        results[name] = train(name, plan, dist.get_rank(), out if name == "ep_shard" else None)
        weights[name] = {
            kind: results[name].pop(kind) for kind in ("weights", "reloaded") if kind in results[name]
        }
    results["ep_shard"]["idle"] = idle_layer(parallel.parse(SPECS["ep_shard"], dist.get_world_size()))
    layout_results_written(out, results, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
