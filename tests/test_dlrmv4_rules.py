"""dlrmv4's closed 6.1 rules (suite/dlrmv4.py, tasks/seqrec_rules.py) against the official tools.

The eval grid and the first eval equal what closed_dlrmv4.yaml computes from the GBS, at every GBS tried;
the hyperparameter block passes closed_dlrmv4.yaml with the 6.1 common rules at GBS 8,192, 16,384 and
32,768, and logs of that shape (our hyperparameter block, the parallelism keys and config_filename that
`ttt run` adds, evals where the task's `eval_due` puts them) pass `ttt check --ruleset 6.1.0`; an LR outside
the band, a first eval off its position and a forbidden override fail it, and are refused before the clock;
`ttt score --ruleset 6.1.0` equals the official result_summarizer on a submission tree of such logs. The
declaration is not in the registry yet (no model or data): the tests use it directly.
"""

import dataclasses
import functools
import json
import math

import pytest
import yaml
from fakelogs import _line, ttt_main, uncovered_rule_keys
from summarizer_parity import assert_score_equals_summarizer, system_json

from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir
from timetotrain.mlperf.keys import check_rules, config_keys, parallel_keys, submission_keys
from timetotrain.spec.benchmark import apply_overrides
from timetotrain.suite.dlrmv4 import BENCHMARK as BENCH
from timetotrain.suite.dlrmv4 import REFERENCE as REF
from timetotrain.tasks.seqrec_rules import eval_interval_steps, first_eval_samples
from timetotrain.train.schedule import for_tier

pytestmark = pytest.mark.parity

RULES = official_rules_dir() / "training_6.1.0"
CLOSED = [official_rules_dir() / f for f in BENCH.closed_rules]
ORG, T0 = "Acme", 1_770_000_000_000


def tier_at(gbs: int, *sets: str):
    return apply_overrides(BENCH, REF, [f"global_batch_size={gbs}", *sets])


def logged(tier, hyperparameters=None) -> list[tuple[str, object]]:
    """The keys a run of `tier` logs before the clock, in `ttt run`'s order (train/prepare.log_init_keys):
    submission keys, the task's hyperparameter block, the parallelism and precision keys, config_filename.
    `ttt_model` (the model family's) is left out: the family is not built yet, and no rule reads it."""
    hp = BENCH.task.hyperparameters(BENCH, tier, 1) if hyperparameters is None else hyperparameters
    return [
        *submission_keys(BENCH, tier, ORG, "8xGPU"),
        *hp,
        *parallel_keys(None, BENCH.micro_batch(tier)),
        *config_keys(BENCH, tier),
    ]


@functools.cache
def _closed_rule() -> list:
    return yaml.safe_load((RULES / "closed_dlrmv4.yaml").read_text())


def rule_state(gbs: int) -> dict:
    """What closed_dlrmv4.yaml's BEGIN and global_batch_size POST compute, run from the installed file."""
    s: dict = {}
    env = {"s": s, "math": math}
    for item in _closed_rule():
        if "BEGIN" in item:
            exec(item["BEGIN"]["CODE"], env)
        elif item["KEY"]["NAME"] == "global_batch_size":
            exec(item["KEY"]["POST"], env, {"v": {"value": gbs}})
    return s


def test_eval_grid_and_first_eval_equal_the_rule_file():
    """At every GBS tried, what the rule file's own expressions give: the ceiling of the grid (the reference
    trainer rounds, train/utils.py:2243: they differ at 56 of the 128 multiples of 1,024 here)."""
    d = REF.data
    for gbs in [*range(1024, 131073, 1024), 1000, 8191, 12345, 50000, 99999]:
        s = rule_state(gbs)
        assert eval_interval_steps(d, gbs) * gbs == s["eval_interval_samples"], gbs
        assert first_eval_samples(d, gbs) == s["first_eval_samples"], gbs


@pytest.mark.parametrize(
    "gbs,steps,block,lr",
    [(8192, 280, 25, 1e-6), (16384, 140, 31, 2e-6), (32768, 70, 41, 4e-6)],  # README.MD:653-654, :806-810
)
def test_the_three_rcp_batch_sizes(gbs, steps, block, lr):
    tier = tier_at(gbs)
    task = BENCH.task
    assert (tier.lr, tier.end_lr, tier.warmup_steps) == (lr, lr, 24_000)  # rcps_dlrmv4.json, the scaling law
    assert task.eval_every_steps(tier) == steps and steps * gbs == 2_293_760
    assert task.first_eval_step(tier) == block * steps
    due = [k for k in range(1, (block + 3) * steps + 1) if task.eval_due(tier, k)]
    assert due == [block * steps, (block + 1) * steps, (block + 2) * steps, (block + 3) * steps]
    check_rules(BENCH, tier, BENCH.task.hyperparameters(BENCH, tier, 1))  # nothing refused
    # With the 6.1 disclosure keys (common.yaml: each required exactly once), every rule of the closed files
    # that a hyperparameter block meets is met, and none silently skipped.
    assert hparam_violations([*CLOSED, RULES / "common.yaml"], logged(tier)) == []
    assert uncovered_rule_keys(CLOSED, logged(tier)) == []


def test_the_warmup_is_the_references_ramp_from_zero():
    """base x min(1, g / 24,000) before update g (train/utils.py:2440-2447): the first update at lr 0, and
    after 20 steps at GBS 8,192 the reference's log reads lr 7.916666666666666e-10
    (rcp_logs/gbs_8192/seed79275716.log, samples_count 163840), the rate of its 20th update."""
    lr = for_tier(BENCH.schedule, REF)
    assert lr(0) == 0.0 and lr(19) == 7.916666666666666e-10
    ramp = [1e-6 * min(1.0, g / 24_000) for g in (12_000, 23_999, 24_000, 200_000)]  # the reference's order
    assert [lr(g) for g in (12_000, 23_999, 24_000, 200_000)] == ramp


def _refused(sets: list[str]) -> str:
    """The one line a run of the reference tier with `sets` stops with, before any log line: apply_overrides
    (the task's validate) or check_rules (the official rule file), as `ttt run`'s preflight calls them."""
    with pytest.raises(UserError) as e:
        tier = apply_overrides(BENCH, REF, sets)
        check_rules(BENCH, tier, BENCH.task.hyperparameters(BENCH, tier, 1))
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "sets,words",
    [
        (["lr=1e-7"], "[5e-07, 1.5e-06] at global_batch_size=8192"),  # the README's default LR
        (["global_batch_size=16384", "lr=3.1e-6"], "[1e-06, 3e-06] at global_batch_size=16384"),
        (["global_batch_size=32768", "lr=1e-6", "division=open"], "rules (closed and open)"),
        (["warmup_steps=1000"], "opt_learning_rate_warmup_steps=1000 fails"),
        (["eval_samples=1000000"], "eval_samples=1000000 fails"),
        (["target=0.76"], "quality target is fixed in the closed division (0.75)"),
        (["eval_every_samples=4587520"], "evaluation runs every 2,293,760 samples"),
        (["end_lr=5e-7"], "constant after the warmup"),
        (["seq_len=2048"], "is not a setting"),
    ],
)
def test_forbidden_overrides_are_refused_in_one_line(sets, words):
    assert words in _refused(sets)


@pytest.mark.parametrize(
    "sets",
    [
        ["global_batch_size=16384", "lr=1e-6"],  # the band's edges, 0.5 and 1.5 x
        ["global_batch_size=16384", "lr=3e-6"],
        ["global_batch_size=12288"],  # a GBS without an RCP: the scaling law's LR
        ["micro_batch_size=512", "max_steps=100000"],  # not hyperparameters of the rules
        ["warmup_steps=1000", "division=open"],
    ],
)
def test_what_the_rules_leave_free_is_accepted(sets):
    tier = apply_overrides(BENCH, REF, sets)
    check_rules(BENCH, tier, BENCH.task.hyperparameters(BENCH, tier, 1))


def ref_log(path, tier, seed, converge_block, *, hyperparameters=None, first_step=None, t0=T0):
    """A reference-tier run of `tier` that meets the target at eval block `converge_block` (None: never,
    aborted after three evals), evaluating where the task's `eval_due` says (from `first_step` instead,
    when given: a log that breaks the first-eval rule)."""
    task, gbs = BENCH.task, tier.global_batch_size
    every = task.eval_every_steps(tier)
    first = first_step or task.first_eval_step(tier)
    last = converge_block * every if converge_block is not None else first + 2 * every
    steps = [k for k in range(first, last + 1) if (k - first) % every == 0]
    lines = [
        _line(t0 - 9000, "POINT_IN_TIME", "cache_clear", True),
        _line(t0 - 9000, "INTERVAL_START", "init_start"),
    ]
    keys = logged(tier, hyperparameters)
    keys[5:5] = [("seed", seed)]  # after the submission keys, as log_init_keys writes it
    keys += [
        ("ttt_tier", tier.name),
        ("ttt_eval_every_samples", tier.eval_every_samples),
        ("ttt_ruleset", "6.1.0"),
    ]
    lines += [_line(t0 - 5000, "POINT_IN_TIME", k, v) for k, v in keys]
    lines += [_line(t0, "INTERVAL_END", "init_stop"), _line(t0, "INTERVAL_START", "run_start")]
    lines.append(_line(t0 + 1, "INTERVAL_START", "block_start", samples_count=0))
    t = t0 + 1
    for i, step in enumerate(steps):
        at, done = step * gbs, step == steps[-1]
        t += 600_000 if i == 0 else 60_000 + (seed % 7) * 1000
        auc = 0.7503 if done and converge_block is not None else 0.70 + 0.04 * i / len(steps)
        lines.append(_line(t, "INTERVAL_END", "block_stop", samples_count=at))
        lines.append(_line(t, "INTERVAL_START", "eval_start", samples_count=at))
        lines.append(_line(t + 20_000, "POINT_IN_TIME", "eval_accuracy", auc, samples_count=at))
        lines.append(_line(t + 20_000, "INTERVAL_END", "eval_stop", samples_count=at))
        if not done:
            lines.append(_line(t + 20_001, "INTERVAL_START", "block_start", samples_count=at))
    status = "success" if converge_block is not None else "aborted"
    lines.append(_line(t + 20_050, "INTERVAL_END", "run_stop", status=status, samples_count=last * gbs))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _check(path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = ttt_main(["check", str(path), "--ruleset", "6.1.0"])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("gbs,block", [(8192, 29), (16384, 36), (32768, 48)])
def test_reference_shaped_logs_pass_ttt_check(tmp_path, capsys, gbs, block):
    code, out = _check(ref_log(tmp_path / "result_0.txt", tier_at(gbs), 7, block), capsys)
    assert code == 0, out[-3000:]
    assert "official mlperf_logging engine: PASS" in out


def _lr_out_of_band():
    tier = dataclasses.replace(REF, lr=1.6e-6, end_lr=1.6e-6)  # past validate: as a run without the check
    return tier, None, None, "opt_base_learning_rate"


def _warmup_changed():
    hp = BENCH.task.hyperparameters(BENCH, REF, 1)
    hp = [(k, 1000 if k == "opt_learning_rate_warmup_steps" else v) for k, v in hp]
    return REF, hp, None, "opt_learning_rate_warmup_steps"


@pytest.mark.parametrize(
    "case",
    [
        _lr_out_of_band,
        _warmup_changed,
        lambda: (REF, None, 7000 - 280, "first_eval_samples"),  # one grid point early (the reference: none)
        lambda: (REF, None, 280, "first_eval_samples"),  # from the first grid point, as the RCP sweep ran
        lambda: (REF, None, 7000 + 140, "eval_interval_samples"),  # off the grid
    ],
    ids=["lr_band", "warmup", "first_eval_early", "first_eval_ungated", "off_grid"],
)
def test_logs_that_break_a_rule_fail_ttt_check(tmp_path, capsys, case):
    tier, hp, first, words = case()
    path = ref_log(tmp_path / "result_0.txt", tier, 7, 30, hyperparameters=hp, first_step=first)
    code, out = _check(path, capsys)
    assert code == 1 and words in out, out[-3000:]


# system: (GBS, eval block each of the 10 runs meets the target at (None: aborted), RCP verdict, message)
CASES = {
    "found_pass": (8192, [29, 30, 29, 31, 30, 29, 32, 30, 29, 31], "Pass", "RCP found"),
    # The official checker prunes the 16,384 RCP (its mean lies above the others' line): interpolated.
    "pruned_interp": (16384, [36, 37, 36, 38, 37, 36, 39, 37, 36, 38], "Pass", "RCP Interpolation"),
    "between_interp": (24576, [45, 46, 45, 47, 46, 45, 48, 46, 45, 47], "Pass", "RCP Interpolation"),
    "found_fail": (8192, [25, 26, 25, 26, 25, 25, 26, 25, 26, 25], "Fail", "RCP found"),
    "one_aborted": (32768, [48, 49, 48, 50, 49, 48, None, 49, 48, 50], "Pass", "RCP found"),
}


@pytest.mark.slow  # 50 logs through the official checkers and the summarizer, twice
def test_score_equals_the_official_result_summarizer(tmp_path):
    org = tmp_path / ORG
    (org / "systems").mkdir(parents=True)
    for s, (system, (gbs, blocks, *_)) in enumerate(CASES.items()):
        (org / "systems" / f"{system}.json").write_text(json.dumps(system_json(ORG, system), indent=4))
        for i, block in enumerate(blocks):
            path = org / "results" / system / "dlrmv4" / f"result_{i}.txt"
            ref_log(path, tier_at(gbs), 100 * s + i, block, t0=T0 + (10 * s + i) * 86_400_000)
    ours = assert_score_equals_summarizer(org, "6.1.0", "dlrmv4", CASES, tmp_path)
    for s in ours.values():  # every run that converged is a compliant closed result
        assert all(r.compliant for r in s.runs if r.converged), [r.problem for r in s.runs]
