"""deepseekv3_671b: the reference tier against the official closed rules (GBS floor, LR formula at the three
RCP batch sizes, eval after every step from step 43), and the tiny tier's declaration."""

import dataclasses

import pytest
from fakelogs import _line, logged_keys

from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import check_log, hparam_violations, official_rules_dir
from timetotrain.mlperf.keys import check_rules
from timetotrain.spec.benchmark import apply_overrides
from timetotrain.spec.registry import get

BENCH = get("deepseekv3_671b")


def logged(tier):
    return logged_keys(BENCH, tier)


def closed_files():
    return [official_rules_dir() / f for f in BENCH.closed_rules]


@pytest.mark.parametrize("gbs, lr", [(15_360, 2.3238e-5), (16_384, 2.4e-5), (18_432, 2.5456e-5)])
def test_rcp_batch_sizes_pass_the_closed_rules(gbs, lr):
    tier = apply_overrides(BENCH, BENCH.tier("reference"), [f"global_batch_size={gbs}"])
    assert tier.lr == pytest.approx(lr, abs=1e-9)
    assert tier.warmup_steps == 4 and tier.decay_steps == 11_996 and tier.end_lr == 1e-8
    # Eval after every step from step 42 + 24576 // GBS (43 at every RCP size), the run capped at 100 steps.
    assert tier.eval_every_steps == 1 and BENCH.task.first_eval_step(tier) == 43
    assert tier.max_steps == 100
    assert hparam_violations(closed_files(), logged(tier)) == []
    check_rules(BENCH, tier)  # what `ttt run` does before its first log line
    keys = dict(logged(tier))
    assert keys["moe_aux_loss_coeff"] == 0.01 and keys["eval_samples"] == 1024
    assert keys["max_sequence_length"] == 4096 and keys["opt_adamw_epsilon"] == 1e-8


def test_gbs_floor_and_wrong_lr_are_refused():
    small = apply_overrides(
        BENCH, BENCH.tier("reference"), ["global_batch_size=8192", "lr=1.697e-5", "warmup_steps=4"]
    )
    problems = hparam_violations(closed_files(), logged(small))
    assert problems and "global_batch_size" in problems[0]
    with pytest.raises(UserError, match="global_batch_size"):
        check_rules(BENCH, small)
    off = apply_overrides(BENCH, BENCH.tier("reference"), ["lr=2.5e-5"])
    assert any("opt_base_learning_rate" in p for p in hparam_violations(closed_files(), logged(off)))


def _reference_log(path, gbs, values):
    tier = apply_overrides(BENCH, BENCH.tier("reference"), [f"global_batch_size={gbs}"])
    lines = [_line(0, "POINT_IN_TIME", "cache_clear", True), _line(0, "INTERVAL_START", "init_start")]
    keys = [*logged(tier), ("seed", 1), ("ttt_tier", "reference")]
    lines += [_line(1, "POINT_IN_TIME", k, v, lineno=200 + i) for i, (k, v) in enumerate(keys)]
    lines += [_line(2, "INTERVAL_END", "init_stop"), _line(3, "INTERVAL_START", "run_start")]
    for step, v in enumerate(values, start=1):
        s = step * gbs
        lines += [
            _line(3 + step, "INTERVAL_START", "block_start", samples_count=s - gbs),
            _line(3 + step, "INTERVAL_END", "block_stop", samples_count=s),
            _line(3 + step, "INTERVAL_START", "eval_start", samples_count=s),
            _line(3 + step, "POINT_IN_TIME", "eval_accuracy", v, samples_count=s),
            _line(3 + step, "INTERVAL_END", "eval_stop", samples_count=s),
        ]
    status = "success" if values[-1] <= 3.6 else "aborted"
    lines.append(
        _line(10 + len(values), "INTERVAL_END", "run_stop", status=status, samples_count=len(values) * gbs)
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_official_engine_accepts_a_reference_log_and_its_target(tmp_path):
    ok = check_log(_reference_log(tmp_path / "ok.txt", 15_360, [5.1, 4.2, 3.59]))
    assert ok.ok, ok.output
    short = check_log(_reference_log(tmp_path / "short.txt", 16_384, [5.1, 4.2, 3.61]))
    assert not short.ok  # the target is 3.6 on eval_accuracy


def test_tiny_tier_shape():
    tier = BENCH.tier("tiny")
    m = tier.model
    assert (m.n_experts, m.top_k, m.n_groups, m.first_dense, m.mtp_layers, m.n_shared_experts) == (
        16,
        4,
        4,
        1,
        1,
        1,
    )
    assert m.q_lora_rank and tier.eval_every_steps == 1 and tier.base is not None


@pytest.mark.slow
def test_synth_counts_active_and_mla_flops(tmp_path):
    from timetotrain.models import deepseek_v3 as ds
    from timetotrain.train.synth import SynthOptions, synth

    opts = SynthOptions("deepseekv3_671b", "tiny", steps=2, warmup_steps=1, logdir=tmp_path, seed=2)
    s = synth(dataclasses.replace(opts, sets=["global_batch_size=4"]))  # 4 windows: the count, not the speed
    tier = BENCH.tier("tiny")
    assert s["model_flops_per_item"] == pytest.approx(ds.flops_per_token(tier.model, 256, causal=True))
    assert s["tokens_per_s"] > 0 and s["mfu"] > 0


def test_tiny_block_passes_our_rule_file():
    from timetotrain.mlperf.compliance import rule_file

    tier = BENCH.tier("tiny")
    assert hparam_violations([rule_file("deepseekv3_671b", "tiny")], logged(tier)) == []
    check_rules(BENCH, tier)


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_continues_from_a_ttt_base(c4_prepared, tmp_path):
    """The tiny tier's plumbing end to end: a base cut to 3 short steps (`make_base`: HF export with the MTP
    layer and routing biases), then `ttt run` from it for 2 steps, before its first evaluation; the log
    names the base's sha256 and its hyperparameters pass the tier's rule file."""
    import dataclasses

    from conftest import mllog, ttt_run

    from timetotrain.mlperf.compliance import rule_file
    from timetotrain.train import base_model

    recipe = BENCH.tier("tiny").base
    pre = recipe.pretraining
    pre = dataclasses.replace(
        pre, max_steps=3, warmup_steps=1, eval_samples=2, data=dataclasses.replace(pre.data, seq_len=64)
    )
    recipe = dataclasses.replace(recipe, benchmark=dataclasses.replace(recipe.benchmark, tiers={"tiny": pre}))
    base, doc, _ = base_model.make_base(recipe, c4_prepared, tmp_path / "cache", echo=False)
    args = [
        "run",
        "deepseekv3_671b",
        "--tier",
        "tiny",
        "--data",
        str(c4_prepared),
        "--init-checkpoint",
        str(base),
    ]
    args += ["--logdir", str(tmp_path / "logs"), "--max-steps", "2", "--quiet", "--seed", "1"]
    proc = ttt_run(*args, timeout=900)
    assert proc.returncode in (0, 1) and "ttt: error" not in proc.stderr, proc.stderr[-3000:]
    log = next((tmp_path / "logs" / "deepseekv3_671b" / "tiny").glob("result_*.txt"))
    recs = mllog(log)
    first = {}
    for r in recs:
        first.setdefault(r["key"], r["value"])
    assert first["ttt_init_checkpoint_sha256"] == doc["weights_sha256"]
    evals = [r for r in recs if r["key"] == "eval_accuracy"]
    assert evals == []  # no evaluation before step 42 + 24 // 16 = 43, the reference's skip scaled
    assert recs[-1]["key"] == "run_stop" and recs[-1]["metadata"]["samples_count"] == 32
    hp = [(k, first[k]) for k, _ in logged(BENCH.tier("tiny"))]  # as the run logged them
    assert hparam_violations([rule_file("deepseekv3_671b", "tiny")], hp) == []
    # Two steps end before the first eval (43), so this log has no eval_accuracy the common rules require:
    # the tier's log through the official common rules is tests/test_official_common.py's.
