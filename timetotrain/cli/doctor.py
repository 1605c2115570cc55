"""`ttt doctor`: the environment ttt runs in, on one screen (or as JSON): versions, devices and the peak
FLOP/s MFU is computed against on each, the official logging package, and which optional peers are installed.

What a bug report needs, and what decides a run's figures: the torch build (CUDA or ROCm, NCCL), the devices,
and the peak that `ttt synth` divides by (train/peak.py: a datasheet figure per accelerator; on a CPU the larger
of a measured matmul peak and the theoretical one at the threads `ttt synth` would take, beside the free cores
and the load average it was measured under).

torch and the train modules are imported inside the functions that need them: `ttt --version` reads
`version()` here and should not wait 1 s for torch.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import re
import sys
from pathlib import Path

from timetotrain import strictjson

# Peers ttt uses when present that no extra of the package names.
_OTHER_PEERS = {"nvidia-ml-py": "GPU energy in `ttt synth` (NVML)"}


def version() -> str:
    """This package's version from its installed metadata."""
    try:
        return md.version("timetotrain")
    except md.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def optional_peers() -> dict[str, str | None]:
    """Every distribution an extra of timetotrain names (from its metadata), and the others ttt uses when
    present: name -> installed version, or None."""
    try:
        reqs = md.requires("timetotrain") or []
    except md.PackageNotFoundError:
        reqs = []
    names = []
    for req in reqs:
        name, _, marker = req.partition(";")
        if "extra" in marker:
            names.append(re.match(r"[A-Za-z0-9._-]+", name.strip()).group(0))
    names += [n for n in _OTHER_PEERS if n not in names]
    return {n: _dist_version(n) for n in sorted(set(names), key=str.lower)}


def _cpu_entry() -> dict:
    import torch

    from timetotrain.train import free_cores, peak
    from timetotrain.train.device import platform_name, threads_kept

    # The host as this command found it, before the measurement: the load average, and the cores other
    # processes keep busy, from which `ttt synth` takes its thread count (the peak is measured at that count).
    load = peak.load_average()
    seen = free_cores.sample()
    omp = os.environ.get("OMP_NUM_THREADS")
    n, why, _ = free_cores.choose_threads(None, omp, None, lambda: seen, ceiling=torch.get_num_threads())
    with threads_kept():
        if n is not None:
            torch.set_num_threads(n)
        threads = torch.get_num_threads()
        cpu = peak.cpu_peak(threads)
    busy = load is not None and peak.host_busy(load, threads)
    return {
        "device": "cpu",
        "name": platform_name(torch.device("cpu")),
        "torch_threads": torch.get_num_threads(),
        "cores_busy": seen.busy if seen else None,
        "cores_free": seen.free if seen else None,
        "busy_cores_worth": seen.others if seen else None,
        "synth_threads": threads,
        "synth_threads_why": why,
        "peak_flops": cpu.flops,
        "peak_source": cpu.describe(),
        "peak_measured_flops": cpu.measured,
        "peak_theoretical_flops": cpu.theoretical,
        "load_average_1min": load,
        "host_busy": busy,
        "load_note": peak.load_note([load], busy, threads),
    }


def _gpu_entries() -> list[dict]:
    import torch

    from timetotrain.train.peak import accelerator_peak

    out = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        known = accelerator_peak(p.name)
        entry = {
            "device": f"cuda:{i}",
            "name": p.name,
            "memory_gib": p.total_memory / 2**30,
            "capability": f"{p.major}.{p.minor}",
            "peak_flops": known[0] if known else None,
            "peak_source": known[1] if known else None,
        }
        if known is None:
            entry["peak_flops_reason"] = (
                "not in timetotrain/train/peak.py BF16_DENSE_TFLOPS: ttt synth refuses to guess an MFU"
            )
        out.append(entry)
    return out


def _nccl() -> str | None:
    import torch

    try:
        if not torch.distributed.is_nccl_available():
            return None
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except (AttributeError, RuntimeError):
        return None


def environment() -> dict:
    import torch
    import torch.distributed as dist

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "timetotrain": version(),
        "timetotrain_path": str(Path(__file__).resolve().parents[1]),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,  # None: no CUDA in this torch build
        "rocm_build": getattr(torch.version, "hip", None),
        "cuda_available": torch.cuda.is_available(),
        "cudnn": cudnn,
        "nccl": _nccl(),  # RCCL on ROCm builds
        "distributed_backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(),
        },
        "devices": [_cpu_entry(), *_gpu_entries()],
        "mlperf_logging": _dist_version("mlperf-logging"),
        "optional_peers": optional_peers(),
    }


def _flops(v: float | None) -> str:
    if v is None:
        return "unknown"
    return f"{v / 1e12:,.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:,.1f} GFLOP/s"


def format_environment(env: dict) -> str:
    torch_build = (
        f"CUDA {env['cuda_build']}"
        if env["cuda_build"]
        else f"ROCm {env['rocm_build']}"
        if env["rocm_build"]
        else "CPU only"
    )
    backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in env["distributed_backends"].items())
    lines = [
        f"timetotrain     {env['timetotrain']} ({env['timetotrain_path']})",
        f"python          {env['python']} ({env['python_executable']})",
        f"platform        {env['platform']}, {env['cpu_count']} CPUs",
        f"torch           {env['torch']} ({torch_build} build; a GPU usable: {'yes' if env['cuda_available'] else 'no'})",
        f"cuDNN / NCCL    {env['cudnn'] or '-'} / {env['nccl'] or '-'}",
        f"distributed     {backends}",
        f"mlperf-logging  {env['mlperf_logging'] or 'MISSING: pip install mlperf-logging (score, check, package need it)'}",
        "devices (the peak MFU is computed against):",
    ]  # fmt: skip
    for d in env["devices"]:
        if d["device"] == "cpu":
            what = f"{d['name']}, torch threads {d['torch_threads']}"
        else:
            what = f"{d['name']}, {d['memory_gib']:,.1f} GiB, compute capability {d['capability']}"
        peak = _flops(d["peak_flops"]) + f" ({d['peak_source'] or d.get('peak_flops_reason')})"
        lines.append(f"  {d['device']:<8}{what}")
        if "synth_threads" in d:
            n = d["synth_threads"]
            lines.append(
                f"  {'':<8}ttt synth takes {n} thread{'' if n == 1 else 's'}: {d['synth_threads_why']}"
            )
        lines.append(f"  {'':<8}peak {peak}")
        if "load_note" in d:
            lines.append(f"  {'':<8}{d['load_note']}")
    have = [f"{n} {v}" for n, v in env["optional_peers"].items() if v]
    missing = [n for n, v in env["optional_peers"].items() if not v]
    lines.append(f"optional peers  {', '.join(have) or 'none'}")
    if missing:
        lines.append(f"  not installed: {', '.join(missing)}")
    return "\n".join(lines)


def _cmd_doctor(args) -> int:
    env = environment()
    print(strictjson.dumps(env, indent=2) if args.json else format_environment(env))
    return 0


def add_commands(sub) -> None:
    s = sub.add_parser(
        "doctor",
        help="the environment: versions, devices and the peak FLOP/s MFU uses, optional peers",
        description="Print what a bug report needs and what decides a run's figures: python and torch (its "
        "CUDA or ROCm build, cuDNN, NCCL), the distributed backends, every device with the peak FLOP/s ttt "
        "computes MFU against (a datasheet figure per accelerator, timetotrain/train/peak.py; on a CPU the "
        "larger of a matmul peak measured now, best of many windows over 1 s, and the theoretical one from "
        "the CPU's flags and clock, both at the thread count `ttt synth` would take: one per core other "
        "processes leave free, sampled from /proc/stat), the host's load average (with a warning when it is "
        "busy), mlperf-logging, and the optional peers installed.",
    )
    s.add_argument("--json", action="store_true", help="the same as one JSON object")
    s.set_defaults(func=_cmd_doctor)
