"""qwen35_397b_grpo tiny end to end: the problems from the tier's data recipe, `ttt base` (the recipe of the
base the tier ships), the GRPO run from the shipped base to its target through `ttt run`, its log through
`ttt check --ruleset 6.1.0` (the tier's rule file, assembled on the official 6.1 common rules), and a synth
log with rollout and training throughput apart. That the shipped base misses the target by the stated margin
is tests/test_untrained_misses_target.py's."""

import json
import os

import pytest
from conftest import mllog, ttt_run
from untrained import assert_first_eval_after_training

from timetotrain.spec.registry import get
from timetotrain.train import base_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BENCH = get("qwen35_397b_grpo")
TINY = BENCH.tier("tiny")


def ttt(*argv, threads: str | None = "1", **kw):
    # One thread: on a shared 2-core host two OpenMP threads per process wait on each other far longer than
    # they compute at this model size. None: unset, so a run takes the tier's own count.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    return ttt_run(*argv, env=env, **kw)


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-data")
    r = ttt(
        "data", "prepare", "--for", BENCH.name, "--tier", "tiny", "--src", str(out), "--out", str(out / "d")
    )
    assert r.returncode == 0, r.stderr
    return out / "d"


def test_ttt_base_remakes_the_recipe_and_compares_with_the_shipped_bits(problems, tmp_path):
    """`ttt base` still runs the recipe the shipped base came from, writes a base `--init-checkpoint` takes,
    and says whether this host gave the shipped bits (on another CPU or thread count it may not)."""
    r = ttt("base", BENCH.name, "--tier", "tiny", "--data", str(problems), "--cache", str(tmp_path))
    assert r.returncode == 0, r.stderr
    folder = r.stdout.strip().splitlines()[-1]
    doc = base_model.verify_base(folder)
    assert doc["benchmark"] == "qwen35_397b_grpo_base" and doc["steps"] == TINY.base.pretraining.max_steps
    shipped = TINY.base.shipped
    same = doc["weights_sha256"] == shipped.weights_sha256
    assert f"shipped base {shipped.name}: " + ("the same weights" if same else "other bits") in r.stderr
    got = base_model.check_init_base(BENCH, TINY, folder)
    assert got.sha256 == doc["weights_sha256"] and (got.note is None) == same
    assert_first_eval_after_training(BENCH, TINY)


def test_the_tiny_tier_reaches_its_target_and_its_log_passes_6_1(problems, tmp_path):
    r = ttt(
        "run", BENCH.name, "--tier", "tiny", "--data", str(problems), "--logdir", str(tmp_path), "--seed", "3",
        threads=None,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = tmp_path / BENCH.name / "tiny" / "result_0.txt"
    recs = mllog(log)
    value = {x["key"]: x["value"] for x in recs}
    # OMP_NUM_THREADS unset: the tier's one thread, which its RCP's runs took, logged for the package.
    assert value["ttt_cpu_threads"] == TINY.cpu_threads == 1
    # No --init-checkpoint: the run starts from the shipped base, named with its sha256.
    assert value["ttt_init_base"] == TINY.base.shipped.name
    assert value["ttt_init_checkpoint_sha256"] == TINY.base.shipped.weights_sha256
    evals = [x for x in recs if x["key"] == "eval_accuracy"]
    assert evals[-1]["value"] > TINY.target and all(x["value"] <= TINY.target for x in evals[:-1])
    gbs = TINY.global_batch_size
    assert [x["metadata"]["samples_count"] for x in evals] == [gbs * (10 + 5 * k) for k in range(len(evals))]
    assert [x["value"] for x in recs if x["key"] == "num_generations_per_prompt"] == [8]

    # Every step logs its rollouts' figures beside its loss, at the same step and samples_count.
    def at(key):
        return [(x["metadata"]["step_num"], x["metadata"]["samples_count"]) for x in recs if x["key"] == key]

    stats = [x for x in recs if x["key"] == "ttt_rollout_stats"]
    assert (
        at("ttt_rollout_stats") == at("train_loss")
        and len(stats) == evals[-1]["metadata"]["samples_count"] // gbs
    )
    rewards = [x["value"]["reward"] for x in stats]
    assert all(0 <= r <= 1 for r in rewards) and sum(rewards[-10:]) > sum(rewards[:10])  # GRPO raised it
    check = ttt("check", str(log), "--ruleset", "6.1.0", "--json")
    assert json.loads(check.stdout)["ok"], check.stdout


def test_synth_measures_rollouts_and_training_apart(tmp_path):
    r = ttt(
        "synth", BENCH.name, "--tier", "tiny", "--steps", "2", "--warmup-steps", "1", "--json", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    roll = json.loads(r.stdout)["rollout"]
    assert (
        roll["rollout_tokens"] > 0 and roll["rollout_tokens_per_s"] > 0 and roll["training_tokens_per_s"] > 0
    )
    assert 0 < roll["generation_share_of_step"] < 1
    # What the terminal shows (the README promises the two rates and the share there, not only in the JSON).
    from timetotrain.train.synth import format_table

    summary = json.loads(r.stdout)
    lines = dict(line.split("  ", 1) for line in format_table(summary).splitlines())
    assert lines["rollout tokens/s"].strip().startswith(f"{roll['rollout_tokens_per_s']:,.0f} (")
    assert lines["training tokens/s"].strip().startswith(f"{roll['training_tokens_per_s']:,.0f} (")
    assert lines["generation share"].strip().startswith(f"{roll['generation_share_of_step']:.1%}")
    reward = summary["data_figures"]["train_reward_mean"]
    assert lines["train_reward_mean"].strip() == f"{reward:.4g}"  # not rounded to one decimal
