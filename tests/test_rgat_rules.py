"""rgat tiers against the rule files: the reference block against the official 5.1.0 closed rules, the
tiny block against ours; eval points in epochs, rounded as the reference logs them."""

import dataclasses

import pytest
from fakelogs import logged_keys, uncovered_rule_keys

from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir, rule_file
from timetotrain.mlperf.keys import check_rules
from timetotrain.suite import get
from timetotrain.suite.base import apply_overrides
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
    assert tier.eval_every_samples == 4_730_280 and tier.max_steps * 4096 >= 2 * 94_605_581
    # The reference's rgnn.py builds GATConv(in_dim, ...) with an int in_dim: one projection shared by
    # source and destination, so 13.1 M parameters (spec §13's "about 25 M" would need two).
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
        samples_per_epoch = 18_000

    point = _point(7 * 256, Data(), BENCH.task.metric)
    assert point == {"epoch_num": 0.1}  # 1,792 / 18,000 = 0.0996
