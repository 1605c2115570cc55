"""rgat logs against the official 5.1.0 compliance checker (common.yaml, then the division's common and
rgat files it enqueues), written by the real loop: the reference tier's configuration (closed) on a small
generated graph, since IGBH-full is not here. The tiny tier's real run is checked in test_rgat_tiny.py.
Also the epochs of the data stream the eval points count."""

import dataclasses
import json
import logging
import types

import pytest
import torch
from conftest import mllog

from timetotrain.data import graph_synth, igbh
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.tasks.node_classification import GraphData, _Seeds
from timetotrain.train import loop

pytestmark = pytest.mark.e2e

BENCH = get("rgat")


def official_chain_errors(path, ruleset: str = "5.1.0") -> dict:
    """The official engine in-process from `common.yaml` down every file it enqueues (the division's common
    and benchmark files), warnings as errors: {} when the log passes, else its messages. (conftest's
    `official_errors` stops above the division's benchmark file, which states reference-tier values.)"""
    from mlperf_logging.compliance_checker import mlp_compliance

    checker = mlp_compliance.make_checker("training", ruleset, True, True)
    logging.disable(logging.WARNING)  # the engine logs each failure to the root logger as well
    try:
        valid = checker.check_file(str(path), f"training_{ruleset}/common.yaml")
    finally:
        logging.disable(logging.NOTSET)
    errors = {**checker.overwritable, **dict(enumerate(checker.not_overwritable))}
    assert valid == (not errors)
    return errors


@pytest.fixture(scope="module")
def reference_log(tmp_path_factory):
    """A closed run of the reference tier through loop.run: its hyperparameter block, target 0.72 and eval
    cadence, at a GBS without an RCP (so with a chosen LR and warmup, as the rules allow), on a generated
    graph of 10k papers with the tiny model (3,600 train seeds: 15 batches an epoch, an eval after each)."""
    root = tmp_path_factory.mktemp("rgat_ref")
    sc = graph_synth.scaled(graph_synth.SCALES["tiny"], 0.2, signal=1.0)
    graph_synth.generate(root / "graph", sc, seed=0, log=lambda s: None)
    counts = (sc.papers, sc.authors, sc.institutes, sc.fos, sc.journals, sc.conferences)
    ref, tiny = BENCH.tier("reference"), BENCH.tier("tiny")
    data = dataclasses.replace(
        tiny.data, num_nodes=tuple(zip(igbh.NODE_TYPES, counts, strict=True)),
        num_labeled=int(sc.labeled_fraction * sc.papers),
    )  # fmt: skip
    tier = dataclasses.replace(ref, model=tiny.model, data=data)
    mp = pytest.MonkeyPatch()
    mp.setitem(BENCH.tiers, "reference", tier)
    try:
        sets = ["global_batch_size=256", "lr=3e-3", "warmup_steps=0"]
        res = loop.run(
            loop.RunOptions("rgat", "reference", root / "graph", root / "logs", seed=3, sets=sets, echo=False)
        )
    finally:
        mp.undo()
    assert res.status == "success", res.reason
    return res.log_path, tier


def test_reference_log_passes_the_official_closed_checker(reference_log, tmp_path):
    path, tier = reference_log
    recs = mllog(path)
    logged = {r["key"]: r["value"] for r in recs}
    assert (logged["submission_division"], logged["submission_benchmark"]) == ("closed", "rgat")
    assert official_chain_errors(path) == {}
    # What the reference logs (train_rgnn_multi_gpu.py): the split's sizes, epoch_num on the eval lines.
    train, val = igbh.split_sizes(tier.data.num_labeled, tier.data.train_fraction, tier.data.val_fraction)
    assert (logged["train_samples"], logged["eval_samples"]) == (train, val) == (3600, 300)
    evals = [r["metadata"] for r in recs if r["key"] == "eval_accuracy"]
    assert [e["epoch_num"] for e in evals] == [round(s / 15, 2) for s in range(1, len(evals) + 1)]
    blocks = [r["metadata"] for r in recs if r["key"] in ("block_start", "block_stop")]
    assert blocks and all("samples_count" in b and "epoch_num" not in b for b in blocks)
    # The shape the checker used to fail: blocks that carry only epoch_num, no train_samples.
    old = tmp_path / "old.txt"
    lines = []
    for line in path.read_text().splitlines():
        rec = json.loads(line.split(":::MLLOG", 1)[1])
        if rec["key"] == "train_samples":
            continue
        if rec["key"] in ("block_start", "block_stop"):
            rec["metadata"] = {"epoch_num": rec["metadata"]["samples_count"] / 3840}
        lines.append(":::MLLOG " + json.dumps(rec))
    old.write_text("\n".join(lines) + "\n")
    assert set(official_chain_errors(old)) == {"block_start", "block_stop", "train_samples"}


def test_an_epoch_is_whole_batches_over_one_shuffle():
    """10 seeds, GBS 4 on 2 ranks: 3 batches an epoch, the last filled from the epoch's start; every seed
    in every epoch, each epoch its own shuffle; the loop's epoch_num is steps / batches."""
    graph = types.SimpleNamespace(csc={}, num_nodes={"paper": 10})
    train = torch.arange(100, 110)
    ranks = [_Seeds(graph, train, train[:2], GraphData(), 4, Share.of(4, r, 2), 7, "cpu") for r in (0, 1)]
    assert ranks[0].samples_per_epoch == 12
    epochs = [torch.cat([d.seeds(s) for s in range(3 * e, 3 * e + 3) for d in ranks]) for e in (0, 1)]
    for seeds in epochs:
        assert sorted(seeds[:10].tolist()) == train.tolist() and torch.equal(seeds[10:], seeds[:2])
    assert not torch.equal(epochs[0], epochs[1])
    assert loop._point(4 * 4, ranks[0], BENCH.task.metric) == {"epoch_num": 1.33}
