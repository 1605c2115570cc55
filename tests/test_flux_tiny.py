"""flux1 tiny end to end: `ttt data prepare flux` with the stand-in encoders on the shared CC12M and COCO
fixtures, `ttt run` to the tier's target, the log through the official engine with the tier's rule file, and
`ttt score` against the shipped RCP."""

import json

import pytest
import torch
from conftest import mllog, official_errors, require_file, shared_data_dir, ttt_run
from untrained import assert_misses_target

from timetotrain.mlperf.compliance import check_log
from timetotrain.mlperf.rcp import rcp_path
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.train.step import build_training

pytestmark = pytest.mark.e2e

BENCH = get("flux1")
TINY = BENCH.tier("tiny")


def ttt(*argv, **kw):
    return ttt_run(*argv, **kw)


@pytest.mark.slow
def test_tiny_tier_to_target_and_scored(tmp_path):
    data = shared_data_dir()
    src = f"{require_file(data / 'cc12m')},{require_file(data / 'coco_mini')}"
    sp = require_file(data / "tokenizers" / "llama2" / "tokenizer.model")
    for split in ("train", "validation"):
        made = ttt("data", "prepare", "flux", "--src", src, "--split", split, "--select", "tiny", "--encoders",
                   "standin", "--tokenizer-model", str(sp), "--out", str(tmp_path / "enc"))  # fmt: skip
        assert made.returncode == 0, made.stderr[-2000:]
    # Before any step, the freshly built model on the tier's eval set misses the target (tests/untrained.py).
    dev = torch.device("cpu")
    data = BENCH.task.open(
        TINY, BENCH.task.resolve(TINY, tmp_path / "enc"), 0, Share.of(TINY.global_batch_size), dev
    )
    try:
        assert_misses_target(BENCH, TINY, data.evaluate(build_training(BENCH, TINY, dev, 0).model))
    finally:
        data.close()
    proc = ttt("run", "flux1", "--tier", "tiny", "--data", str(tmp_path / "enc"), "--logdir", str(tmp_path / "logs"),
               "--seed", "1000", "--quiet")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = tmp_path / "logs" / "flux1" / "tiny" / "result_0.txt"
    recs = mllog(log)
    value = {r["key"]: r["value"] for r in recs}
    assert (
        value["train_samples"] == 82 and value["eval_samples"] == 408 and value["evaluation_frequency"] == 160
    )
    evals = [r for r in recs if r["key"] == "eval_accuracy"]
    assert evals[0]["metadata"]["samples_count"] == 160
    assert evals[-1]["value"] <= TINY.target < min(e["value"] for e in evals[:-1])
    assert evals[0]["value"] > 1.3  # from about 2 (the zero-initialised output) down to the target
    verdict = check_log(log)
    assert verdict.ok, verdict.output
    assert official_errors(log, "6.0.0", "tiny") == []  # the official common.yaml + open_common.yaml
    assert rcp_path("flux1", "tiny").is_file()
    # One run is not a score (flux1 needs 10), but the shipped RCP is found for it.
    scored = ttt("score", str(tmp_path / "logs"), "--json")
    (score,) = json.loads(scored.stdout)["results"]
    assert score["benchmark"] == "flux1" and all(r["converged"] and r["compliant"] for r in score["runs"])
    # judged against the shipped RCP, which one run cannot pass or fail: it has no olympic mean
    assert score["rcp"]["verdict"] == "Not enough runs" and score["rcp"]["source"] == str(
        rcp_path("flux1", "tiny")
    )
