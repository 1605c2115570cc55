"""The rule files of our tiers are assembled from layers (timetotrain/mlperf/rule_files.py): the ruleset's
official common rules, our common tiny part, the tier's own checks. Each shipped file is its assembly byte
for byte, holds every check of the official common layers, and its target check is the tier's target with
the metric's direction."""

import dataclasses

import pytest
import toy_benchmark
import yaml
from mlperf_logging.benchmark_meta import get_allowed_benchmarks

from timetotrain.cli import main
from timetotrain.errors import UserError
from timetotrain.mlperf import rule_files
from timetotrain.mlperf.rule_files import (
    Layer,
    assemble,
    merge,
    parse_layer,
    shipped_path,
    source_path,
    tiers_with_rules,
)
from timetotrain.spec import registry

BENCHES = [registry.get(n) for n in registry.names()] + [toy_benchmark.BENCHMARK]
TIERS = [(b, t) for b in BENCHES for t in tiers_with_rules(b)]
IDS = [f"{b.name}-{t}" for b, t in TIERS]


def records(text: str) -> dict:
    return {
        item["KEY"]["NAME"]: item["KEY"] for item in yaml.load(text, Loader=yaml.BaseLoader) if "KEY" in item
    }


def checks(rec: dict) -> list[str]:
    c = rec.get("CHECK", [])
    return [x.strip() for x in (c if isinstance(c, list) else [c])]


@pytest.mark.parametrize("bench,tier", TIERS, ids=IDS)
def test_each_shipped_rule_file_is_its_assembly(bench, tier):
    """Run `ttt rules build` after editing a layer (or installing another mlperf-logging)."""
    assert shipped_path(bench, tier).read_text() == assemble(bench, tier)


@pytest.mark.parametrize("bench,tier", TIERS, ids=IDS)
def test_each_shipped_rule_file_holds_every_official_common_check(bench, tier):
    """What the official checker's common.yaml and <division>_common.yaml require, our file requires too:
    the same checks (enqueue_config aside) and at least the same REQ, so `ttt check` passes no log that
    those official layers fail."""
    ours = records(shipped_path(bench, tier).read_text())
    official = [layer for layer in rule_files.layers(bench, tier) if layer.official]
    # <division>_common.yaml lists the round's benchmarks: one the round does not list (the test-only toy,
    # one in development) is judged without it.
    listed = bench.name in get_allowed_benchmarks("training", bench.ruleset)
    assert len(official) == (2 if listed else 1)
    for layer in official:
        for name, rec in records(layer.path.read_text()).items():
            assert set(checks(rec)) <= set(checks(ours[name])), (layer.label, name)
            if "REQ" in rec:
                assert rule_files._req_rank(ours[name]["REQ"], name) >= rule_files._req_rank(rec["REQ"], name)
    assert "enqueue_config(" not in shipped_path(bench, tier).read_text()


@pytest.mark.parametrize("bench,tier", TIERS, ids=IDS)
def test_target_check_is_the_tier_target_with_the_metric_direction(bench, tier):
    """The ATLEAST_ONE_CHECK on eval_accuracy decides as the loop's own `metric.met` does at the target and
    just either side of it: the file and the tier declaration cannot state different targets or directions."""
    t = bench.tier(tier)
    expr = records(shipped_path(bench, tier).read_text())["eval_accuracy"]["ATLEAST_ONE_CHECK"]
    for value in (t.target * (1 - 1e-3), t.target, t.target * (1 + 1e-3)):
        passed = eval(expr, {}, {"v": {"value": value, "metadata": {}}})
        assert passed == bench.task.metric.met(value, t.target), (expr, value, bench.task.metric.describe())


@pytest.mark.parametrize("bench,tier", TIERS, ids=IDS)
def test_each_rule_file_checks_the_model_of_its_tier(bench, tier):
    """`ttt_model` (Benchmark.model_key) is logged after the hyperparameters, and the tier's own layer requires
    it exactly: two tiers can log the same hyperparameters (llama31_8b and gpt_oss_20b tiny), so it is what
    makes a log that names the wrong benchmark fail (tests/test_check.py relabels every tier as every other)."""
    key = bench.model_key(bench.tier(tier))
    rec = records(shipped_path(bench, tier).read_text()).get("ttt_model")
    assert rec is not None, (
        f"{source_path(bench, tier)} has no ttt_model record: add one with REQ EXACTLY_ONE and "
        f"CHECK: \" v['value'] == {key} \" (docs/adding-a-benchmark.md, The rule files)"
    )
    assert rec["REQ"] == "EXACTLY_ONE"
    other = {**key, "parameters": key["parameters"] + 1}
    assert all(eval(c, {}, {"v": {"value": key}}) for c in checks(rec)), (checks(rec), key)
    assert not all(eval(c, {}, {"v": {"value": other}}) for c in checks(rec)), checks(rec)


def _layer(tmp_path, name, text, official=False):
    path = tmp_path / name
    path.write_text(text)
    return Layer(name, path, official)


def test_layers_keep_every_check_code_and_the_strictest_req(tmp_path):
    official = _layer(
        tmp_path, "common.yaml",
        "- BEGIN:\n    CODE: \" s.update({'a': 0}) \"\n\n"
        "- KEY:\n    NAME:  block_start\n    REQ:   AT_LEAST_ONE_OR(epoch_start)\n    CHECK: \" s['run'] \"\n\n"
        "- KEY:\n    NAME:  submission_division\n    REQ:   EXACTLY_ONE\n"
        "    POST:  \" enqueue_config('training_6.0.0/{}_common.yaml'.format(v['value'])); s['m'] = 1 \"\n",
        official=True,
    )  # fmt: skip
    ours = _layer(
        tmp_path, "ours.yaml",
        "# why block_start needs samples\n- KEY:\n    NAME:  block_start\n    REQ:   AT_LEAST_ONE\n    CHECK:\n"
        "        - \"'samples_count' in v['metadata']\"\n        - \" s['run'] \"\n\n"
        "- KEY:\n    NAME:  submission_division\n    REQ:   OPTIONAL\n    CHECK: \" v['value'] == 'open' \"\n",
    )  # fmt: skip
    merged = {r.name: r for r in merge([parse_layer(official)[1], parse_layer(ours)[1]])}
    assert merged[None].fields == {"CODE": "s.update({'a': 0})"}
    block = merged["block_start"]
    assert block.fields == {"REQ": "AT_LEAST_ONE", "CHECK": ["s['run']", "'samples_count' in v['metadata']"]}
    assert block.comments == ["# why block_start needs samples"]
    assert block.origin == ["common.yaml", "ours.yaml"]
    # A weaker REQ does not loosen the official one; the enqueue is dropped, the rest of its code kept.
    division = merged["submission_division"].fields
    assert division == {"REQ": "EXACTLY_ONE", "POST": "s['m'] = 1", "CHECK": ["v['value'] == 'open'"]}


def test_a_key_stated_twice_in_a_layer_is_refused(tmp_path):
    """The engine keeps the last record of a name, so an earlier one is dead text (llama2_70b_lora tiny once
    held a stray second eval_samples rule, b4b0a44)."""
    twice = "- KEY:\n    NAME:  eval_samples\n    REQ:   EXACTLY_ONE\n\n" * 2
    with pytest.raises(UserError, match="KEY eval_samples is stated twice"):
        parse_layer(_layer(tmp_path, "src.yaml", twice))


def test_rules_build_check_finds_the_tree_up_to_date(capsys):
    assert main(["rules", "build", "--check"]) == 0
    out = capsys.readouterr().out
    assert out.count("up to date") == len([t for t in TIERS if t[0].name != "toy_classify"])


def test_rules_build_writes_a_source_tree_never_an_installed_package(tmp_path):
    src = toy_benchmark.BENCHMARK.rules_dir / "src" / "toy_classify_tiny.yaml"
    for root in (tmp_path / "checkout", tmp_path / "lib" / "site-packages" / "timetotrain"):
        (root / "src").mkdir(parents=True)
        (root / "src" / src.name).write_text(src.read_text())
    bench = dataclasses.replace(toy_benchmark.BENCHMARK, rules_dir=tmp_path / "checkout")
    assert [b.changed for b in rule_files.build([bench])] == [True]
    assert (tmp_path / "checkout" / "toy_classify_tiny.yaml").read_text() == assemble(bench, "tiny")
    assert [b.changed for b in rule_files.build([bench])] == [False]  # reproducible: nothing to rewrite
    installed = dataclasses.replace(bench, rules_dir=tmp_path / "lib" / "site-packages" / "timetotrain")
    assert [b.changed for b in rule_files.build([installed], check_only=True)] == [True]
    with pytest.raises(UserError, match="inside an installed package"):
        rule_files.build([installed])
    assert not (installed.rules_dir / "toy_classify_tiny.yaml").exists()


def test_a_layer_with_broken_code_is_one_error_naming_it(tmp_path):
    broken = "- KEY:\n    NAME:  eval_samples\n    REQ:   EXACTLY_ONE\n    CHECK: \" v['value'] == = 64 \"\n"
    with pytest.raises(UserError, match=r"src.yaml: the item at '- KEY:' is not valid \(SyntaxError") as e:
        parse_layer(_layer(tmp_path, "src.yaml", broken))
    assert "\n" not in str(e.value)
