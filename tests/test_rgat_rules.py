"""rgat tiers against the rule files: the reference block against the official 5.1.0 closed rules, the
tiny block against ours; eval points in epochs, rounded as the reference logs them."""

import dataclasses

import pytest
import torch
from fakelogs import logged_keys, uncovered_rule_keys

from timetotrain.data import graph_synth
from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir, rule_file
from timetotrain.mlperf.keys import check_rules
from timetotrain.spec.benchmark import apply_overrides
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.tasks.node_classification import _Seeds
from timetotrain.train.loop import _point

BENCH = get("rgat")
CLOSED = [official_rules_dir() / f for f in BENCH.closed_rules]


def logged(tier):
    return logged_keys(BENCH, tier)


def test_reference_is_the_5_1_closed_configuration():
    tier = BENCH.tier("reference")
    assert all("training_5.1.0/" in f for f in BENCH.closed_rules)
    assert hparam_violations(CLOSED, logged(tier)) == []
    check_rules(BENCH, tier)  # what `ttt run --tier reference` does before init_start
    assert uncovered_rule_keys(CLOSED, logged(tier)) == []
    # §13: 60% / 0.5% of 157,675,969 labeled papers, 20 evals per epoch, at most 2 epochs, target 0.72.
    assert (tier.eval_samples, tier.target, tier.lr) == (788_379, 0.72, 1e-3)
    # An eval every int(23,098 batches x 0.05) = 1,154 batches; 2 epochs of 23,098 batches.
    assert (tier.eval_every_samples, tier.max_steps) == (1154 * 4096, 2 * 23_098)
    keys = dict(logged(tier))  # the split's sizes, as the reference logs them
    assert (keys["train_samples"], keys["eval_samples"]) == (94_605_581, 788_379)
    # The reference's rgnn.py builds GATConv(in_dim, ...) with an int in_dim: one projection shared by
    # source and destination, so 13.1 M parameters (the MLPerf rgat description's "about 25 M" would need two).
    assert BENCH.family.param_count(tier.model) == 13_115_303


def test_reference_violations_are_caught():
    bad = [(k, "adamw" if k == "opt_name" else v) for k, v in logged(BENCH.tier("reference"))]
    assert any(p.startswith("opt_name") for p in hparam_violations(CLOSED, bad))
    tier = apply_overrides(BENCH, BENCH.tier("reference"), ["global_batch_size=32768"])
    assert tier.lr == 2e-3  # the RCP's LR at that batch size
    with pytest.raises(UserError, match="micro_batch_size"):
        apply_overrides(BENCH, BENCH.tier("tiny"), ["micro_batch_size=128"])


def test_tiny_block_passes_our_rule_file():
    tier = BENCH.tier("tiny")
    rules = [rule_file("rgat", "tiny")]
    assert hparam_violations(rules, logged(tier)) == []
    other = dataclasses.replace(tier, data=dataclasses.replace(tier.data, fanouts=(15, 10)))
    assert any("ttt_fanouts" in p for p in hparam_violations(rules, logged(other)))


def test_epoch_num_is_rounded_to_two_decimals():
    class Data:
        samples_per_epoch = 71 * 256  # the tiny tier's 71 batches an epoch

    point = _point(7 * 256, Data(), BENCH.task.metric)
    assert point == {"epoch_num": 0.1}  # 7 / 71 = 0.0986


def _reference_eval_steps(train: int, world: int, local: int, epochs: int) -> list[int]:
    """The global steps after which train_rgnn_multi_gpu.py evaluates, by its own loop: each rank holds
    train // world seeds (`split`), batch_num = ceil(that / local), validation_freq =
    int(batch_num * 0.05), and an eval after batch idx when idx % validation_freq == 0, idx from 1 in
    every epoch."""
    batch_num = (train // world + local - 1) // local
    freq = int(batch_num * 0.05)
    return [e * batch_num + idx for e in range(epochs) for idx in range(1, batch_num + 1) if idx % freq == 0]


@pytest.mark.parametrize(
    "tier_name,world,local",
    [("reference", 4, 1024), ("reference", 16, 1024), ("reference", 32, 1024), ("reference", 64, 1024),
     ("reference", 256, 1024), ("reference", 1, 1024), ("reference", 6, 1024), ("tiny", 1, 256),
     ("tiny", 2, 64)],
)  # fmt: skip
def test_eval_cadence_is_the_references(tier_name, world, local):
    """Every eval step over two epochs equals the reference's, at the RCP batch sizes (1,024 per GPU),
    two sizes without an RCP, and the tiny graph."""
    gbs = world * local
    tier = BENCH.tier(tier_name)
    if gbs != tier.global_batch_size:
        tier = apply_overrides(BENCH, tier, [f"global_batch_size={gbs}", "lr=1e-3", "warmup_steps=0"])
    train = int(0.6 * tier.data.num_labeled)
    want = _reference_eval_steps(train, world, local, 2)
    batches = -(-train // gbs)
    got = [s for s in range(1, 2 * batches + 1) if BENCH.task.eval_due(tier, s)]
    assert got == want
    assert len(got) >= 40 and got[0] == int(batches * 0.05)  # 20 an epoch, the first at the floor


def test_a_set_eval_interval_counts_samples():
    tier = apply_overrides(BENCH, BENCH.tier("tiny"), ["eval_every_samples=1000"])
    assert [s for s in range(1, 20) if BENCH.task.eval_due(tier, s)] == [4, 8, 12, 16]  # ceil(1000 / 256)


def test_each_rank_evaluates_an_equal_share_as_the_reference():
    """The reference's `val_idx.split(len // world)[rank]` (train_rgnn_multi_gpu.py:96): every rank reads
    len // world consecutive seeds and the last len % world are never evaluated."""
    tier = BENCH.tier("tiny")
    graph = graph_synth.in_memory(graph_synth.scaled(graph_synth.SCALES["tiny"], 0.01), seed=0)
    val = torch.arange(1003)
    shares = [
        _Seeds(graph, torch.arange(64), val, tier.data, 8, Share.of(8, rank, 4), 1, torch.device("cpu")).val
        for rank in range(4)
    ]
    assert [len(s) for s in shares] == [250] * 4
    assert torch.equal(torch.cat(shares), val[:1000])
    assert tier.eval_samples == 1500  # the tiny split: all of it on 4 ranks, 1,498 on 7
    assert (BENCH.task.eval_windows(tier, 4), BENCH.task.eval_windows(tier, 7)) == (1500, 1498)
