"""Every kind of layout `ttt plan` suggests is one ttt builds: for each benchmark, the kinds its search
suggests or offers for the reference tier (8 to 1,024 GPUs of 80, 141 and 192 GiB) are built and stepped for one rank
under the fake process group at the benchmark's tiny tier, on 4 ranks (train/simulate.py), so a kind that
cannot build (LoRA under TP did not, before its plan) fails here. DDP (`dp`) is walked past: under fake
tensors the simulator runs a stand-in that holds DDP's buckets (`fakes.data_parallel`) around each family's
plain unsharded build, and the gloo tests build the real one (tests/test_reproducible.py,
tests/test_distributed.py); the one family whose build differs under it, LoRA's (its adapters created
beside a frozen base: a fake tensor's `to_empty` did not build), is built by name below (`NAMED`), as the
grid suggests it on 8 x 192 GiB.

Context parallelism (`cp=C,fsdp=F`) is the search's last resort, suggested on none of those devices but on
smaller ones (gpt_oss_20b on 64 x 16 GiB): it is built for every benchmark whose reference tier
`context_parallel.check` accepts, the condition under which the search offers it (one per model family).
For an MoE model the search tries it with expert parallelism too (`cp=C,ep=E,fsdp=F`: gpt_oss_20b on 16 x 32
GiB), built once (`cp=2,ep=2,fsdp=2`) for the first MoE benchmark `context_parallel.check` accepts.
HSDP (`dp_replicate=R,fsdp=S`) is suggested across nodes where FSDP2 within a node fits, and offered beside a
TP suggestion at a legal GBS of the RCP table (train/memory.py): the walk takes the suggestions as `ttt plan`
makes them (`plan_at_legal_gbs`) and the kinds of the rows it offers at another GBS that fit. HSDP x TP
(`dp_replicate=R,fsdp=S,tp=T`), which the search prefers across nodes where TP is needed and FSDP2 over a
node's TP groups fits, is built on 8 ranks (2 x 2 x 2); HSDP x EP (`dp_replicate=2,fsdp=2,ep=2`), which the
search tries across nodes for an MoE model (gpt_oss_20b's GBS 64 rows on 64 GPUs offer it), on 4. The search
tries cp with tp (`cp=C,tp=T[,fsdp=F]`) beside cp where `context_parallel.check` takes both (the llama
family's dense decoders): built once per such family, as `cp=2,tp=2` (4 ranks, FSDP2 over the 2 cp ranks).
Across nodes it tries cp x tp with TP filling a node (`cp=2,tp=8,fsdp=F`, NVIDIA's llama31_405b layout, the
pick on 2,048 GPUs): the same `tp,cp` kind. Pipeline parallelism is the search's other last resort: it is
suggested where no layout without it fits or splits the batch (llama31_405b on 4,096 GPUs: GBS 1152 splits
over at most 128 data-parallel ranks, and the CP pair across nodes leaves 256), so the grid walks 4,096 GPUs
too, for pipeline kinds. Such a kind
is built on both ends of the pipeline (rank 0, the first stage with the embedding; the last rank, the
last stage with the head and loss), as `ttt plan --simulate` builds it (`fakes.pipeline_schedule` runs
torch's schedule under the fake process group), in its composition with tp and fsdp on 8 ranks
(`pp=2,tp=2,fsdp=2`). The pipeline kinds the grid's suggestions do not reach, with LoRA (llama2_70b_lora's
reference fits without pp wherever the grid looks, yet `ttt plan --parallel pp=...` and the search where
nothing else fits count them) and with `--precision fp8` (the grid plans bf16), are built the same way."""

import dataclasses
import math

import pytest

from timetotrain.errors import UserError
from timetotrain.spec import registry
from timetotrain.spec.benchmark import apply_overrides, follows_rcp_table
from timetotrain.train import context_parallel, parallel, prepare
from timetotrain.train.memory import HEADROOM, GiB, _kind, plan, plan_at_legal_gbs
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
    "ep,fsdp,hsdp": "dp_replicate=2,fsdp=2,ep=2",
    "tp,hsdp": "dp_replicate=2,fsdp=2,tp=2",  # on 8 ranks (`_world`)
    "fsdp,cp": "cp=2,fsdp=2",
    "tp,cp": "cp=2,tp=2",  # FSDP2 over the 2 cp ranks (train/parallel.py `Plan.shard_ranks`)
    "ep,fsdp,cp": "cp=2,ep=2,fsdp=2",
    # pipeline kinds: the rank layouts the search suggests (`pp=P[,tp=T][,fsdp=F]`, no dp), at 2 stages
    "tp,pp": "pp=2,tp=2,fsdp=2",
    "fsdp,pp": "pp=2,fsdp=2",
    "dp,pp": "pp=2",
    "ep,fsdp,pp": "pp=2,ep=2",  # fsdp=2 implied (train/pipeline_moe.py)
    "tp,ep,pp": "pp=2,tp=2,ep=2,fsdp=2",  # on 8 ranks
}


def _searched(bench, tier, gpus: int, mem: int):
    """(rows, suggestion) as `ttt plan` searches without --parallel: at the tier's GBS, else at a legal GBS
    of the RCP table, with the rows it offers at another legal GBS beside a TP suggestion."""
    retier = None
    if follows_rcp_table(bench, tier):

        def retier(gbs):
            return apply_overrides(bench, tier, [f"global_batch_size={gbs}"])

    _, (_, rows, best), _ = plan_at_legal_gbs(
        bench, tier, gpus, lambda t: plan(bench, t, gpus, mem, None), retier
    )
    return rows, best


def _suggested_kinds() -> list[tuple[str, str]]:
    out = set()
    offered = set()  # (name, kind, family) of the fitting rows at another GBS than the suggestion's
    cp_families = set()  # one cp build per model family (llama31_8b's stands for llama31_405b's)
    cp_ep = False  # one cp with ep build: the same code for both MoE families (tests/test_layouts_cp_ep.py)
    for name in registry.names():
        bench = registry.get(name)
        if "reference" not in bench.tiers or "tiny" not in bench.tiers:
            continue
        tier = bench.tier("reference")
        for gpus in (8, 64, 256, 1024, 4096):
            for mem in (80, 141, 192):
                try:
                    rows, best = _searched(bench, tier, gpus, mem)
                except UserError:  # no memory model (rgat, DLRM's tables: their own plan), or no split
                    continue
                # 4,096 GPUs for the pipeline kinds only (where 405B's batch needs a pipeline to split; on
                # 2,048 the CP pair across nodes splits it); the grid of docs/scale.md, which the other
                # kinds stand for, stops at 1,024
                if best is not None and (gpus <= 1024 or "pp=" in best.parallel):
                    out.add((name, _kind_of(best.parallel, gpus)))
                    cap = HEADROOM * mem * GiB
                    offered |= {
                        (name, _kind_of(r.parallel, gpus), bench.family.name)
                        for r in rows
                        if r.gbs != best.gbs and r.total <= cap
                    }
        try:  # where `ttt run` takes cp, the search may suggest it (on small enough devices)
            context_parallel.check(bench, tier, parallel.parse("cp=2,fsdp=4", 8), "cp=2,fsdp=4")
        except UserError:
            continue
        if bench.family.name not in cp_families:
            cp_families.add(bench.family.name)
            out.add((name, "fsdp,cp"))
            try:  # and with tp where `ttt run` takes both (the llama family), the search's cp x tp
                given = parallel.parse("cp=2,tp=2,fsdp=2", 8)
                parallel.check_tensor_parallel(bench.family, tier.model, "tp=2", 2, bench.task)
                context_parallel.check(bench, tier, given, "cp=2,tp=2,fsdp=2")
                out.add((name, "tp,cp"))
            except UserError:
                pass
        if hasattr(tier.model, "n_experts") and not cp_ep:  # the search tries cp with ep for an MoE model
            cp_ep = True
            out.add((name, "ep,fsdp,cp"))
    # An offered kind once per model family, where no suggestion of the family builds it already.
    built = {(registry.get(n).family.name, k) for n, k in out}
    for name, kind, family in sorted(offered):
        if (family, kind) not in built:
            built.add((family, kind))
            out.add((name, kind))
    return sorted((n, k) for n, k in out if k != "dp")


def _kind_of(spec: str, gpus: int) -> str:
    p = parallel.parse(spec, gpus, world_from="--gpus is")
    hsdp = ",hsdp" if p.dp_replicate > 1 and _kind(p) != "hsdp" else ""  # HSDP x TP, HSDP x EP
    return _kind(p) + hsdp + (",cp" if p.cp > 1 else "") + (",pp" if p.pp > 1 else "")


def _world(spec: str) -> int:
    """The ranks a small layout runs on: the product of its degrees where they all multiply (a pipeline's,
    HSDP x TP's: 2 x 2 x 2), else `WORLD` (ep overlaps the data-parallel ranks; `tp=2,ep=2` implies fsdp)."""
    degrees = dict(d.split("=") for d in spec.split(","))
    if "pp" in degrees or ("dp_replicate" in degrees and "tp" in degrees):
        # (with fsdp named, ep splits its ranks: `pp=2,ep=2,fsdp=4` is 8 ranks)
        return math.prod(int(v) for k, v in degrees.items() if not (k == "ep" and "fsdp" in degrees))
    return WORLD


def _small_batch(tier, world: int):
    """Two samples a rank (GRPO: two whole groups of generations a rank, which its ranks must own)."""
    groups = getattr(tier.data, "generations", 1)
    return dataclasses.replace(tier, global_batch_size=world * 2 * groups, eval_samples=world * 2)


@pytest.mark.parametrize("name,kind", _suggested_kinds())
def test_every_suggested_kind_builds(name, kind):
    bench, tier = prepare.resolve_tier(name, "tiny", [])
    spec = SMALL[kind]
    world = _world(spec)
    tier = _small_batch(tier, world)
    # A pipeline's first and last ranks hold different modules (module docstring); others the last rank.
    for rank in (0, world - 1) if ",pp" in kind else (world - 1,):
        got = _in_child(simulate_rank, bench, tier, world, spec, rank, "fp32", False)
        assert got.parameters > 0 and got.gradients > 0 and got.optimizer > 0, rank


# Kinds no reference tier's search reaches but `ttt plan --parallel` counts, built the same way: pipeline
# stages with LoRA (llama2_70b_lora's reference fits without pp wherever the grid looks) and with
# `--precision fp8` (the grid plans bf16); pipeline with expert parallelism (`pp=2,ep=2`, fsdp=2 implied);
# DeepSeek-V3 under its TP plan (models/deepseek_v3/parallelize.py;
# the search tries TP only where nothing without it fits or splits the batch). qwen35_397b_grpo refuses tp
# (its rollouts decode: train/parallel.py).
NAMED = [
    ("llama2_70b_lora", "dp=4", "bf16"),
    ("llama2_70b_lora", "pp=2,fsdp=2", "fp32"),
    ("llama2_70b_lora", "pp=2,tp=2,fsdp=2", "fp32"),
    ("llama31_8b", "pp=2,fsdp=2", "fp8"),
    ("llama31_8b", "pp=2,tp=2,fsdp=2", "fp8"),
    ("deepseekv3_671b", "tp=2,ep=2", "fp32"),
    ("deepseekv3_671b", "tp=2,fsdp=2", "fp32"),
    # gpt_oss's TP x EP: suggested where no CP layout fits or splits the batch (an MoE model tries CP first,
    # so no grid cell reaches it since)
    ("gpt_oss_20b", "tp=2,ep=2", "bf16"),
    # the hybrid with its expert slices sharded over their 2 replicas (FSDP2 wraps of their own, bf16
    # gathers), which the search offers only where GPUs outnumber the experts (1,024 for DeepSeek-V3)
    ("deepseekv3_671b", "ep=2,fsdp=4", "bf16"),
    # pipeline with expert parallelism: the search's last resort for an MoE model, reached by no grid cell
    # (a stage holds the same states per GPU as the layout without pp, plus its gradients whole)
    ("deepseekv3_671b", "pp=2,ep=2", "fp32"),
    ("gpt_oss_20b", "pp=2,ep=2", "fp32"),
    # and with each stage's expert slices sharded over their 2 holders (8 ranks)
    ("gpt_oss_20b", "pp=2,ep=2,fsdp=4", "bf16"),
    # and with tensor parallelism within each stage (8 ranks: the kind `tp,ep,pp` of `SMALL`)
    ("deepseekv3_671b", "pp=2,tp=2,ep=2,fsdp=2", "fp32"),
    ("gpt_oss_20b", "pp=2,tp=2,ep=2,fsdp=2", "bf16"),
]


@pytest.mark.parametrize("name,spec,precision", NAMED)
def test_named_kind_builds(name, spec, precision):
    bench, tier = prepare.resolve_tier(name, "tiny", [])
    pipeline = "pp=" in spec
    world = _world(spec)
    tier = _small_batch(tier, world)
    for rank in (0, world - 1) if pipeline else (world - 1,):
        got = _in_child(simulate_rank, bench, tier, world, spec, rank, precision, False)
        assert got.parameters > 0 and got.gradients > 0 and got.optimizer > 0, rank
        if name == "llama2_70b_lora":  # the frozen base: gradients and AdamW's two moments for adapters only
            assert got.gradients * 2 <= got.optimizer < got.parameters / 10, rank
