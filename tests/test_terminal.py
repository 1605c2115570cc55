"""What the terminal says (docs/terminal.md): the live line of a real tiny run read off a pseudo-terminal
(target, next eval, best, ETA from the run's own step times) and its one stop line under SIGTERM; the line a
failed run leaves; the suite's ETA keyed to this user, host, code and flags; a CPU peak a busy host cannot
shrink (so MFU cannot grow with the load)."""

import os
import pty
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import mllog, ttt_command

from timetotrain.cli import suite_eta
from timetotrain.cli.suite_driver import Suite, SuiteOptions
from timetotrain.spec.registry import get
from timetotrain.train import peak
from timetotrain.train.terminal import Progress, StepTimes, stop_line

pytestmark = pytest.mark.e2e

# -- the live line and the stop line of a real run --


def _read_pty(proc, master: int, until, timeout: float) -> str:
    """What the run wrote to its terminal; `until(text)` true: send SIGTERM (once), then read to the end."""
    out, sent, deadline = b"", False, time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its side
            break
        if not chunk:
            break
        out += chunk
        if not sent and until(out.decode(errors="replace")):
            proc.send_signal(signal.SIGTERM)
            sent = True
    proc.wait(timeout=60)
    return out.decode(errors="replace")


LIVE = re.compile(
    r"step (\d+)  samples [\d,]+  loss [\d.]+  [\d,]+ tokens/s  target log-perplexity<=4\.8  best (-|[\d.]+)  "
    r"next eval step (\d+) \(samples ([\d,]+)\)(, ETA: no step timed yet| in [\d.]+ (s|min|h) \([\d.e-]+ s/step\))$"
)


@pytest.mark.slow
def test_live_line_and_the_stop_line_of_a_real_run(c4_prepared, tmp_path):
    """llama31_8b tiny, an eval every 4 steps (the tier's rules allow --set eval_every_samples), on a
    terminal; SIGTERM once a line shows the first eval as the best. Every live line has the target in the
    metric's own words, the best eval, the next eval point and an ETA (or says no step is timed yet); a
    timed one's ETA is the steps left at the run's own step time; then one stop line: status and log."""
    master, slave = pty.openpty()
    cmd = ttt_command(
        "run", "llama31_8b", "--tier", "tiny", "--data", str(c4_prepared), "--logdir", str(tmp_path),
        "--quiet", "--seed", "3", "--max-steps", "40", "--set", "eval_every_samples=64",
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    text = _read_pty(proc, master, lambda t: re.search(r"best \d", t) is not None, timeout=300)
    os.close(master)
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    rows = [r.strip() for r in re.split(r"[\r\n]", text) if r.strip()]
    live = [LIVE.match(r) for r in rows if r.startswith("step ")]
    assert live and all(live), [r for r in rows if r.startswith("step ")]
    for m in live:
        step, nxt = int(m.group(1)), int(m.group(3))
        assert nxt == (step // 4 + 1) * 4 and m.group(4) == f"{nxt * 16:,}"
    assert any(m.group(2) != "-" for m in live)  # the best eval so far, once there is one
    assert any(" s/step)" in m.group(5) for m in live), rows  # an ETA from this run's own step times
    log = tmp_path / "llama31_8b" / "tiny" / "result_0.txt"
    stops = [r for r in rows if r.startswith("ttt run ")]
    assert len(stops) == 1 and stops[0].startswith("ttt run stopped by SIGTERM: "), rows[-5:]
    assert stops[0].endswith(f"; log {log}")
    assert mllog(log)[-1]["metadata"]["status"] == "aborted"  # the log is kept as documented


def test_a_failed_run_says_its_status_and_log(c4_prepared, tmp_path, monkeypatch, capsys):
    """An exception after run_start (a fault injected at step 2): one line with the status and the log,
    above the error the CLI prints; the log is kept with run_stop aborted."""
    from timetotrain.train import loop

    monkeypatch.setenv(loop.FAULT_ENV, "0:2")
    opts = loop.RunOptions("llama31_8b", "tiny", c4_prepared, tmp_path, seed=5, echo=False, max_steps=5)
    with pytest.raises(RuntimeError, match="injected fault"):
        loop.run(opts)
    log = tmp_path / "llama31_8b" / "tiny" / "result_0.txt"
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ttt run ")]
    assert lines == [f"ttt run failed: RuntimeError at step 1 (below); log {log}"]
    assert mllog(log)[-1]["metadata"]["status"] == "aborted"


def test_a_run_the_watcher_must_end_says_its_status_and_log(tmp_path, capsys):
    """A step that does not end within --abort-grace after SIGTERM: the abort watcher writes run_stop, and
    prints the stop line itself (the process exits from its thread)."""
    from types import SimpleNamespace

    from timetotrain.mlperf.logger import ResultLog
    from timetotrain.train import loop

    r = loop._TimedRun.__new__(loop._TimedRun)
    r.log = ResultLog(tmp_path)
    r.log.start("run_start")
    r.stop, r.step, r.live = loop._Stopper(r.log), 3, None
    r.tier, r.opts = SimpleNamespace(global_batch_size=16), SimpleNamespace(abort_grace=10.0)
    r.on_timeout(signal.SIGTERM)
    log = tmp_path / "result_0.txt"
    assert capsys.readouterr().err == (
        f"ttt run stopped by SIGTERM: the step did not end within --abort-grace 10 s; 3 steps; log {log}\n"
    )
    rec = mllog(log)[-1]
    assert rec["key"] == "run_stop" and (rec["metadata"]["status"], rec["metadata"]["samples_count"]) == (
        "aborted",
        48,
    )


# -- the parts, without a run --


def test_eta_is_the_moving_average_of_this_runs_step_times():
    bench = get("llama31_8b")
    tier = bench.tier("tiny")  # an eval every 20 steps
    p = Progress(bench.task, tier, stop_after=50)
    assert p.text(3) == (
        "target log-perplexity<=4.8  best -  next eval step 20 (samples 320), ETA: no step timed yet"
    )
    for step, t in [(2, 10.0), (3, 11.0), (5, 14.0)]:  # 1 s, then 1.5 s a step
        p.times.mark(step, now=t)
    assert p.times.per_step() == pytest.approx(4.0 / 3)
    assert p.text(5).endswith("next eval step 20 (samples 320) in 20 s (1.33 s/step)")
    p.evaluated(5.1)
    p.evaluated(5.3)  # worse: the best stays
    p.times.mark(30, now=100.0)  # after an eval: its time is no step time
    assert p.times.per_step() == pytest.approx(4.0 / 3)
    assert (
        p.text(45)
        == "target log-perplexity<=4.8  best 5.1000  step limit 50 (no eval before it) in 6.7 s (1.33 s/step)"
    )
    window = StepTimes(window=2)  # a moving average: the old intervals leave it
    for step, t in [(1, 0.0), (2, 9.0), (3, 10.0), (4, 11.0)]:
        window.mark(step, now=t)
    assert window.per_step() == 1.0


def test_stop_line_names_status_and_log():
    assert stop_line("success", "eval 4.79 <= target 4.8", Path("l/result_0.txt"), "10 steps") == (
        "ttt run success: eval 4.79 <= target 4.8; 10 steps; log l/result_0.txt"
    )


def test_suite_eta_uses_only_this_users_hosts_and_codes_runs(tmp_path, monkeypatch):
    hist = tmp_path / "h.json"
    s = Suite(SuiteOptions(tier="tiny", out=tmp_path / "out", history=hist, run_args=["--precision", "bf16"]))
    s.state = {"tier": "tiny", "seeds": {}, "seconds": {}}
    mine = s._key("llama31_8b")
    assert f"uid={os.getuid()} " in mine and f"code={suite_eta.code_identity()} " in mine
    others = [
        suite_eta.history_key("llama31_8b", "tiny", ["--precision", "bf16"], uid=os.getuid() + 1),  # a user
        suite_eta.history_key("llama31_8b", "tiny", ["--precision", "bf16"], host="another-host"),
        suite_eta.history_key("llama31_8b", "tiny", []),  # other flags
        "llama31_8b/tiny",  # the old file's unkeyed entry
    ]
    monkeypatch.setattr(suite_eta, "code_identity", lambda: "0.1+othercommit")  # another commit's code
    others.append(suite_eta.history_key("llama31_8b", "tiny", ["--precision", "bf16"]))
    monkeypatch.undo()
    for key in others:
        s.history.remember(key, 42.0)
    assert s.eta("llama31_8b", 1) == "ETA: no earlier run on this machine (of this code, tier and flags)"
    s._remember("llama31_8b", 300.0)
    assert (
        s.eta("llama31_8b", 1) == "ETA 5.0 min for llama31_8b, from this machine's earlier runs of this code"
    )
    # The default file is the user's own cache, not the shared data cache (--cache / $TTT_CACHE).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TTT_CACHE", str(tmp_path / "shared"))
    assert suite_eta.history_path() == tmp_path / "xdg" / "timetotrain" / "run_seconds.json"


ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\ncpu MHz\t\t: 2596.1\nflags\t\t: fpu sse2 avx avx2 fma avx512f\n\nprocessor\t: 1\n"


def test_cpu_peak_is_not_shrunk_by_a_busy_measurement(tmp_path, monkeypatch):
    """A busy host's measurement (a tenth of the cores) leaves the theoretical peak as the denominator,
    so MFU stays what the idle host gives; the theoretical one comes from the flags and the clock."""
    (tmp_path / "cpuinfo").write_text(ZEN4)
    theory = peak.theoretical_cpu_peak(2, tmp_path / "cpuinfo", tmp_path / "nosys")
    assert theory[0] == pytest.approx(2 * 2596.1e6 * 32) and "AMD Zen 4" in theory[1]
    freq = tmp_path / "sys" / "cpu0" / "cpufreq"
    freq.mkdir(parents=True)
    (freq / "cpuinfo_max_freq").write_text("3700000\n")  # boost clock, where the kernel shows it
    assert peak.theoretical_cpu_peak(1, tmp_path / "cpuinfo", tmp_path / "sys")[0] == pytest.approx(
        3.7e9 * 32
    )
    intel = ZEN4.replace("AuthenticAMD", "GenuineIntel").replace("family\t: 25", "family\t: 6")
    assert peak.flops_per_cycle(peak.read_cpuinfo(intel))[0] == 64
    assert peak.flops_per_cycle({"flags": "sse2 avx avx2 fma"})[0] == 32
    monkeypatch.setattr(peak, "theoretical_cpu_peak", lambda cores: theory)
    achieved = 20e9
    mfus = []
    for measured in (150e9, 15e9):  # idle, then busy
        monkeypatch.setattr(peak, "measure_cpu_peak", lambda m=measured: m)
        mfus.append(achieved / peak.cpu_peak(2).flops)
    assert mfus[0] == mfus[1] == pytest.approx(achieved / theory[0])
    monkeypatch.setattr(peak, "measure_cpu_peak", lambda: 500e9)  # a faster host than the flags say: its own
    assert peak.cpu_peak(2).flops == 500e9 and "the measured one" in peak.cpu_peak(2).describe()


def test_busy_host_is_told(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    # After a minute of this run's 2 threads alone, the load is ~1.26 of its own: not busy.
    assert not peak.host_busy(peak.others_load(1.3, 2, 60.0), 2)
    assert peak.host_busy(peak.others_load(2.3, 2, 60.0), 2)  # another process's core on top
    note = peak.load_note([2.3], True, 2)
    assert note.startswith("load average (1 min) 2.30 on 2 CPUs, 2 used here; WARNING: busy host")
