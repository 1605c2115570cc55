"""Which device to run on and how to name the platform in a log."""

from __future__ import annotations

import ctypes
import os
import platform

import torch


def platform_name(device: torch.device, world: int = 1) -> str:
    """`submission_platform`: processes x accelerator, or the host CPU for CPU runs."""
    if device.type == "cuda":
        return f"{world}x{torch.cuda.get_device_name(device)}"
    host = f"{os.cpu_count()}-core {_cpu_model()}"
    return host if world == 1 else f"{world} processes on {host}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
