"""`ttt synth` on a CPU takes one thread per core other processes leave free (train/free_cores.py): /proc/stat
read from fake files, the thread choice in its order (--threads, OMP_NUM_THREADS, the tier's, the sample),
and the run's `host` row and MFU peak at the threads used (docs/terminal.md)."""

from types import SimpleNamespace

import pytest
import torch

from timetotrain.cli import main
from timetotrain.train import free_cores, peak, synth
from timetotrain.train.free_cores import CoreSample, busy_share, choose_threads, read_stat


def _stat(*cpus: tuple[int, ...]) -> str:
    """A /proc/stat text: the total line, one `cpuN` line per tuple of columns, and lines that are not CPUs."""
    total = [sum(c) for c in zip(*(c + (0,) * (10 - len(c)) for c in cpus), strict=True)]
    lines = ["cpu  " + " ".join(map(str, total))]
    lines += [f"cpu{i} " + " ".join(map(str, c)) for i, c in enumerate(cpus)]
    return "\n".join([*lines, "intr 42 0 0", "ctxt 99", "btime 1700000000", "procs_running 3", ""])


class _Reads:
    """A stat file whose every read returns the next text (the window's before, then after)."""

    def __init__(self, *texts: str):
        self.texts = list(texts)

    def read_text(self) -> str:
        return self.texts.pop(0)


# user nice system idle iowait irq softirq steal guest guest_nice
IDLE = (0, 0, 0, 100, 0, 0, 0, 0, 0, 0)


def test_stat_lines_are_parsed():
    text = _stat((10, 1, 2, 50, 5, 3, 4, 6, 7, 8), (1, 2, 3, 4))  # the second: a kernel without later columns
    got = read_stat(text)
    assert got == {0: (10 + 1 + 2 + 3 + 4 + 6, 10 + 1 + 2 + 3 + 4 + 6 + 50 + 5), 1: (6, 10)}
    # guest time is already in user: counting it twice would make a guest's host look busier than it is.
    assert busy_share({0: (0, 0), 1: (5, 5)}, {0: (30, 100), 1: (5, 5), 2: (9, 9)}, {0, 1, 2}) == {
        0: 0.3,
        1: 0.0,
    }


@pytest.mark.parametrize(
    "after, cpus, busy, free",
    [
        ((IDLE, IDLE), {0, 1}, 0, 2),
        (((0, 0, 0, 100, 0, 0, 0, 0, 0, 0), (100, 0, 0, 0, 0, 0, 0, 0, 0, 0)), {0, 1}, 1, 1),  # one core busy
        (((0, 0, 0, 0, 0, 0, 0, 100, 0, 0), IDLE), {0, 1}, 1, 1),  # steal: the hypervisor gave the slot away
        (((30, 0, 0, 70, 0, 0, 0, 0, 0, 0), IDLE), {0, 1}, 0, 2),  # a third of a core: not worth a thread
        (((30, 0, 0, 70, 0, 0, 0, 0, 0, 0), (30, 0, 0, 70, 0, 0, 0, 0, 0, 0)), {0, 1}, 1, 1),  # spread: 0.6
        (((100, 0, 0, 0, 0, 0, 0, 0, 0, 0), (50, 0, 50, 0, 0, 0, 0, 0, 0, 0)), {0, 1}, 2, 1),  # at least 1
        ((IDLE, (100, 0, 0, 0, 0, 0, 0, 0, 0, 0)), {0}, 0, 1),  # a CPU outside the affinity mask
        (((0, 0, 0, 50, 50, 0, 0, 0, 0, 0), IDLE), {0, 1}, 0, 2),  # waiting on the disk is not busy
    ],
)
def test_the_cores_other_processes_keep_busy(after, cpus, busy, free):
    reads = _Reads(_stat((0,) * 10, (0,) * 10), _stat(*after))
    seen = free_cores.sample(0.0, reads, cpus, own_cpu=lambda: 0.0)  # this process idle in the window
    assert (seen.cpus, seen.busy, seen.free) == (len(cpus), busy, free)
    assert seen.describe().startswith(f"{busy} of {len(cpus)} cores busy with other processes (")


def test_this_process_is_not_another():
    """The busy time this process's own threads spent in the window (one spinning pool thread) is taken out."""
    own = iter([0.0, 0.3])  # a core's worth over the 0.3 s window
    reads = _Reads(_stat((0,) * 10, (0,) * 10), _stat((100, 0, 0, 0, 0, 0, 0, 0, 0, 0), IDLE))
    assert free_cores.sample(0.3, reads, {0, 1}, own_cpu=own.__next__).busy == 0


def test_no_stat_file_is_no_sample(tmp_path):
    assert free_cores.sample(0.0, tmp_path / "missing") is None
    assert free_cores.sample(0.0, _Reads("nothing here\n", "nothing here\n")) is None


def test_the_thread_choice_in_its_order():
    def never():
        raise AssertionError("sampled although something else decided")

    half = CoreSample(cpus=4, others=1.2, seconds=0.3)
    assert choose_threads(3, "2", 1, never)[:2] == (3, "--threads 3")
    assert choose_threads(None, "2", 1, never)[:2] == (None, "OMP_NUM_THREADS=2")  # torch already took it
    assert choose_threads(None, None, 1, never)[:2] == (1, "the tier's setting")
    n, why, seen = choose_threads(None, None, None, lambda: half)
    assert (n, seen) == (3, half) and why.startswith("one per free core, 1 of 4 cores busy")
    assert choose_threads(None, None, None, never, processes=2)[:2] == (
        None,
        "torch's default (2 processes share this host)",
    )
    assert choose_threads(None, "", None, lambda: None)[0] is None  # no /proc/stat: torch's default
    # Two hardware threads a core: torch takes one per physical core, and the free share of those.
    assert choose_threads(None, None, None, lambda: CoreSample(16, 0.1, 0.3), ceiling=8)[0] == 8
    assert choose_threads(None, None, None, lambda: CoreSample(16, 1.0, 0.3), ceiling=8)[0] == 7
    n, why, _ = choose_threads(None, None, None, lambda: CoreSample(16, 16.0, 0.3), ceiling=8)
    assert n == 1 and why.startswith("no core free, so 1, 16 of 16 cores busy with other processes")


def test_synth_takes_the_free_cores_and_its_peak_is_theirs(monkeypatch, capsys):
    """One core of two busy: one thread, said on stderr and in the host row, and the peak of one thread."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(free_cores, "sample", lambda: CoreSample(cpus=2, others=1.03, seconds=0.3))
    prep = SimpleNamespace(device=torch.device("cpu"), tier=SimpleNamespace(cpu_threads=None))
    prep.dist = SimpleNamespace(main=True)
    threads = synth._cpu_threads(prep, None)
    assert torch.get_num_threads() == 1 and threads["threads"] == 1 and threads["cores_busy"] == 1
    assert capsys.readouterr().err.startswith("ttt: 1 thread, one per free core, 1 of 2 cores busy")
    monkeypatch.setattr(peak, "measure_cpu_peak", lambda: 40e9)
    monkeypatch.setattr(peak, "theoretical_cpu_peak", lambda cores: (cores * 80e9, f"{cores} x 80"))
    p = synth._peak(torch.device("cpu"))
    assert p.flops == 80e9 and "1 thread;" in p.source  # the theoretical peak of the one thread used
    p.threads = threads
    host = synth._host_figures(p, torch.device("cpu"), 10.0)
    assert host["cores_used"] == 1 and host["threads"] == threads
    assert host["note"].startswith(
        "1 thread: one per free core, 1 of 2 cores busy with other processes (1.03"
    )
    assert "the threads ran" not in host["note"] and "cpu_time_share" not in host
    # A neighbour that came during the run: the thread got a quarter of its core's time, said after the load.
    host = synth._host_figures(p, torch.device("cpu"), 10.0, 2.5)
    assert host["cpu_time_share"] == 0.25 and host["host_busy"] and "WARNING: busy host" in host["note"]
    assert host["note"].endswith("; the threads ran 25% of the timed window (other processes had the cores)")
    # The thread had its core all along: a load average still high from the run before warns of nothing.
    monkeypatch.setattr(peak, "load_average", lambda: 4.0)
    p.load_before = 4.0
    host = synth._host_figures(p, torch.device("cpu"), 10.0, 9.9)
    assert (
        not host["host_busy"]
        and "WARNING" not in host["note"]
        and "load average (1 min) 4.00" in host["note"]
    )
    assert synth._cpu_threads(prep, 2)["why"] == "--threads 2" and torch.get_num_threads() == 2
    assert synth._cpu_threads(SimpleNamespace(device=torch.device("meta")), None) is None


@pytest.mark.bad_input
def test_threads_below_one_is_one_line(capsys):
    assert main(["synth", "llama31_8b", "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--threads 0: must be at least 1" in err


def test_doctor_shows_the_free_cores(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(free_cores, "sample", lambda: CoreSample(cpus=2, others=0.98, seconds=0.3))
    monkeypatch.setattr(peak, "measure_cpu_peak", lambda: 1e9)
    from timetotrain.cli import doctor

    before = torch.get_num_threads()
    cpu = doctor._cpu_entry()
    assert (cpu["cores_busy"], cpu["cores_free"], cpu["synth_threads"]) == (1, 1, 1)
    assert "1 thread;" in cpu["peak_source"] and torch.get_num_threads() == before  # measured at 1, restored
    text = doctor.format_environment({**doctor.environment(), "devices": [cpu]})
    assert "ttt synth takes 1 thread: one per free core, 1 of 2 cores busy with other processes" in text
