"""Which device to run on and how to name the platform in a log."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform

import torch

from timetotrain.errors import UserError


def resolve(spec: str | None, local_rank: int = 0) -> torch.device:
    """The device `--device SPEC` names, checked to exist here, else a UserError naming what this host has.

    Preflight calls this before any data is hashed or log line written: torch itself only fails at the
    first allocation (after init_start) and with a multi-line message. Default: this rank's GPU when CUDA
    has one, else the CPU. Under torchrun a bare `cuda` is the local rank's GPU."""
    if not spec:
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {spec!r} is not a torch device name: use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda is not None or torch.version.hip is not None
            why = "no GPU is visible" if built else "this torch is built without CUDA"
            raise UserError(f"--device {spec}: this host has no CUDA device ({why}): use --device cpu")
        index = local_rank if device.index is None else device.index
        count = torch.cuda.device_count()
        if index >= count:
            rank = f" for local rank {local_rank}" if device.index is None else ""
            raise UserError(
                f"--device {spec}: this host has {count} CUDA device(s), cuda:0..cuda:{count - 1}, "
                f"not cuda:{index}{rank}: pick one of them (or fewer processes per node)"
            )
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {spec}: this host has no Apple MPS device: use --device cpu")
    if device.type == "meta":
        raise UserError("--device meta holds no data and cannot train: use cpu, cuda or cuda:N")
    try:  # xpu, ...: whether a backend is usable shows only when it allocates
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, AttributeError):
        raise UserError(f"--device {spec}: torch cannot use this device here: use --device cpu") from None
    return device


@contextlib.contextmanager
def threads_kept():
    """Restores torch's intra-op thread count on exit: a tier's count (`set_cpu_threads`) holds for its run,
    not for what the process does next (a test session, a notebook, runs of other tiers in one process)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def set_cpu_threads(tier_threads: int | None) -> bool:
    """Takes a tier's CPU thread count (`Tier.cpu_threads`) unless the user chose one with OMP_NUM_THREADS,
    which always wins; True when the tier's count was applied."""
    if tier_threads is None or os.environ.get("OMP_NUM_THREADS"):
        return False
    torch.set_num_threads(tier_threads)
    return True


def platform_name(device: torch.device, world: int = 1) -> str:
    """`submission_platform`: processes x accelerator, or the host CPU for CPU runs."""
    if device.type == "cuda":
        return f"{world}x{torch.cuda.get_device_name(device)}"
    host = f"{os.cpu_count()}-core {cpu_model()}"
    return host if world == 1 else f"{world} processes on {host}"


def cpu_info(key: str) -> str | None:
    """The first value of `key` in /proc/cpuinfo ("model name", "vendor_id", ...), None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return cpu_info("model name") or platform.processor() or platform.machine()


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def keep_freed_memory() -> bool:
    """CPU runs: ask glibc to keep freed memory in the process instead of handing it back to the OS.

    By default glibc serves every block above its mmap threshold (at most 32 MB) with a fresh mapping and
    unmaps it on free, so a training step that allocates the same large activations every step page-faults
    them in again every step: on the 2-core development machine that was 3-8% of a step (bench/vs_hf.py's
    configs, measured in separate processes). Raising both thresholds lets the heap reuse those blocks.
    Left alone when the user configured the allocator (MALLOC_*_ / GLIBC_TUNABLES / LD_PRELOAD) or libc is
    not glibc. Returns whether it applied.
    """
    if any(os.environ.get(k) for k in _MALLOC_ENV) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        big = ctypes.c_int(2**31 - 1)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, big)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, big))
    except (OSError, AttributeError):
        return False
