"""A real `ttt run` of a tier that starts from a checkpoint (`Benchmark.init_from`), started without
--init-checkpoint: one warning line before the clock, the same words in the log's `ttt_init_warning`, and
the run goes on (a run from random weights may be meant). No shipped tiny tier needs a checkpoint, so the
test's benchmark is tests/toy_benchmark.py's with `init_from` set (tests/toy_needs_init.py)."""

import os
from pathlib import Path

import pytest
from conftest import mllog, ttt_run
from toy_benchmark import make_data
from toy_needs_init import NEEDS

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent


def test_a_run_without_its_init_checkpoint_warns_before_the_clock(tmp_path):
    make_data(tmp_path / "data")
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    env = {**os.environ, "PYTHONPATH": path, "TTT_EXTRA_BENCHMARKS": "toy_needs_init", "OMP_NUM_THREADS": "1"}
    proc = ttt_run("run", "toy_classify", "--tier", "tiny", "--data", str(tmp_path / "data"), "--logdir",
                   str(tmp_path / "logs"), "--max-steps", "2", "--seed", "1", "--quiet", env=env, timeout=120)  # fmt: skip
    warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("ttt: warning:")]
    assert warned == [
        f"ttt: warning: toy_classify --tier tiny starts from {NEEDS}: without --init-checkpoint CKPT the run "
        "would start from random weights and measure nothing the benchmark means"
    ], proc.stderr
    (log,) = (tmp_path / "logs").rglob("*.txt")
    records = mllog(log)
    keys = [r["key"] for r in records]
    assert keys.index("ttt_init_warning") < keys.index("run_start")  # before the clock
    assert records[keys.index("ttt_init_warning")]["value"] == warned[0].removeprefix("ttt: warning: ")
    assert "run_stop" in keys  # not refused: it trained its two steps
