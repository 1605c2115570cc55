"""Every kind of layout `ttt plan` suggests is one ttt builds: for each benchmark, the kinds its search
suggests for the reference tier (8 to 1,024 GPUs of 80, 141 and 192 GiB) are built and stepped for one rank
under the fake process group at the benchmark's tiny tier, on 4 ranks (train/simulate.py), so a kind that
cannot build (LoRA under TP did not, before its plan) fails here. DDP (`dp`) is not among them: its
constructor reads parameter data, which fake tensors have none of; the gloo tests build it
(tests/test_reproducible.py, tests/test_distributed.py)."""

import dataclasses

import pytest

from timetotrain import suite
from timetotrain.errors import UserError
from timetotrain.train import parallel, prepare
from timetotrain.train.memory import _kind, plan
from timetotrain.train.simulate import _in_child, simulate_rank

pytestmark = pytest.mark.slow

WORLD = 4
# The kind as a layout of 4 ranks (the tiny tiers' heads and experts divide by 2 and 4).
SMALL = {
    "fsdp": "fsdp=4",
    "tp": "tp=2,fsdp=2",
    "tp,ep": "tp=2,ep=2",  # fsdp=2 implied (train/parallel.py)
    "ep,fsdp": "ep=4,fsdp=4",
    "ep": "ep=4",
    "hsdp": "dp_replicate=2,fsdp=2",
}


def _suggested_kinds() -> list[tuple[str, str]]:
    out = set()
    for name in suite.names():
        bench = suite.get(name)
        if "reference" not in bench.tiers or "tiny" not in bench.tiers:
            continue
        tier = bench.tier("reference")
        for gpus in (8, 64, 256, 1024):
            for mem in (80, 141, 192):
                try:
                    _, _, best = plan(bench, tier, gpus, mem, None)
                except UserError:  # no memory model (rgat, DLRM's tables: their own plan), or no split
                    continue
                if best is not None:
                    out.add((name, _kind(parallel.parse(best.parallel, gpus, world_from="--gpus is"))))
    return sorted((n, k) for n, k in out if k != "dp")


@pytest.mark.parametrize("name,kind", _suggested_kinds())
def test_every_suggested_kind_builds(name, kind):
    bench, tier = prepare.resolve_tier(name, "tiny", [])
    tier = dataclasses.replace(tier, global_batch_size=WORLD * 2, eval_samples=WORLD * 2)
    got = _in_child(simulate_rank, bench, tier, WORLD, SMALL[kind], WORLD - 1, "fp32", False)
    assert got.parameters > 0 and got.gradients > 0 and got.optimizer > 0
