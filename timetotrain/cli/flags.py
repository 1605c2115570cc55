"""The flags several commands take, declared once: each command's parser is built from these groups (and
its own flags), so that `--parallel`, `--precision`, `--ac` or `--set` read and parse the same in `ttt run`,
`ttt synth`, `ttt plan`, `ttt rcp build` and `ttt base`. Where a command gives a flag another meaning
(`ttt plan --parallel`: the one layout to plan), the caller passes that help text; the flag stays one."""

from __future__ import annotations

import argparse

PRECISIONS = ("fp32", "bf16", "fp8")

PARALLEL_HELP = (
    "under torchrun: dp=N (DDP), fsdp=N (FSDP2, sharded per block), ep=N or ep=N,fsdp=N (MoE experts split "
    "over the N ranks) or tp=T[,fsdp=F] (tensor parallel, Llama-family decoders); default dp over all processes"
)
PRECISION_HELP = (
    "bf16: autocast (DDP) or bf16 parameters with fp32 master weights and fp32 reduce (FSDP2); fp8: torchao "
    "float8 block linears (--set fp8_recipe=tensorwise|rowwise|rowwise_with_gw_hp, or MXFP8: "
    "mxfp8|mxfp8_with_gw_hp), the rest bf16 on GPU, fp32 on CPU; needs pip install 'timetotrain[fp8]'"
)
AC_HELP = (
    "activation checkpointing of every block: each keeps only its input and recomputes the rest in the "
    "backward (least activation memory, about a third more compute)"
)


def add_benchmark(s: argparse.ArgumentParser, tier_help: str, tier_default: str | None = None) -> None:
    """BENCH and --tier (required where the command has no default tier)."""
    s.add_argument("benchmark", help="benchmark name (see `ttt list`)")
    s.add_argument("--tier", default=tier_default, required=tier_default is None, help=tier_help)


def add_set(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="change a tier setting (repeatable), e.g. --set global_batch_size=32 or --set seq_len=4096",
    )


def add_device(s: argparse.ArgumentParser, default: str = "cuda if available, else cpu") -> None:
    s.add_argument("--device", default=None, help=f"torch device (default: {default})")


def add_run_set(s: argparse.ArgumentParser, runs: int) -> None:
    """What a set of timed runs reads and writes (`ttt run`, `ttt rcp build`): the data, the log folder, the
    seeds, the starting weights."""
    s.add_argument("--data", required=True, help="folder with the prepared dataset (`ttt data prepare`)")
    s.add_argument("--logdir", required=True, help="where result files go (created if missing)")
    s.add_argument(
        "--seed",
        type=int,
        default=None,
        help="run seed (default: fresh random, logged); with --runs: SEED, SEED+1, ...",
    )
    s.add_argument(
        "--runs",
        type=int,
        default=runs,
        help=f"N consecutive runs, distinct seeds, one result file each (default {runs})",
    )
    s.add_argument(
        "--init-checkpoint",
        default=None,
        help="start from these weights instead of the benchmark's init: a Hugging Face safetensors folder "
        "(model.safetensors or an index + shards), a ttt checkpoint folder, or the base folder `ttt base` "
        "printed; loaded during init",
    )


def add_layout(
    s: argparse.ArgumentParser,
    precision_default: str | None,
    parallel_help: str = PARALLEL_HELP,
    precision_help: str = PRECISION_HELP,
    ac_help: str = AC_HELP,
    compile: bool = True,
) -> None:
    """--parallel, --precision, --ac, --ac-every K and --compile (train/parallel.py: Plan). The precision
    choices list the default first; without one, the help says the device decides."""
    g = s.add_argument_group("parallelism and precision")
    g.add_argument("--parallel", default=None, help=parallel_help)
    g.add_argument(
        "--precision",
        choices=sorted(PRECISIONS, key=lambda p: p != precision_default),
        default=precision_default,
        help=precision_help + ("" if precision_default else "; default bf16 on GPU, fp32 on CPU"),
    )
    g.add_argument("--ac", action="store_true", help=ac_help)
    g.add_argument(
        "--ac-every",
        type=int,
        default=None,
        metavar="K",
        help="selective activation checkpointing: checkpoint every K-th block (blocks 0, K, 2K, ...), the "
        "others keep their activations; K=1 is --ac, K=2 halves the recomputation and keeps half the blocks' "
        "activations. Between the two in memory and speed; `ttt plan --ac-every K` estimates it",
    )
    if compile:
        g.add_argument("--compile", action="store_true", help="torch.compile each block")


def add_trackers(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("experiment trackers")
    g.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="also write TensorBoard events under DIR (train_loss, eval, lr, items/s, MoE expert load); "
        "needs pip install 'timetotrain[tensorboard]'",
    )
    g.add_argument(
        "--wandb",
        action="store_true",
        help="also log to Weights & Biases, offline unless WANDB_MODE is set (files under <logdir>/wandb); "
        "needs pip install 'timetotrain[wandb]'",
    )


def add_dry_run(s: argparse.ArgumentParser, shows: str) -> None:
    s.add_argument(
        "--dry-run",
        "--print-config",
        action="store_true",
        help=f"print the resolved tier (each setting and where it came from), {shows}, then exit: no model "
        "built, nothing written (with --json: one JSON object)",
    )
