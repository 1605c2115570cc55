"""`--precision fp8` (train/float8.py) under FSDP2 and tensor parallelism on gloo: one torchrun of 2 ranks
trains a small Llama (llama31_8b's harness) for a few steps, against single-process float8 runs:

- `fsdp=2`, tensorwise (float8 all-gathers of the weights, their scales precomputed after each step;
  emulated GEMMs on a CPU): equal at fp32 tolerance (rtol 1e-5) to one process that accumulates the same
  two half batches. Dynamic scaling takes an activation's amax over the micro-batch a GEMM sees, so one
  process over the whole batch at once scales differently (measured: 1e-4 relative on the first loss);
- `tp=2`, rowwise (CPU `torch._scaled_mm`; tensorwise behaves alike here), with torch's TP styles (torchao's float8 styles,
  used on GPUs, gather float8 tensors, which CPUs cannot concatenate): a row-parallel layer scales its
  input shard by the shard's own amax, so a run agrees with one process to float8's scale granularity
  only: rtol 1e-4 (measured 3e-5 for rowwise).

Run as a script (by torchrun) this file is the worker; it writes its losses to a file per rank."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, small_llama
from forked import run_ranks

from timetotrain.spec.registry import get
from timetotrain.tasks.causal_lm import lm_loss

pytest.importorskip("torchao", reason="--precision fp8 needs torchao (the fp8 / test extras)")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, GBS, SEQ = 3, 4, 32
CFG = small_llama(max_seq_len=SEQ)  # every block linear's dimensions divide by 16, also per TP shard
# (spec, recipe) -> (micro-batches of the single-process run, rtol)
CASES = {("fsdp=2", "tensorwise"): (2, 1e-5), ("tp=2", "rowwise"): (1, 1e-4)}


def tier():
    bench = get("llama31_8b")
    t = bench.tier("tiny")
    return bench, dataclasses.replace(
        t, model=CFG, data=dataclasses.replace(t.data, seq_len=SEQ), global_batch_size=GBS, micro_batch_size=GBS, lr=3e-3, end_lr=3e-4, warmup_steps=1,
        max_steps=100,
    )  # fmt: skip


def batches(data_rank: int, data_world: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    two = [torch.randint(0, CFG.vocab_size, (GBS, SEQ + 1), generator=g) for _ in range(2)]
    return [{"tokens": two[s % 2].chunk(data_world)[data_rank]} for s in range(STEPS)]


def train(plan, rank: int = 0, accum: int = 1):
    """(the global train losses, the Training) of STEPS steps under `plan`."""
    from timetotrain.train.step import build_training

    bench, t = tier()
    torch.manual_seed(0)
    tr = build_training(bench, t, torch.device("cpu"), 7, plan)
    data = batches(plan.data_rank(rank), plan.data_parallel)
    losses = [
        tr.step(s, b, accum, lambda m, b: lm_loss(m, b["tokens"], None))[0].item() for s, b in enumerate(data)
    ]
    return losses, tr


def fp8_plan(spec: str | None, world: int, recipe: str):
    from timetotrain.train import parallel

    return parallel.parse(spec, world, precision="fp8", fp8_recipe=recipe, high="fp32")


def test_fsdp_and_tp_float8_train_as_one_float8_process(tmp_path):
    run_ranks(__file__, [str(tmp_path)], 2, free_port())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for (spec, recipe), (accum, rtol) in CASES.items():
        one, _ = train(fp8_plan(None, 1, recipe), accum=accum)
        assert one[-1] < one[0]  # it trains
        key = f"{spec} {recipe}"
        for r in ranks:
            assert r[key]["losses"] == pytest.approx(one, rel=rtol), key
            assert r[key]["float8_linears"] == 4 * CFG.n_layers
        # Under FSDP2 the tensorwise weights travel in float8; elsewhere there is no float8 all-gather.
        assert ranks[0][key]["float8_all_gather"] is (spec == "fsdp=2")


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from timetotrain.train import float8

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for spec, recipe in CASES:
        losses, tr = train(fp8_plan(spec, world, recipe), rank)
        results[f"{spec} {recipe}"] = {
            "losses": losses,
            "float8_linears": len(float8.converted(tr.bare)),
            "float8_all_gather": float8.uses_float8_all_gather(tr.bare),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
