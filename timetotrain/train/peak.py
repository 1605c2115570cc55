"""Peak throughput a device can deliver, for MFU, and the host load it was measured under.

Accelerators: vendor datasheet peaks for dense BF16 tensor-core math (no 2:4 sparsity), per device.

CPUs: no table can know the host, so two figures are taken and MFU divides by the larger.
- measured: the best fp32 matmul rate of many one-matmul windows over a second. One half-second burst on a
  busy host measured a fraction of the cores (1.9 GFLOP/s on a 2-core AVX-512 host) and turned the same
  throughput into "MFU 67%"; the best window of many is the one the neighbours left alone.
- theoretical: threads x clock x fp32 FLOPs per cycle of the widest FMA the CPU's flags name (/proc/cpuinfo;
  the clock from cpufreq's maximum where the kernel exposes it, else the `cpu MHz` line). A busy host cannot
  lower it, so it caps what a busy measurement can do to MFU.
The larger of the two is an upper bound of what the cores can do, so MFU against it is a lower bound. Both are
of the threads the run used, not of every core of the host: a synth that took 1 of 2 cores because the
other was busy (train/free_cores.py) divides by one core's peak.

The 1-minute load average is read around the measurement: a host whose other processes want more cores
than this run leaves free is busy, and the figures say so instead of passing for the machine's.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

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

CPUINFO = Path("/proc/cpuinfo")
SYS_CPU = Path("/sys/devices/system/cpu")


def accelerator_peak(name: str) -> tuple[float, str] | None:
    """(peak FLOP/s, description) for a known accelerator name, else None."""
    for key, tflops in BF16_DENSE_TFLOPS:
        if key.lower() in name.lower():
            return tflops * 1e12, f"{key} datasheet, dense BF16"
    return None


def measure_cpu_peak(seconds: float = 1.0, n: int = 1024) -> float:
    """Best fp32 matmul FLOP/s of many one-matmul windows over `seconds`, at torch's current thread count."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # first call pays for thread-pool start-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def read_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo (every core of a host reports the same)."""
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if info:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
    return info


def flops_per_cycle(info: dict[str, str]) -> tuple[int, str] | None:
    """fp32 FLOPs one core can issue per cycle (two FMA pipes of the widest vector the flags name), and the
    words for it; None where the flags say nothing we know (not x86)."""
    flags = set(info.get("flags", "").split())
    if not flags:
        return None
    amd = info.get("vendor_id") == "AuthenticAMD"
    family = int(info.get("cpu family", "0") or 0)
    if "avx512f" in flags:
        if amd and family < 26:  # Zen 4 runs a 512-bit FMA as two 256-bit halves; Zen 5 has full width
            return 32, "AVX-512 FMA on 256-bit pipes, AMD Zen 4"
        return 64, "AVX-512, 2 FMA pipes"
    if "avx2" in flags and "fma" in flags:
        return 32, "AVX2, 2 FMA pipes"
    if "avx" in flags:
        return 16, "AVX, add + multiply"
    if "sse2" in flags:
        return 8, "SSE2, add + multiply"
    return None


def cpu_clock_hz(info: dict[str, str], sys_cpu: Path = SYS_CPU) -> tuple[float, str] | None:
    """The highest clock a core reaches: cpufreq's maximum (boost included), else the `cpu MHz` /proc/cpuinfo
    reports (a virtual machine's nominal clock, or the current one)."""
    try:
        khz = int((sys_cpu / "cpu0" / "cpufreq" / "cpuinfo_max_freq").read_text().split()[0])
        return khz * 1e3, "cpufreq max"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return float(info["cpu MHz"]) * 1e6, "/proc/cpuinfo cpu MHz"
    except (KeyError, ValueError):
        return None


def theoretical_cpu_peak(
    cores: int, cpuinfo: Path = CPUINFO, sys_cpu: Path = SYS_CPU
) -> tuple[float, str] | None:
    """(cores x clock x FLOPs/cycle, how it was made), or None where the CPU or its clock is unknown."""
    try:
        info = read_cpuinfo(cpuinfo.read_text())
    except OSError:
        return None
    width, clock = flops_per_cycle(info), cpu_clock_hz(info, sys_cpu)
    if width is None or clock is None:
        return None
    (per_cycle, what), (hz, where) = width, clock
    return cores * hz * per_cycle, f"{cores} x {hz / 1e9:.2f} GHz ({where}) x {per_cycle} FLOP/cycle ({what})"


@dataclass(frozen=True)
class CpuPeak:
    """The two CPU peaks and which one MFU divides by (the larger: a busy measurement cannot inflate MFU)."""

    measured: float
    theoretical: float | None
    theoretical_source: str
    threads: int

    @property
    def flops(self) -> float:
        return max(self.measured, self.theoretical or 0.0)

    def describe(self) -> str:
        counted = f"{self.threads} thread" + ("" if self.threads == 1 else "s")
        theory = (
            f"theoretical {_gflops(self.theoretical)}: {self.theoretical_source}"
            if self.theoretical
            else f"no theoretical peak ({self.theoretical_source})"
        )
        used = "theoretical" if self.theoretical and self.theoretical >= self.measured else "measured"
        return f"the {used} one; measured fp32 matmul peak {_gflops(self.measured)}, {counted}; {theory}"


def cpu_peak(threads: int | None = None) -> CpuPeak:
    """Both CPU peaks for `threads` threads, one core each (default: torch's thread count; at most the CPUs
    this process may run on)."""
    threads = threads or torch.get_num_threads()
    cores = min(threads, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else threads
    theory = theoretical_cpu_peak(cores)
    measured = measure_cpu_peak()
    if theory is None:
        return CpuPeak(measured, None, "CPU flags or clock unknown", threads)
    return CpuPeak(measured, theory[0], theory[1], threads)


def _gflops(v: float) -> str:
    return f"{v / 1e9:,.1f} GFLOP/s"


# -- the host's load --


def load_average() -> float | None:
    """The 1-minute load average (runnable + uninterruptible tasks, an exponential average over a minute)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def others_load(load: float, own_cores: int, own_seconds: float) -> float:
    """The part of a 1-minute load average that is not this process: `own_cores` busy threads for
    `own_seconds` raise the average by own_cores x (1 - e^(-t/60)) (Linux's exponential average)."""
    return max(0.0, load - own_cores * (1.0 - math.exp(-own_seconds / 60.0)))


def host_busy(others: float, cores_used: int, cpu_count: int | None = None) -> bool:
    """Whether other processes want more cores than this run leaves free (half a core of slack)."""
    cpu_count = cpu_count or os.cpu_count() or cores_used
    return others > max(0, cpu_count - cores_used) + 0.5


def load_note(loads: list[float | None], busy: bool, cores_used: int) -> str:
    """One line: the load averages measured under, and a warning when the host was busy."""
    seen = [f"{x:.2f}" for x in loads if x is not None]
    if not seen:
        return "load average: unknown on this platform"
    line = f"load average (1 min) {' -> '.join(seen)} on {os.cpu_count()} CPUs, {cores_used} used here"
    if busy:
        line += (
            "; WARNING: busy host (other processes want the cores used here): throughput reads low and MFU "
            "is a lower bound; measure again on an idle host"
        )
    return line
