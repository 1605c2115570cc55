"""Context parallelism composed with tensor and pipeline parallelism (`--parallel tp=T,cp=C`, `pp=P,cp=C`,
`pp=P,tp=T,cp=C`; train/context_parallel.py, train/pipeline.py) on gloo against one process, through the
harness's own build and step, 20 steps at a 2-layer llama31_8b shape: the global train_loss at rtol 1e-5
and the final trained weights gathered whole. Each fails with the CP exchange broken (each rank attending
its own K/V only: 3.7% off in the loss).

- `tp=2,cp=2` (4 ranks): each TP rank computes half the heads of its CP rank's head-tail part of every
  sequence, K/V of its heads gathered over its CP group only; the residual stream cut again along that
  part by TP's sequence parallelism; FSDP2 over the two CP ranks averages their gradients;
- `pp=2,cp=2` (4 ranks): one layer per stage, each stage computing its CP rank's part (the first embeds only
  those positions, the boundary carries `[micro, T / 2, dim]`), the last stage's loss summed over the CP
  group; two micro-batches per step (1F1B), which the one process accumulates too;
- `pp=2,vpp=2,cp=2` (4 ranks, 4 layers): the interleaved schedule, two one-layer stages per rank;
- `pp=2,tp=2,cp=2` (8 ranks): both at once, on the one (pp, data, cp, tp) mesh of train/pipeline.py.

The batches are tests/test_layouts_cp.py's: the end-of-document mask on, its EOD ids crowded into one chunk,
so the CP ranks hold different labelled counts. Run as a script (by torchrun) this file is the worker."""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_trains_as_one_process, layout_results_written, layout_run, small_llama
from test_layouts_cp import EOD, GBS, SEQ, batches

from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss

pytestmark = pytest.mark.distributed

MICRO = 2  # two micro-batches per step: 1F1B over two stages needs at least two
# name -> (--parallel, the model's layers: four for interleaving's four stages)
SCENARIOS = {
    "tp_cp": ("tp=2,cp=2", 2),
    "pp_cp": ("pp=2,cp=2", 2),
    "pp_vpp_cp": ("pp=2,vpp=2,cp=2", 4),
    "pp_tp_cp": ("pp=2,tp=2,cp=2", 2),
}
BY_WORLD = {4: ["tp_cp", "pp_cp", "pp_vpp_cp"], 8: ["pp_tp_cp"]}


def tier(layers: int):
    bench = get("llama31_8b")
    t = bench.tier("tiny")
    return bench, dataclasses.replace(
        t, model=small_llama(max_seq_len=SEQ, n_layers=layers), data=dataclasses.replace(t.data, seq_len=SEQ),
        global_batch_size=GBS, micro_batch_size=MICRO, lr=3e-3, warmup_steps=3, max_steps=100, base=None,
    )  # fmt: skip


def train(plan, layers: int, rank: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The global train_loss of every step and this rank's trained weights, gathered whole over the ranks
    that shard them (under pp: this rank's stages only)."""
    from torch.distributed.tensor import DTensor

    from timetotrain.train.step import build_training
    from timetotrain.train.tensor_parallel import unstack

    bench, t = tier(layers)
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    accum = GBS // plan.data_parallel // MICRO
    mine = batches(t.model.vocab_size, plan.data_rank(rank), plan.data_parallel)
    fn = lambda m, b: lm_loss(m, b["ids"], EOD)  # noqa: E731
    losses = [tr.step(s, {"ids": b}, accum, fn)[0].item() for s, b in enumerate(mine)]
    weights = {
        n: (unstack(p.full_tensor(), p) if isinstance(p, DTensor) else p).detach().clone()
        for n, p in tr.bare.named_parameters()
        if p.device.type != "meta"  # else another stage's
    }
    return losses, weights


@functools.cache
def one_process(layers: int):
    from timetotrain.train.parallel import Plan

    return train(Plan(), layers)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_cp_with_tp_and_pp_trains_as_one_process(tmp_path_factory, name):
    ranks, weights = layout_run(
        __file__, tmp_path_factory.getbasetemp() / "layouts_cp_compose", BY_WORLD, name
    )
    expected, final = one_process(SCENARIOS[name][1])
    assert_trains_as_one_process(ranks, weights, name, expected, final)


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results, weights = {}, {}
    for name in BY_WORLD[world]:
        spec, layers = SCENARIOS[name]
        results[name], mine = train(parallel.parse(spec, world), layers, rank)
        every = [None] * world
        dist.all_gather_object(every, mine)  # a pipeline's stages hold different parameters
        weights[name] = {n: w for part in every for n, w in part.items()}
    layout_results_written(out, results, weights)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
