"""The launch line of a `ttt plan` suggestion, for every benchmark: one torchrun on one node, or the same
torchrun on every node with a c10d rendezvous, and that line in an sbatch script (docs/scale-out.md).

One builder for the decoders' plan (train/memory.py) and the embedding-table plan (train/embedding_memory.py),
so that no benchmark's line says `--nproc_per_node 64` where a node has 8 GPUs."""

from __future__ import annotations

from timetotrain.errors import UserError
from timetotrain.spec.benchmark import init_needed

_RDZV = '--rdzv-backend c10d --rdzv-endpoint "{}:29500" --rdzv-id {}'


def check_nodes(gpus: int, gpus_per_node: int) -> int:
    """The node count of --gpus on nodes of --gpus-per-node (one node when --gpus fits in one)."""
    if gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {gpus_per_node} must be at least 1")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise UserError(
            f"--gpus {gpus} is not a whole number of nodes of --gpus-per-node {gpus_per_node}: use a multiple "
            f"of {gpus_per_node}, or set --gpus-per-node to the GPUs each node has"
        )
    return max(1, gpus // gpus_per_node)


def before_launch(bench, tier) -> dict:
    """What a run of `tier` needs before its launch line: {"init_checkpoint": the checkpoint to pass as
    --init-checkpoint CKPT, in a user's words, or None (the family's init, or a shipped base the run loads
    itself); "data": the `ttt data prepare` line that makes the tier's data from a folder of raw sources, or
    None where no recipe here makes it; "docs": the benchmark's page, which says where both come from}."""
    data = None
    if bench.task.data_name(tier) is not None:
        data = f"ttt data prepare --for {bench.name} --tier {tier.name} --src SRC --out DATA"
    return {
        "init_checkpoint": init_needed(bench, tier),
        "data": data,
        "docs": f"docs/benchmarks/{bench.name}.md",
    }


def launch_lines(
    bench_name: str, tier_name: str, flags: str, gpus: int, gpus_per_node: int, before: dict | None = None
) -> dict:
    """{"nodes", "gpus_per_node", "command"} and, on more than one node, "slurm": the lines of an sbatch
    script. `flags` are the `ttt run` flags after `--data DATA --logdir LOGS`; `before` (`before_launch`) adds
    --init-checkpoint CKPT where the tier starts from a checkpoint, and is kept under "before"."""
    nodes = check_nodes(gpus, gpus_per_node)
    per_node = gpus // nodes
    if before is not None and before["init_checkpoint"]:
        flags = f"--init-checkpoint CKPT {flags}"
    run = f"-m timetotrain run {bench_name} --tier {tier_name} --data DATA --logdir LOGS {flags}".rstrip()
    doc = {"nodes": nodes, "gpus_per_node": per_node}
    if before is not None:
        doc["before"] = before
    if nodes == 1:
        doc["command"] = f"torchrun --nproc_per_node {per_node} {run}"
        return doc
    doc["command"] = (
        f"torchrun --nnodes {nodes} --nproc_per_node {per_node} {_RDZV.format('$MASTER_ADDR', bench_name)} {run}"
    )
    doc["slurm"] = [
        "#!/bin/bash",
        f"#SBATCH --nodes={nodes} --ntasks-per-node=1 --gpus-per-node={per_node} --exclusive",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node {per_node} '
        + _RDZV.format("$head", '"$SLURM_JOB_ID"')
        + f" {run}",
    ]
    return doc


def format_launch(how: dict) -> list[str]:
    """The lines `ttt plan` prints for a launch (indented by its caller): what to make first, then the
    launch."""
    first = _before_lines(how.get("before"))
    if how["nodes"] == 1:
        return first + [how["command"]]
    return first + [
        f"on each of the {how['nodes']} nodes ({how['gpus_per_node']} GPUs each; MASTER_ADDR: the address of "
        "one of them):",
        how["command"],
        "or under Slurm (sbatch):",
        *(f"  {line}" for line in how["slurm"]),
    ]


def _before_lines(before: dict | None) -> list[str]:
    """The steps before the launch line of a tier that starts from a checkpoint (continued pretraining,
    fine-tuning): the checkpoint (CKPT) and the data (DATA). Other tiers' lines need only --data DATA."""
    if before is None or not before["init_checkpoint"]:
        return []
    out = ["first:"]
    if before["init_checkpoint"]:
        out.append(f"  CKPT: {before['init_checkpoint']} ({before['docs']})")
    if before["data"]:
        out.append(f"  DATA: {before['data']}   # SRC: the raw sources ({before['docs']})")
    else:
        out.append(f"  DATA: prepared as {before['docs']} says")
    return out + ["then:"]
