"""Which device to run on and how to name the platform in a log."""

from __future__ import annotations

import os
import platform

import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def platform_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"1x{torch.cuda.get_device_name(device)}"
    return f"{os.cpu_count()}-core {_cpu_model()}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
