"""The CPU cores other processes leave free, sampled from /proc/stat, and the thread count a CPU synth takes.

torch runs a CPU op's intra-op threads in lockstep: every thread takes an equal share and the op ends with
the slowest. One core kept busy by another process slows the thread that shares it, and with it the whole
op: on a 2-core host `ttt synth llama31_8b --tier tiny` at 2 threads ran ~3x slower with one core busy,
slower than 1 thread on the free core. So unless the user chose a thread count, a CPU synth samples the
cores' busy time for a short window before the run and takes one thread per free core.

The sample is the kernel's per-CPU time accounting (user, nice, system, irq, softirq and steal count as
busy: steal is time a hypervisor gave this virtual CPU's slot to another guest; idle and iowait as free),
over the CPUs this process may run on, less this process's own CPU time over the window. The load average
cannot serve: it is a minute's average, and counts tasks waiting on the disk as load.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

STAT = Path("/proc/stat")
WINDOW_S = 0.3
# A core counts as busy when other processes keep it busy at least this share of the window: a lockstep
# thread on a core it gets half of already runs no faster than the other threads' work done on one core.
BUSY_SHARE = 0.5

# /proc/stat `cpuN` columns (proc(5)): user nice system idle iowait irq softirq steal guest guest_nice.
# guest and guest_nice are already counted in user and nice, so they are left out.
_BUSY = (0, 1, 2, 5, 6, 7)
_IDLE = (3, 4)


def read_stat(text: str) -> dict[int, tuple[int, int]]:
    """CPU index -> (busy ticks, all ticks) of each `cpuN` line of /proc/stat text (the `cpu` total line
    and every other line are skipped; a kernel without the later columns counts them as 0)."""
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit():
            continue
        ticks = [int(x) for x in rest.split()[:8]]
        ticks += [0] * (8 - len(ticks))
        busy = sum(ticks[i] for i in _BUSY)
        out[int(name[3:])] = (busy, busy + sum(ticks[i] for i in _IDLE))
    return out


def busy_share(before: dict, after: dict, cpus: set[int]) -> dict[int, float]:
    """Each CPU's busy share of the window between two `read_stat`s (a CPU with no ticks counted: 0)."""
    out = {}
    for c in sorted(cpus & before.keys() & after.keys()):
        busy = after[c][0] - before[c][0]
        total = after[c][1] - before[c][1]
        out[c] = min(1.0, max(0.0, busy / total)) if total > 0 else 0.0
    return out


@dataclass(frozen=True)
class CoreSample:
    """What one sample saw: the CPUs this process may use and how much of them other processes kept busy."""

    cpus: int  # CPUs this process may run on
    others: float  # cores' worth of busy time other processes took over the window
    seconds: float

    @property
    def busy(self) -> int:
        """Cores other processes keep busy: their busy time in whole cores, a core counted from BUSY_SHARE."""
        return min(self.cpus, int(self.others + (1.0 - BUSY_SHARE)))

    @property
    def free(self) -> int:
        return max(1, self.cpus - self.busy)

    def threads(self, ceiling: int) -> int:
        """Threads for the free cores: `ceiling` (torch's count: one per physical core, half the CPUs of a
        host whose cores run two hardware threads, which share one core's FMA units) times the share of
        the CPUs left free, at least 1."""
        return max(1, min(ceiling, ceiling * (self.cpus - self.busy) // self.cpus))

    def describe(self) -> str:
        return (
            f"{self.busy} of {self.cpus} cores busy with other processes ({self.others:.2f} cores' worth over "
            f"{self.seconds:.1f} s of /proc/stat)"
        )


def allowed_cpus() -> set[int]:
    """The CPU indices this process may run on (its affinity mask; every CPU where the OS has none)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def sample(
    seconds: float = WINDOW_S, stat: Path = STAT, cpus: set[int] | None = None, own_cpu=time.process_time
) -> CoreSample | None:
    """Sleep `seconds` between two reads of /proc/stat; None where there is none (not Linux). `own_cpu`: this
    process's CPU seconds (all its threads), taken out of the busy time."""
    cpus = allowed_cpus() if cpus is None else cpus
    try:
        before, own0, t0 = read_stat(stat.read_text()), own_cpu(), time.monotonic()
        time.sleep(seconds)
        after, own1, t1 = read_stat(stat.read_text()), own_cpu(), time.monotonic()
    except (OSError, ValueError):
        return None
    shares = busy_share(before, after, cpus)
    if not shares:
        return None
    own = (own1 - own0) / max(t1 - t0, 1e-9)  # this process's threads, in cores (a spinning pool thread)
    return CoreSample(len(cpus), max(0.0, sum(shares.values()) - own), t1 - t0)


def choose_threads(
    flag: int | None, omp: str | None, tier: int | None, take_sample=None, processes: int = 1,
    ceiling: int | None = None,
) -> tuple[int | None, str, CoreSample | None]:  # fmt: skip
    """(threads to set, or None to leave torch's count; why; the sample, where one was taken), first match:
    `--threads N`, OMP_NUM_THREADS, the tier's `cpu_threads`, else one per core other processes leave free.
    The sample is taken only when it decides, and only for one process per host (torchrun's ranks on one
    host would each take every free core). `ceiling`: the count on an idle host (default: one per CPU)."""
    if flag is not None:
        return flag, f"--threads {flag}", None
    if omp:
        return None, f"OMP_NUM_THREADS={omp}", None
    if tier is not None:
        return tier, "the tier's setting", None
    if processes > 1:
        return None, f"torch's default ({processes} processes share this host)", None
    seen = (take_sample or sample)()
    if seen is None:
        return None, "torch's default (no /proc/stat to see the free cores)", None
    rule = "one per free core" if seen.busy < seen.cpus else "no core free, so 1"
    return seen.threads(ceiling or seen.cpus), f"{rule}, {seen.describe()}", seen


def thread_words(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")
