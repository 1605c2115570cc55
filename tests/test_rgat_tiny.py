"""rgat tiny end to end: `ttt data synth-graph`, `ttt run` to the target on the generated graph, the log
through the official engine with our rule file and with the official 5.1.0 rules alone, and `ttt synth`
figures."""

import json
import os

import pytest
import torch
from conftest import mllog, ttt_run
from test_rgat_logs import official_chain_errors
from untrained import assert_misses_target

from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.suite.rgat import TINY
from timetotrain.train.step import build_training

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def ttt(*argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return ttt_run(*argv, env=env, timeout=400)


@pytest.fixture(scope="module")
def run(tmp_path_factory, graph_tiny):
    root = tmp_path_factory.mktemp("rgat")  # the graph is conftest's, shared with tests/test_igbh.py
    p = ttt("run", "rgat", "--tier", "tiny", "--data", str(graph_tiny), "--logdir", str(root / "logs"),
            "--seed", "100", "--quiet")  # fmt: skip
    return root, graph_tiny, p


def test_tiny_run_reaches_the_target_and_passes_the_engine(run):
    root, _, p = run
    assert p.returncode == 0, p.stderr[-2000:]
    log = root / "logs" / "rgat" / "tiny" / "result_0.txt"
    recs = mllog(log)
    evals = [r for r in recs if r["key"] == "eval_accuracy"]
    assert evals[-1]["value"] >= TINY.target
    assert evals[0]["value"] < 0.5  # it learned: the first eval is far from the target
    epochs = [r["metadata"]["epoch_num"] for r in evals]
    assert all(e == round(e, 2) for e in epochs) and epochs == sorted(epochs)
    assert 0.4 < epochs[-1] < 1.0  # the RCP's 10 seeds converged at 0.59-0.72 epochs
    check = ttt("check", str(log), "--ruleset", "5.1.0")
    assert check.returncode == 0, check.stdout + check.stderr


def test_untrained_model_misses_the_target(run):
    """The freshly built model, before any step, on the tier's validation seeds (tests/untrained.py)."""
    _, graph, _ = run
    bench, dev = get("rgat"), torch.device("cpu")
    data = bench.task.open(TINY, bench.task.resolve(TINY, graph), 0, Share.of(TINY.global_batch_size), dev)
    try:
        assert_misses_target(bench, TINY, data.evaluate(build_training(bench, TINY, dev, 0).model))
    finally:
        data.close()


def test_tiny_log_passes_the_official_checker(run):
    """common.yaml, then open_common.yaml and open_rgat.yaml, which it enqueues for an open rgat log."""
    root, _, p = run
    assert p.returncode == 0, p.stderr[-2000:]
    assert official_chain_errors(root / "logs" / "rgat" / "tiny" / "result_0.txt") == {}


def test_synth_reports_sampler_figures(tmp_path):
    p = ttt(
        "synth", "rgat", "--tier", "tiny", "--steps", "2", "--warmup-steps", "1", "--logdir", str(tmp_path)
    )
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads((tmp_path / "synth" / "rgat" / "tiny" / "summary.json").read_text())
    figures = s["data_figures"]
    assert figures["sampled subgraphs/s"] > 0 and figures["sampled edges/s"] > figures["sampled seeds/s"] > 0
    assert s["seeds_per_s"] > 0 and "sampled edges/s" in p.stdout
