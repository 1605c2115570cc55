"""Which device to run on and how to name the platform in a log."""

from __future__ import annotations

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
