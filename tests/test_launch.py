"""Every launch line `ttt plan` prints, for every benchmark's reference tier on one node and on many, is one
that torchrun's own argument parser reads as --gpus processes over whole nodes, and whose ttt command line
`ttt`'s own parser accepts (timetotrain/train/launch.py)."""

import shlex

import pytest
from torch.distributed.run import get_args_parser

from timetotrain.cli import build_parser
from timetotrain.errors import UserError
from timetotrain.spec import registry
from timetotrain.train.embedding_memory import per_rank
from timetotrain.train.memory import launch, plan

GPUS = (8, 64, 256)


def _launches(name: str, gpus: int, gpus_per_node: int) -> list[dict]:
    bench = registry.get(name)
    tier = bench.tier("reference")
    if hasattr(tier.model, "table_sizes"):  # DLRM: the per-rank table plan
        line = per_rank(bench, tier, gpus, 80, gpus_per_node)["launch"]
        return [line] if line is not None else []  # none where nothing fits (dlrmv4's padded attention)
    try:
        _, _, best = plan(bench, tier, gpus, 80, None, gpus_per_node=gpus_per_node)
    except UserError:  # a benchmark the formula refuses at this size: nothing to launch
        return []
    return [] if best is None else [launch(bench, tier, best, gpus, gpus_per_node)]


def _check_torchrun(line: str, gpus: int, gpus_per_node: int) -> None:
    words = shlex.split(line)
    assert words[0] == "torchrun", line
    args = get_args_parser().parse_args(words[1:])
    nodes = int(str(args.nnodes).split(":")[0])
    assert nodes * int(args.nproc_per_node) == gpus, line
    assert int(args.nproc_per_node) <= gpus_per_node, line
    if nodes > 1:
        assert args.rdzv_backend == "c10d" and args.rdzv_endpoint.endswith(":29500"), line
    assert args.module and args.training_script == "timetotrain", line
    build_parser().parse_args(args.training_script_args)  # exits (SystemExit) on a flag ttt does not know


@pytest.mark.parametrize("name", [n for n in registry.names() if "reference" in registry.get(n).tiers])
@pytest.mark.parametrize("gpus_per_node", [8, 4])
def test_every_launch_line_parses_as_whole_nodes(name, gpus_per_node):
    seen = 0
    for gpus in GPUS:
        for how in _launches(name, gpus, gpus_per_node):
            seen += 1
            _check_torchrun(how["command"].replace("$MASTER_ADDR", "head"), gpus, gpus_per_node)
            assert (how["nodes"] > 1) == ("slurm" in how) == (gpus > gpus_per_node)
            if "slurm" in how:
                srun = how["slurm"][-1]
                assert (
                    srun.startswith("srun torchrun ")
                    and f"--gpus-per-node={gpus_per_node}" in how["slurm"][1]
                )
                line = srun.removeprefix("srun ").replace('"$SLURM_NNODES"', str(how["nodes"]))
                _check_torchrun(line, gpus, gpus_per_node)
    if not seen:  # rgat has no memory model (one line says so); qwen35_397b_grpo fits nowhere without CP
        pytest.skip(f"{name}: `ttt plan` suggests no layout on {GPUS} GPUs of 80 GiB")


def test_a_context_parallel_suggestion_launches():
    """The search's last resort (train/memory.py): qwen35_397b_grpo on 256 x 141 GiB, where only
    cp=C,fsdp=F fits, on nodes of 8 GPUs and of 16; its launch line carries that --parallel, which `ttt run`
    parses."""
    from timetotrain.train import parallel

    bench = registry.get("qwen35_397b_grpo")
    tier = bench.tier("reference")
    for gpus_per_node in (8, 16):
        _, _, best = plan(bench, tier, 256, 141, None, gpus_per_node=gpus_per_node)
        assert ",cp=" in best.parallel
        line = launch(bench, tier, best, 256, gpus_per_node)["command"].replace("$MASTER_ADDR", "head")
        _check_torchrun(line, 256, gpus_per_node)
        args = build_parser().parse_args(
            get_args_parser().parse_args(shlex.split(line)[1:]).training_script_args
        )
        assert parallel.parse(args.parallel, 256).cp > 1


def test_a_pipeline_suggestion_launches():
    """The search's last resorts (train/memory.py) for llama31_405b on 80 GiB, where GBS 1152 splits over at
    most 128 data-parallel ranks: on 2,048 GPUs in nodes of 8 the CP pair across two nodes, TP filling each
    (`cp=2,tp=8,fsdp=128`); where that pair does not split it either, a pipeline: 4,096 GPUs in nodes of 8,
    2,048 in nodes of 4 (TP within a node: tp=4 there, and more stages to fit). The line is the GPUs'
    processes over whole nodes, and its --parallel is one `ttt run` parses (its preflight:
    tests/test_plan.py)."""
    from timetotrain.train import parallel

    bench = registry.get("llama31_405b")
    tier = bench.tier("reference")
    cases = ((2048, 8, "fsdp=128,cp=2,tp=8"), (4096, 8, "pp=8,tp=8,fsdp=64"), (2048, 4, "pp=16,tp=4,fsdp=32"))
    for gpus, gpus_per_node, want in cases:
        _, _, best = plan(bench, tier, gpus, 80, None, gpus_per_node=gpus_per_node)
        assert best.parallel == want
        line = launch(bench, tier, best, gpus, gpus_per_node)["command"].replace("$MASTER_ADDR", "head")
        _check_torchrun(line, gpus, gpus_per_node)
        args = build_parser().parse_args(
            get_args_parser().parse_args(shlex.split(line)[1:]).training_script_args
        )
        given = parallel.parse(args.parallel, gpus)
        # TP fills a node; the batch takes a CP pair across two nodes or pipeline stages, never both
        assert given.tp == gpus_per_node and (given.cp > 1) != (given.pp > 1)
        assert args.set == ["micro_batch_size=1"]
