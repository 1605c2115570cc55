"""Every tier's log meets the official common rules. The log of each benchmark and tier is written by the
real timed loop (`train.loop.run`: preflight, the closed-rules refusal, the init block of
`prepare.log_init_keys`, blocks and eval points at the tier's own cadence, run_stop); only the model and
the data are stand-ins, so a reference tier runs in milliseconds on a laptop. Each log is then judged by
the official engine on the official files of its ruleset: `common.yaml` and the division's
`<division>_common.yaml`, and for the reference tiers the whole official chain down to
`closed_<bench>.yaml`; any message fails. Rulesets: the benchmark's own (6.0.0, rgat 5.1.0) and 6.1.0 for
the benchmarks 6.1 keeps. The tiny tiers' real runs to their targets (test_e2e_tiny, test_gpt_oss,
test_flux_tiny, test_lora_tiny, test_rgat_tiny, test_toy_benchmark) put their logs through `ttt check`,
whose assembled rule files hold every check of those two official files (test_rule_files)."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import mllog, official_errors
from mlperf_logging.benchmark_meta import get_allowed_benchmarks

from timetotrain.mlperf.compliance import check_log
from timetotrain.mlperf.results import ROLLOUT_STATS_KEY
from timetotrain.spec import registry
from timetotrain.tasks.grpo import rollout_figures
from timetotrain.train import loop, prepare
from timetotrain.train.base_model import InitBase

pytestmark = pytest.mark.e2e

PAIRS = [(b, t) for b in registry.names() for t in registry.get(b).tiers]
RULESETS = [
    (b, t, rs)
    for b, t in PAIRS
    for rs in dict.fromkeys([registry.get(b).ruleset, "6.1.0"])
    if b in get_allowed_benchmarks("training", rs)
]


class _Data:
    """The data a run opens, reduced to what the loop asks of it: batches, and an eval that meets the
    target at the first eval point (the run ends there with success, as a converged run does)."""

    loss = None

    def __init__(self, tier, metric, on_policy):
        # At the target, or just past it where the target must be passed (qwen35_397b_grpo: `value > target`).
        past = math.inf if metric.higher_is_better else -math.inf
        self.value = math.nextafter(tier.target, past) if metric.strict else tier.target
        # An epoch of five eval intervals: eval points in epochs are then fractions, as in real runs.
        self.samples_per_epoch = 5 * tier.eval_every_samples if metric.unit == "epochs" else None
        self.step_key = ROLLOUT_STATS_KEY if on_policy else None

    def batch(self, step):
        return {}

    def prepare(self, model, batch):  # an on-policy task's rollouts (GRPO)
        return batch

    def step_sums(self):  # GRPO's per-step rollout figures, logged beside train_loss (ttt_rollout_stats)
        return torch.tensor([16.0, 160.0, 2.0, 1.0, 1.0, 4.0, 32.0]) if self.step_key else None

    def step_figures(self, sums):
        return rollout_figures(sums)

    def evaluate(self, model, autocast=None):
        return self.value

    def close(self):
        pass


class _Training:
    model = bare = autocast = load_seconds = None

    @staticmethod
    def sched(step):
        return 0.0

    def step(self, step, batch, accum, loss_fn, stop_vote=False, sums=None):
        return torch.cat([torch.tensor([2.0, 0.0]), torch.zeros(0) if sums is None else sums])


def loop_log(bench_name: str, tier: str, logdir: Path, monkeypatch) -> Path:
    """A run of `tier` through `train.loop.run` with stand-in model and data."""
    task = registry.get(bench_name).task
    monkeypatch.setattr(task, "resolve", lambda *a, **k: SimpleNamespace(files=lambda: []))
    monkeypatch.setattr(task, "open", lambda tier, *a: _Data(tier, task.metric, task.on_policy))
    monkeypatch.setattr(prepare, "build", lambda prep: _Training())
    # Fine-tuning tiers start from their shipped base; the stand-in model needs none.
    monkeypatch.setattr(loop, "check_init_base", lambda *a: InitBase(None, None))
    monkeypatch.setattr(loop, "_telemetry", lambda *a: "")  # reads the model's MoE routers
    res = loop.run(loop.RunOptions(bench_name, tier, logdir, logdir, seed=7, echo=False))
    assert (res.status, res.exit_code) == ("success", 0), res.reason
    return res.log_path


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """log(bench, tier): its loop log, made once for the module (on first use, so one tier that cannot
    run fails only its own tests)."""
    made = {}

    def log(bench: str, tier: str) -> Path:
        if (bench, tier) not in made:
            threads = torch.get_num_threads()
            with pytest.MonkeyPatch.context() as mp:
                made[bench, tier] = loop_log(bench, tier, tmp_path_factory.mktemp(f"{bench}-{tier}"), mp)
            # A tier's CPU thread count (qwen35_397b_grpo tiny: 1) holds for its run, not for the process after
            # it: it had left the rest of the test session on one thread.
            assert torch.get_num_threads() == threads
        return made[bench, tier]

    return log


@pytest.mark.parametrize("bench,tier,ruleset", RULESETS, ids=[f"{b}-{t}-{rs}" for b, t, rs in RULESETS])
def test_the_loop_log_of_every_tier_passes_the_official_common_rules(logs, bench, tier, ruleset):
    log = logs(bench, tier)
    keys = {r["key"] for r in mllog(log)}
    assert {"eval_accuracy", "block_start", "run_stop"} <= keys  # an eval point was logged
    # GRPO's per-step rollout figures are ttt keys of ours, which no official rule may reject.
    assert (ROLLOUT_STATS_KEY in keys) == registry.get(bench).task.on_policy
    assert official_errors(log, ruleset, tier) == []
    verdict = check_log(log, ruleset)  # and `ttt check` agrees
    assert verdict.ok, verdict.output


def test_a_log_missing_a_common_key_fails_both_checkers(logs, tmp_path):
    """The official common rules require train_samples exactly once: without it the official engine and
    `ttt check` (the assembled tiny rule file) both fail the log."""
    text = logs("llama31_8b", "tiny").read_text()
    cut = tmp_path / "result_0.txt"
    cut.write_text("".join(ln + "\n" for ln in text.splitlines() if '"key": "train_samples"' not in ln))
    assert any("train_samples" in m for m in official_errors(cut, "6.0.0", "tiny"))
    verdict = check_log(cut)
    assert not verdict.ok and "train_samples" in verdict.output


def test_ttt_check_judges_a_tiny_log_by_the_common_rules_of_the_ruleset_asked(logs, tmp_path):
    """6.1 requires config_filename; 6.0 leaves it optional. Under --ruleset 6.1.0 a llama31_8b tiny log is
    judged by its layers assembled on 6.1.0's common rules, so without the key it fails there, as under the
    official checker, and still passes under 6.0.0."""
    text = logs("llama31_8b", "tiny").read_text()
    cut = tmp_path / "result_0.txt"
    cut.write_text("".join(ln + "\n" for ln in text.splitlines() if '"key": "config_filename"' not in ln))
    assert any("config_filename" in m for m in official_errors(cut, "6.1.0", "tiny"))
    strict = check_log(cut, "6.1.0")
    assert not strict.ok and "config_filename" in strict.output
    assert strict.config.endswith("llama31_8b_tiny.yaml assembled on training_6.1.0")
    assert official_errors(cut, "6.0.0", "tiny") == [] and check_log(cut, "6.0.0").ok
