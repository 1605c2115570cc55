"""Peak throughput a device can deliver, for MFU.

Accelerators: vendor datasheet peaks for dense BF16 tensor-core math (no 2:4 sparsity), per device.
CPUs: no table can know the host, so `measure_cpu_peak` times large fp32 matmuls for a moment during init.
"""

from __future__ import annotations

import time

import torch

# (substring of torch.cuda.get_device_name, dense BF16 TFLOP/s per device). Order matters: the first
# match wins, so the more specific names come first.
BF16_DENSE_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB300", 2500.0),
    ("GB200", 2500.0),
    ("B300", 2250.0),
    ("B200", 2250.0),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("A100", 312.0),
    ("MI355X", 2516.6),
    ("MI325X", 1307.4),
    ("MI300X", 1307.4),
)


def accelerator_peak(name: str) -> tuple[float, str] | None:
    """(peak FLOP/s, description) for a known accelerator name, else None."""
    for key, tflops in BF16_DENSE_TFLOPS:
        if key.lower() in name.lower():
            return tflops * 1e12, f"{key} datasheet, dense BF16"
    return None


def measure_cpu_peak(seconds: float = 0.5, n: int = 1024) -> float:
    """Best observed fp32 matmul FLOP/s on this host with torch's current thread count."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # first call pays for thread-pool start-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b, out=out)
        dt = time.perf_counter() - t0
        best = max(best, 4 * 2 * n**3 / dt)
    return best
