"""Tier settings against the rule files: the official closed yamls for `reference`, ours for `tiny`."""

import dataclasses

import pytest
from fakelogs import logged_keys, uncovered_rule_keys

from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir, rule_file
from timetotrain.mlperf.keys import check_rules, submission_keys
from timetotrain.spec.benchmark import apply_overrides
from timetotrain.spec.registry import get

BENCH = get("llama31_8b")
CLOSED = [official_rules_dir() / f for f in BENCH.closed_rules]


def logged(tier):
    return logged_keys(BENCH, tier)


def test_reference_block_passes_every_official_closed_rule():
    tier = BENCH.tier("reference")
    assert hparam_violations(CLOSED, logged(tier)) == []
    # Every hyperparameter rule of closed_llama31_8b.yaml was actually exercised (not silently absent).
    assert uncovered_rule_keys(CLOSED, logged(tier)) == []


@pytest.mark.parametrize(
    "field,value,key",
    [
        ("max_steps", 1_000_000, "max_steps"),
        ("seq_len", 4096, "max_sequence_length"),
        ("eval_samples", 512, "eval_samples"),
    ],
)
def test_reference_block_violations_are_caught(field, value, key):
    tier = apply_overrides(BENCH, BENCH.tier("reference"), [f"{field}={value}"])
    problems = hparam_violations(CLOSED, logged(tier))
    assert any(p.startswith(key) for p in problems), problems


def test_decay_steps_rule_tracks_warmup():
    tier = dataclasses.replace(BENCH.tier("reference"), warmup_steps=128)
    assert hparam_violations(CLOSED, logged(tier)) == []  # decay = 1.2M - warmup follows automatically
    bad = [(k, v + 1 if k == "opt_learning_rate_decay_steps" else v) for k, v in logged(tier)]
    assert any("opt_learning_rate_decay_steps" in p for p in hparam_violations(CLOSED, bad))


def test_fixed_optimizer_constants_are_checked():
    bad = [(k, 1e-8 if k == "opt_adamw_epsilon" else v) for k, v in logged(BENCH.tier("reference"))]
    assert any("opt_adamw_epsilon" in p for p in hparam_violations(CLOSED, bad))


def test_tiny_block_passes_our_rule_file():
    tier = BENCH.tier("tiny")
    assert hparam_violations([rule_file("llama31_8b", "tiny")], logged(tier)) == []
    wrong = apply_overrides(BENCH, tier, ["seq_len=128"])
    assert hparam_violations([rule_file("llama31_8b", "tiny")], logged(wrong))


def test_gbs_override_takes_rcp_hparams():
    tier = apply_overrides(BENCH, BENCH.tier("reference"), ["global_batch_size=64"])
    assert (tier.lr, tier.warmup_steps, tier.end_lr) == (8e-4, 96, pytest.approx(8e-5))
    assert tier.eval_every_steps == 192
    check_rules(BENCH, tier)  # still a closed configuration
    explicit = apply_overrides(BENCH, BENCH.tier("reference"), ["global_batch_size=64", "lr=1e-3"])
    assert explicit.lr == 1e-3 and explicit.warmup_steps == 96


def test_eval_points_round_up_to_whole_steps():
    tier = apply_overrides(BENCH, BENCH.tier("reference"), ["global_batch_size=96"])
    assert tier.eval_every_steps == 128  # 12288 / 96
    tier = apply_overrides(BENCH, BENCH.tier("reference"), ["global_batch_size=80", "lr=1e-3"])
    assert tier.eval_every_steps == 154  # ceil(12288 / 80) = 153.6 -> 154


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["lr"], "not key=value"),
        (["colour=blue"], "is not a setting"),
        (["global_batch_size=abc"], "expected an integer"),
        (["micro_batch_size=5"], "must divide"),
        (["warmup_steps=5000000"], "warmup_steps"),
    ],
)
def test_bad_set_is_one_clear_error(sets, needle):
    with pytest.raises(UserError, match=needle):
        apply_overrides(BENCH, BENCH.tier("reference"), sets)


def test_closed_run_refuses_a_config_the_rules_reject():
    tier = apply_overrides(BENCH, BENCH.tier("reference"), ["seq_len=4096"])
    with pytest.raises(UserError, match="max_sequence_length"):
        check_rules(BENCH, tier)
    check_rules(BENCH, apply_overrides(BENCH, BENCH.tier("reference"), ["seq_len=4096", "division=open"]))


GPT_OSS = get("gpt_oss_20b")


@pytest.mark.parametrize("gbs,lr,warmup", [(16, 4e-4, 128), (32, 8e-4, 128), (64, 1e-3, 192)])
def test_gpt_oss_gbs_override_keeps_the_rcps_end_lr(gbs, lr, warmup):
    """Every gpt_oss_20b RCP ran with end LR 4e-5 (the 6.0 exception), whatever its base LR; llama31_8b's
    end LR follows the base (test_gbs_override_takes_rcp_hparams)."""
    tier = apply_overrides(GPT_OSS, GPT_OSS.tier("reference"), [f"global_batch_size={gbs}"])
    assert (tier.lr, tier.warmup_steps, tier.end_lr) == (lr, warmup, 4e-5)
    check_rules(GPT_OSS, tier)
    # The rules also allow 0.1 x base, when asked for.
    check_rules(GPT_OSS, apply_overrides(GPT_OSS, tier, [f"end_lr={lr / 10}"]))


def _refusal(bench, sets) -> str:
    tier = apply_overrides(bench, bench.tier("reference"), sets)  # a valid setting, only not a closed one
    with pytest.raises(UserError) as e:
        check_rules(bench, tier)
    msg = str(e.value)
    assert "\n" not in msg and "MLPerf Training rules:" in msg and "--set division=open" in msg
    # The same setting is an open result: it passes and logs its division as such.
    opened = apply_overrides(bench, bench.tier("reference"), [*sets, "division=open"])
    check_rules(bench, opened)
    assert ("submission_division", "open") in submission_keys(bench, opened, "org", "platform")
    return msg


@pytest.mark.parametrize(
    "bench,sets,needle",
    [
        (BENCH, ["target=3.5"], "quality target is fixed"),
        (GPT_OSS, ["target=3.3"], "quality target is fixed"),
        (BENCH, ["eval_every_samples=6144"], "evaluation runs every 12,288 samples"),
        (BENCH, ["end_lr=1e-5"], "end LR is 0.1 x the base LR in the closed division, not 1e-05"),
        (BENCH, ["global_batch_size=64", "end_lr=4e-5"], "end LR is 0.1 x the base LR"),
        (GPT_OSS, ["global_batch_size=64", "end_lr=5e-5"], "end LR is 0.1 x the base LR or 4e-05"),
        (get("llama2_70b_lora"), ["end_lr=1e-5"], "end LR is 0 in the closed division"),
        (BENCH, ["global_batch_size=48"], "global_batch_size=48 has no reference convergence point"),
        (BENCH, ["global_batch_size=48", "lr=6e-4"], "give --set lr=... and --set warmup_steps=..."),
        (GPT_OSS, ["global_batch_size=128", "warmup_steps=300"], "(RCPs at 16, 32, 64)"),
        (get("llama2_70b_lora"), ["global_batch_size=64"], "no reference convergence point"),
        # The benchmarks added since: the same refusals, from the same declarations.
        (get("flux1"), ["target=0.6"], "quality target is fixed in the closed division (0.586)"),
        (get("flux1"), ["end_lr=1e-4"], "end LR is 1 x the base LR in the closed division, not 0.0001"),
        (get("flux1"), ["global_batch_size=768"], "(RCPs at 512, 1024, 2048, 4096)"),
        (get("rgat"), ["target=0.7"], "quality target is fixed in the closed division (0.72)"),
        (get("rgat"), ["global_batch_size=8192"], "(RCPs at 4096, 16384, 32768, 65536, 262144)"),
        (get("deepseekv3_671b"), ["target=3.5"], "quality target is fixed in the closed division (3.6)"),
        (get("llama31_405b"), ["target=5.0"], "quality target is fixed in the closed division"),
        (get("llama31_405b"), ["end_lr=1e-6"], "end LR is 0.01 x the base LR or 8e-07"),
    ],
)
def test_closed_division_refuses_what_no_yaml_checks(bench, sets, needle):
    assert needle in _refusal(bench, sets)


@pytest.mark.parametrize(
    "bench,sets",
    [
        (BENCH, ["lr=5e-4"]),  # the end LR follows the base: 5e-5
        (BENCH, ["global_batch_size=48", "lr=6e-4", "warmup_steps=64"]),
        (BENCH, ["global_batch_size=48", "lr=4e-4", "warmup_steps=16"]),  # chosen, even if equal to GBS 16's
        (GPT_OSS, ["global_batch_size=48", "lr=9e-4", "warmup_steps=160"]),
        (GPT_OSS, ["global_batch_size=64", "lr=2e-3"]),
        (BENCH, ["micro_batch_size=2", "target=3.3", "eval_every_samples=12288"]),  # the declared values
        # The rules fix deepseekv3_671b's LR (formula) and warmup (4) at any GBS: nothing is left to choose.
        (get("deepseekv3_671b"), ["global_batch_size=17408"]),
    ],
)
def test_closed_division_accepts_what_the_rules_leave_free(bench, sets):
    check_rules(bench, apply_overrides(bench, bench.tier("reference"), sets))


def test_closed_refusal_comes_before_any_log_line(capsys, tmp_path):
    from test_preflight import assert_one_line_error, results

    from timetotrain.cli import main

    logs = tmp_path / "logs"
    argv = ["run", "gpt_oss_20b", "--tier", "reference", "--data", str(tmp_path), "--logdir", str(logs)]
    code = main([*argv, "--set", "target=3.5"])  # MLLOG lines echo to stdout (no --quiet): none may appear
    out, err = capsys.readouterr()
    assert_one_line_error(code, err, "MLPerf Training rules: the quality target is fixed", "division=open")
    assert ":::MLLOG" not in out and results(logs) == []


def test_reproduction_names_the_chosen_hparams_of_a_gbs_without_rcp():
    """`ttt package` writes the --set flags that rerun a logged closed run; at a GBS without an RCP they
    must name LR and warmup even where those equal the tier's, or the rerun would be refused."""
    from types import SimpleNamespace

    from timetotrain.mlperf.package import _overrides

    tier = apply_overrides(
        BENCH, BENCH.tier("reference"), ["global_batch_size=48", "lr=4e-4", "warmup_steps=16"]
    )
    keys = dict(submission_keys(BENCH, tier, "org", "platform") + BENCH.hyperparameters(tier))
    sets = _overrides(SimpleNamespace(benchmark="llama31_8b", tier="reference", keys=keys))
    assert sets == ["global_batch_size=48", "lr=0.0004", "warmup_steps=16"]
    check_rules(BENCH, apply_overrides(BENCH, BENCH.tier("reference"), sets))


def test_check_rules_reads_the_rule_file_of_the_benchmark_it_is_given(tmp_path):
    """Found from the object (its `rules_dir`), not by looking its name up in the registry again: a
    benchmark the registry does not hold is checked against its own file."""
    from toy_benchmark import BENCHMARK

    from timetotrain.spec import registry

    assert not registry.known(BENCHMARK.name)
    check_rules(BENCHMARK, BENCHMARK.tier("tiny"))
    elsewhere = dataclasses.replace(BENCH, rules_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        check_rules(elsewhere, BENCH.tier("tiny"))
