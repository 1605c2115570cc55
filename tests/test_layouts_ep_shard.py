"""Expert slices sharded over their replicas (issue 36): gpt_oss_20b under `ep=2,fsdp=4` (4 ranks: two
expert-parallel groups of 2, each slice of 2 of the 4 experts held by 2 ranks, which FSDP2 shards it over,
`expert_parallel.shard_expert_replicas`; the rest sharded over all 4), on gloo against one process through
the harness's own build and step, 20 steps: train_loss at rtol 1e-5 and the final trained weights gathered
whole, each rank's expert storage half of its slice's, the last step's expert-load telemetry counting the
global micro-batch on every rank, and a ttt checkpoint of the trained model: read back by the same layout (the same weights) and
by one process (the gathered ones). The shape is tests/test_layouts_moe.py's, one sample per micro-batch.
Run as a script (by torchrun) this file is the worker."""

import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_trains_as_one_process,
    layout_results_written,
    layout_workers,
    moe_layout_trained,
    trained_weights,
)
from test_layouts_hsdp_ep import tier
from test_layouts_moe import CFG, batches

pytestmark = pytest.mark.distributed

WORLD, SPEC, NAME, STEPS = 4, "ep=2,fsdp=4", "ep_shard", 20
# The experts: FSDP2's shards of each rank's slice over its 2 replicas (dim 0: one expert each), the
# rest over all 4 ranks.
LAYOUT = {
    "layers.1.ffn.experts.w1": "(Shard(dim=0),)",
    "layers.1.ffn.experts.w2": "(Shard(dim=0),)",
    "layers.0.attn.qkv.weight": "(Shard(dim=0),)",
}


def train(plan, rank: int = 0, out: Path | None = None) -> dict:
    """The global train_loss of every step, the trained weights gathered whole, the placements, the bytes of
    expert weights this rank stores, the first expert of its slice, the last step's expert loads; with `out`
    (the workers), the trained model saved there as a ttt checkpoint and built again from it."""
    from timetotrain.train.checkpoint import save_checkpoint
    from timetotrain.train.expert_parallel import expert_slice, is_expert_sharded
    from timetotrain.train.step import build_training

    bench, t = tier()
    tr, losses, placed = moe_layout_trained(
        bench, t, plan, rank, batches(plan.data_rank(rank), plan.data_parallel)
    )
    experts = [p for p in tr.bare.parameters() if is_expert_sharded(p)]
    stored = sum(getattr(p, "_local_tensor", p).untyped_storage().nbytes() for p in experts)
    result = {
        NAME: losses, "weights": trained_weights(tr.bare), "placements": placed, "expert_bytes": stored,
        "first_expert": (expert_slice(tr.bare.layers[0].ffn.experts.w1) or (0, 0))[1],
        "loads": tr.bare.tokens_per_expert().tolist(),
    }  # fmt: skip
    if out is not None:
        save_checkpoint(out / "ckpt", tr.bare, None, step=STEPS)
        again = build_training(bench, t, torch.device("cpu"), 99, plan, init_checkpoint=out / "ckpt")
        result["reloaded"] = trained_weights(again.bare)
    return result


@functools.cache
def one_process():
    from timetotrain.train import parallel

    return train(parallel.Plan())


@pytest.mark.slow
def test_ep_shard_trains_as_one_process(tmp_path):
    from timetotrain.train.step import build_training

    ranks, weights = layout_workers(__file__, tmp_path, WORLD)
    one = one_process()
    for param, placements in LAYOUT.items():  # the layout is the one named, not a fallback
        assert ranks[0]["placements"][param] == placements, param
    # Consecutive ranks split the experts; each slice is held by ranks r and r + 2.
    assert [r["first_expert"] for r in ranks] == [0, 2, 0, 2]
    # Each rank stores half its slice: 2 of 4 experts, cut over 2 replicas (whole slices held 2 each).
    whole_slice = 4 * CFG.n_layers * (CFG.n_experts // 2) * 3 * CFG.dim * CFG.expert_ffn_dim
    assert [r["expert_bytes"] for r in ranks] == [whole_slice // 2] * WORLD
    assert_trains_as_one_process(ranks, weights, NAME, one[NAME], one["weights"])
    # The telemetry: the last forward's expert loads over all 4 ranks' micro-batches (one sample each), the
    # same on every rank: each layer counts every token's top-k copies.
    for r in ranks:
        assert r["loads"] == ranks[0]["loads"]
        assert [sum(layer) for layer in r["loads"]] == [
            WORLD * (CFG.max_seq_len - 1) * CFG.top_k
        ] * CFG.n_layers
    # The checkpoint: the same layout reads back the trained weights, and so does one process.
    for n, w in weights["reloaded"].items():
        assert torch.equal(w, weights[NAME][n]), n
    bench, t = tier()
    single = build_training(bench, t, torch.device("cpu"), 99, init_checkpoint=tmp_path / "ckpt")
    for n, w in single.bare.named_parameters():
        assert torch.equal(w.detach(), weights[NAME][n]), n


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    result = train(parallel.parse(SPEC, dist.get_world_size()), dist.get_rank(), out)
    layout_results_written(out, result, {NAME: result.pop("weights"), "reloaded": result.pop("reloaded")})


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
