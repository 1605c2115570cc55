"""Every kind of layout `ttt plan` suggests is one ttt builds: for each benchmark, the kinds its search
suggests for the reference tier (8 to 1,024 GPUs of 80, 141 and 192 GiB) are built and stepped for one rank
under the fake process group at the benchmark's tiny tier, on 4 ranks (train/simulate.py), so a kind that
cannot build (LoRA under TP did not, before its plan) fails here. DDP (`dp`) is not among them: its
constructor reads parameter data, which fake tensors have none of; the gloo tests build it
(tests/test_reproducible.py, tests/test_distributed.py).

Context parallelism (`cp=C,fsdp=F`) is the search's last resort, suggested on none of those devices but on
smaller ones (gpt_oss_20b on 64 x 16 GiB): it is built for every benchmark whose reference tier
`context_parallel.check` accepts, the condition under which the search offers it (one per model family).
HSDP is never suggested (train/memory.py), nor is pipeline parallelism (not searched: the fake process
group cannot build its stages yet)."""

import dataclasses

import pytest

from timetotrain.errors import UserError
from timetotrain.spec import registry
from timetotrain.train import context_parallel, parallel, prepare
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
    "fsdp,cp": "cp=2,fsdp=2",
}


def _suggested_kinds() -> list[tuple[str, str]]:
    out = set()
    cp_families = set()  # one cp build per model family (llama31_8b's stands for llama31_405b's)
    for name in registry.names():
        bench = registry.get(name)
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
                    out.add((name, _kind_of(best.parallel, gpus)))
        try:  # where `ttt run` takes cp, the search may suggest it (on small enough devices)
            context_parallel.check(bench, tier, parallel.parse("cp=2,fsdp=4", 8), "cp=2,fsdp=4")
        except UserError:
            continue
        if bench.family.name not in cp_families:
            cp_families.add(bench.family.name)
            out.add((name, "fsdp,cp"))
    return sorted((n, k) for n, k in out if k != "dp")


def _kind_of(spec: str, gpus: int) -> str:
    p = parallel.parse(spec, gpus, world_from="--gpus is")
    return _kind(p) + (",cp" if p.cp > 1 else "")


@pytest.mark.parametrize("name,kind", _suggested_kinds())
def test_every_suggested_kind_builds(name, kind):
    bench, tier = prepare.resolve_tier(name, "tiny", [])
    tier = dataclasses.replace(tier, global_batch_size=WORLD * 2, eval_samples=WORLD * 2)
    got = _in_child(simulate_rank, bench, tier, WORLD, SMALL[kind], WORLD - 1, "fp32", False)
    assert got.parameters > 0 and got.gradients > 0 and got.optimizer > 0
