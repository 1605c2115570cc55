"""Context with expert parallelism (`--parallel cp=C,ep=E[,fsdp=N]`, train/parallel.py) on gloo against one
process, through the harness's own build and step (`train/step.py`), 20 steps on 4 ranks: the global
train_loss and the gradient norm clipping uses at rtol 1e-5, every trained weight gathered whole (expert slices
over their group), the routers' biases and the expert-load telemetry.

- gpt_oss_20b under `cp=2,ep=2` (dp=2 implied: DDP): its sliding-window layers (a window as wide as a
  chunk) beside full attention, top-2 of 4 experts split over the expert-parallel group {0, 1} (one
  replica's CP ranks), each slice held by 2 ranks that average its gradients;
- deepseekv3_671b under `cp=2,ep=2,fsdp=2`: FSDP2 over the flattened (fsdp, cp) ranks, MLA, 16 experts
  split over the same groups, the sequence-wise aux loss (expert counts summed over the CP group), multi-token
  prediction (token i + 1 at a chunk's last position lives on the other CP rank), the bias balancing from the
  loads of all 4 ranks.

test_layouts_cp.py's batches: the end-of-document mask on, its ids crowded into one chunk. Run as a script (by
torchrun) this file is the worker; it writes its results per rank and rank 0 the gathered weights."""

import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_parse_refuses, assert_trains_as_one_process, layout_results_written, layout_run
from test_ep_fsdp import _recording_norms
from test_layouts_cp import EOD, WEIGHT_ATOL, batches, tier
from test_layouts_moe import trained_weights

from timetotrain.tasks.causal_lm import lm_loss

pytestmark = pytest.mark.distributed

# name (a test_layouts_cp scenario) -> --parallel on 4 ranks
SPECS = {"gpt_oss": "cp=2,ep=2", "deepseek": "cp=2,ep=2,fsdp=2"}
BY_WORLD = {4: list(SPECS)}


@functools.cache  # the one-process runs, once per session
def train(name: str, plan, rank: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """({"losses": the global train_loss of every step, "norms": the gradient norm clipping used at each,
    "bias": the routers' biases, "load": the last forward's tokens per expert}, the trained weights gathered
    whole); every rank calls."""
    from timetotrain.train.step import build_training

    bench, t = tier(name)
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    steps = enumerate(batches(t.model.vocab_size, plan.data_rank(rank), plan.data_parallel))
    norms = []
    with _recording_norms(norms):
        losses = [
            tr.step(s, {"ids": b}, 1, lambda m, b: lm_loss(m, b["ids"], EOD))[0].item() for s, b in steps
        ]
    routers = getattr(tr.bare, "routers", None)
    out = {
        "losses": losses,
        "norms": norms,
        "bias": torch.stack([r.bias for r in routers()]).tolist() if routers else [],
        "load": tr.bare.tokens_per_expert().tolist(),
        "experts": [p.shape[0] for n, p in tr.bare.named_parameters() if n.endswith("experts.w1")],
    }
    return out, trained_weights(tr.bare)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_cp_with_ep_trains_as_one_process(tmp_path_factory, name):
    from timetotrain.train.parallel import Plan

    ranks, weights = layout_run(__file__, tmp_path_factory.getbasetemp() / "layouts_cp_ep", BY_WORLD, name)
    one, final = train(name, Plan())
    losses = [{name: r[name]["losses"]} for r in ranks]
    assert_trains_as_one_process(losses, weights, name, one["losses"], final, WEIGHT_ATOL.get(name, 1e-6))
    if name == "gpt_oss":
        assert max(one["norms"]) > 1.0  # clipping (at 1.0) acts on some steps (DeepSeek's stay below)
    for r in ranks:
        got = r[name]
        # the norm clipping uses: replicated gradients once, expert slices (and FSDP2's shards) summed
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(one["norms"]), rtol=1e-5, atol=0)
        # every rank holds half of each layer's experts (a slice of the one-process stack)
        assert got["experts"] == [n // 2 for n in one["experts"]]
        # the loads of the whole global batch (all 4 ranks' tokens) on every rank, as one process counts
        assert got["load"] == one["load"]
        torch.testing.assert_close(torch.tensor(got["bias"]), torch.tensor(one["bias"]), rtol=0, atol=1e-7)
    if name == "deepseek":
        assert any(abs(b) > 0 for row in one["bias"] for b in row)  # the biases moved


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results, weights = {}, {}
    for name in BY_WORLD[world]:
        results[name], weights[name] = train(name, parallel.parse(SPECS[name], world), rank)
    layout_results_written(out, results, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


@pytest.mark.bad_input
def test_cp_with_ep_flag():
    """The degrees `cp=C,ep=E` implies, the EP groups it makes, the 6.1 disclosure keys, the refusals."""
    from timetotrain.mlperf.keys import parallel_keys
    from timetotrain.train import parallel

    plan = parallel.parse("cp=2,ep=2", 4)  # dp = world / cp: DDP, as `ep=E` alone
    assert (plan.dp, plan.fsdp, plan.cp, plan.ep, plan.data_parallel, plan.shard_ranks) == (2, 1, 2, 2, 2, 1)
    assert [plan.data_rank(r) for r in range(4)] == [0, 0, 1, 1]  # CP peers read the same samples
    plan = parallel.parse("cp=2,ep=4,fsdp=4", 8)
    assert (plan.fsdp, plan.cp, plan.ep, plan.shard_ranks) == (4, 2, 4, 8)
    keys = dict(parallel_keys(plan, 1))
    assert (keys["context_parallelism"], keys["expert_parallelism"]) == (2, 4)
    assert_parse_refuses(
        [
            ("cp=2,ep=4", 6, "ep must divide the 6 data- and context-parallel ranks"),
            ("cp=2,ep=2,tp=2", 8, "with dp or fsdp only"),
            ("cp=2,ep=2,pp=2", 8, "with dp or fsdp only"),
            ("cp=2,ep=2,dp_replicate=2,fsdp=2", 8, "not with tp, pp or dp_replicate yet"),
            ("cp=2,ep=2,fsdp=2", 8, "needs 4 processes"),
        ]
    )


def test_plan_counts_and_searches_cp_with_ep():
    """`ttt plan --parallel cp=2,ep=4,fsdp=8` (gpt_oss_20b reference, 16 GPUs): the states and compute copies
    of `ep=4,fsdp=16` (FSDP2 over the flattened (fsdp, cp) ranks, a quarter of the experts on every GPU),
    less the sharding of its expert slices over their 4 holders, which cp keeps whole (train/parallel.py
    `Plan.expert_shards`), the activations of `cp=2,fsdp=8` (half of each sequence, the gathered K/V). Without --parallel on 16 x 32 GiB
    nothing without cp fits, nor `cp=4,fsdp=4` (a gathered block holds all 32 experts): the search suggests
    `cp=4,ep=16,fsdp=4` before `cp=8,ep=16,fsdp=2` (`cp=8,fsdp=2` fits no more: its gathered blocks hold the
    experts, and through the backward a block's unsharded fp32 gradient)."""
    from timetotrain.spec.registry import get
    from timetotrain.train.memory import HEADROOM, GiB, expert_params, plan

    bench = get("gpt_oss_20b")
    ref = bench.tier("reference")
    _, both, _ = plan(bench, ref, 16, 80, "cp=2,ep=4,fsdp=8")
    _, (ep, ep_ac), _ = plan(bench, ref, 16, 80, "ep=4,fsdp=16")
    _, cp, _ = plan(bench, ref, 16, 80, "cp=2,fsdp=8")
    assert {r.parallel for r in both} == {"fsdp=8,ep=4,cp=2"} and len(both) == len(cp)
    experts, layer = expert_params(bench.family, ref.model)
    # Whole slices: 16 B per expert parameter on 1/4 (not 1/16) of them, their bf16 copies kept for the step
    # (2 B on 1/4), two gathered blocks without theirs, nor the unsharded fp32 gradient of the block FSDP2
    # reduce-scatters (less 2 x 2 + 4 B on 1/4 of a layer's).
    whole = (16 * experts * (1 / 4 - 1 / 16), 2 * experts / 4 - (2 * 2 + 4) * layer / 4)
    for r, c in zip(both, cp, strict=True):
        assert r.states == pytest.approx(ep.states + whole[0])
        assert r.compute_copies == pytest.approx(ep.compute_copies + whole[1])
        assert (r.ac, r.micro_batch, r.activations) == (c.ac, c.micro_batch, c.activations)
    assert both[0].activations < ep.activations / 1.5  # half of each sequence (plus the gathered K/V)
    _, rows, best = plan(bench, ref, 16, 32, None)
    assert best.parallel == "fsdp=4,ep=16,cp=4"
    fits = {r.parallel for r in rows if r.total <= HEADROOM * 32 * GiB}
    # `cp=8,ep=16,fsdp=2` fits too: the search takes the smaller cp (its K/V gathers sit on every attention
    # layer)
    assert fits == {"fsdp=4,ep=16,cp=4", "fsdp=2,ep=16,cp=8"}
