"""torch.distributed set-up from the environment `torchrun` provides (RANK, WORLD_SIZE, LOCAL_RANK)."""

from __future__ import annotations

import datetime
import gc
import os
import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist

from timetotrain.train.device import keep_freed_memory
from timetotrain.train.device import resolve as resolve_device


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def from_env() -> Dist:
    return Dist(
        rank=int(os.environ.get("RANK", "0")),
        world=int(os.environ.get("WORLD_SIZE", "1")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def setup(d: Dist, device_pref: str | None, timeout_s: float = 600.0) -> torch.device:
    """Pick this rank's device and join the process group (NCCL on GPUs, gloo on CPUs)."""
    device = resolve_device(device_pref, d.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    if d.active and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def all_reduce(values: list[float], op: str = "sum", device: torch.device | None = None) -> list[float]:
    if not dist.is_initialized():
        return list(values)
    dev = device if device is not None and dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def all_gather(values: list[float], device: torch.device | None = None) -> list[list[float]]:
    """Every rank's `values`, in rank order (one collective; [values] without a process group)."""
    if not dist.is_initialized():
        return [list(values)]
    dev = device if device is not None and dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def teardown(barrier: bool = False) -> None:
    """Leave the process group. Callers drop their DDP-wrapped model first: a reducer that outlives its
    process group can abort the interpreter at exit ("terminate called without an active exception").
    `barrier` (normal completion only; a failed peer would make it hang) keeps one rank from tearing down
    while another still has collectives in flight."""
    if dist.is_initialized():
        gc.collect()
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def shared_seed(seed: int | None, device: torch.device) -> int:
    """One seed for every rank (identical initial weights, one data order): the user's, or rank 0's fresh
    one broadcast to the others."""
    if seed is None:
        seed = secrets.randbelow(2**31 - 1)
    if dist.is_initialized():
        dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([seed], dtype=torch.int64, device=dev)
        dist.broadcast(t, src=0)
        seed = int(t.item())
    return seed
