"""Facts about the official MLPerf Training benchmarks, as the official `mlperf_logging` tools know them.

One record per benchmark that the result summarizer, the RCP checker or the compliance checker of the
training rulesets in RULESETS knows, whether or not timetotrain implements it: scoring, RCP checks and
plots of any submission need these facts, not just of our own benchmarks.

Most facts live in mlperf_logging as code rather than data (the samples/epochs split and the name of
the RCP convergence list are literals inside rcp_checker functions, the quality targets are Python
expressions inside the compliance YAML), so they are copied here as data, each with where it was read
(mlperf-logging 4.1.68). tests/test_official.py checks every one of them against the installed package,
so an mlperf_logging update that changes a fact fails a test instead of silently diverging. The
rulesets a benchmark belongs to and the number of result files it needs are the exception:
`benchmark_meta` exposes them as data, so they are read from there (the rulesets lazily, on first use).

Imports nothing heavy (no torch, numpy or the checkers), so `ttt score` and `ttt report` stay fast.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mlperf_logging.benchmark_meta import get_allowed_benchmarks, get_result_file_counts

# The training rulesets this table covers. 6.1.0 is included because its benchmarks (qwen35_397b_grpo,
# dlrmv4) are already counted in samples by the rcp_checker and by our log parser.
RULESETS = ("5.0.0", "5.1.0", "6.0.0", "6.1.0")

SAMPLES, EPOCHS = "samples", "epochs"
# The names the official RCP files (and rcp_checker._process_raw_rcp_data) give the convergence list.
SAMPLES_TO_CONVERGE, EPOCHS_TO_CONVERGE = "samples to converge", "Epochs to converge"

_LOG_PERPLEXITY = "validation log perplexity (mean cross-entropy)"


@dataclass(frozen=True)
class OfficialBenchmark:
    """What the official tools know about one benchmark (closed division)."""

    name: str
    # Quality target of `eval_accuracy` (closed_<name>.yaml's ATLEAST_ONE_CHECK); None where the target is
    # not one number (stable_diffusion: FID and CLIP together).
    target: float | None
    higher_is_better: bool
    # Which eval_accuracy metadata the RCP checker counts convergence in: "samples" (samples_count) or
    # "epochs" (epoch_num, rounded to 3 decimals; bert logs put a sample count there).
    eval_unit: str
    converge_key: str  # the convergence list's name in the official RCP records
    rcp_hparams: tuple[str, ...]  # the "Hyperparams" keys of an official RCP record, in the files' order
    metric_label: str  # what eval_accuracy measures, for plot axes
    # Subtracted from the RCP's minimum acceptable mean from ruleset 5.0.0 on (rcp_checker
    # _eval_submission_record special-cases llama31_405b: one v5.0 eval interval, in samples).
    rcp_allowance: float = 0.0

    @property
    def rulesets(self) -> tuple[str, ...]:
        """The rulesets of RULESETS whose result summarizer lists this benchmark (benchmark_meta)."""
        return _rulesets_of(self.name)

    def min_mean_allowance(self, ruleset: str) -> float:
        """How much the rcp_checker lowers the minimum acceptable mean under `ruleset`."""
        return self.rcp_allowance if self.rcp_allowance and _version(ruleset) >= (5, 0, 0) else 0.0


def _version(ruleset: str) -> tuple[int, ...]:
    # As rcp_checker.is_version_at_least compares: numeric parts, padded with zeros.
    parts = tuple(int(x) for x in ruleset.split("."))
    return parts + (0,) * (3 - len(parts))


@functools.cache
def _allowed() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for rs in RULESETS:
        try:
            names = get_allowed_benchmarks("training", rs)
        except ValueError:  # an older mlperf_logging without this ruleset
            continue
        for n in dict.fromkeys(names):  # 4.0 lists stable_diffusion twice; keep each once
            out.setdefault(n, []).append(rs)
    return {n: tuple(v) for n, v in out.items()}


def _rulesets_of(name: str) -> tuple[str, ...]:
    return _allowed().get(name, ())


def result_files(name: str) -> int | None:
    """How many result files the package checker wants of `name` in a submission (exactly that many; the
    result summarizer's olympic mean drops the fastest and slowest), as benchmark_meta holds it: 3 for the
    largest (llama31_405b, deepseekv3_671b, qwen35_397b_grpo), 10 for most. The same for every tier of ours,
    since the checker knows only the benchmark's name. None for a name the official tools do not know."""
    return get_result_file_counts("training").get(name)


def official_benchmark(name: str, ruleset: str) -> bool:
    """Whether the round `ruleset` has a benchmark `name` (the result summarizer's table)."""
    try:
        return name in get_allowed_benchmarks("training", ruleset)
    except (KeyError, ValueError):  # a ruleset the table does not list
        return False


# Where each column was read, in mlperf_logging 4.1.68:
#   target, higher_is_better: compliance_checker/training_<rs>/closed_<name>.yaml, the eval_accuracy
#       ATLEAST_ONE_CHECK (qwen35_397b_grpo and dlrmv4: its `target_accuracy`; stable_diffusion: the
#       aggregated_eval_accuracy check on FID and CLIP). Equal in every ruleset that has the file.
#   eval_unit: rcp_checker.read_submission_file, the set of benchmarks read from `samples_count`
#       (stable_diffusion: its own branch, `samples_count` except in 3.1.0); the rest use `epoch_num`.
#   converge_key: rcp_checker.RCP_Checker._process_raw_rcp_data (llama2_70b_lora, flux1) and the
#       rcp_checker/training_<rs>/rcps_<name>.json files.
#   rcp_hparams: the "Hyperparams" of every record of rcp_checker/training_<rs>/rcps_<name>.json.
#   rcp_allowance: rcp_checker.RCP_Checker._eval_submission_record.
#   metric_label: not in mlperf_logging; the metric the MLPerf Training rules name for the target.
_TABLE = (
    OfficialBenchmark(
        "bert",
        0.720,
        True,
        EPOCHS,
        EPOCHS_TO_CONVERGE,
        (
            "opt_base_learning_rate",
            "opt_epsilon",
            "opt_learning_rate_training_steps",
            "num_warmup_steps",
            "start_warmup_step",
            "opt_lamb_beta_1",
            "opt_lamb_beta_2",
            "opt_lamb_weight_decay_rate",
            "gradient_accumulation_steps",
        ),
        "masked-LM accuracy",
    ),
    OfficialBenchmark(
        "dlrm_dcnv2",
        0.80275,
        True,
        EPOCHS,
        EPOCHS_TO_CONVERGE,
        (
            "opt_name",
            "opt_base_learning_rate",
            "opt_adagrad_learning_rate_decay",
            "opt_adagrad_initial_accumulator_value",
            "opt_adagrad_epsilon",
            "opt_weight_decay",
            "opt_learning_rate_warmup_steps",
            "opt_learning_rate_decay_start_step",
            "opt_learning_rate_decay_steps",
        ),
        "AUC",
    ),
    OfficialBenchmark(
        "retinanet",
        0.340,
        True,
        EPOCHS,
        EPOCHS_TO_CONVERGE,
        (
            "opt_base_learning_rate",
            "opt_learning_rate_warmup_factor",
            "opt_learning_rate_warmup_epochs",
            "opt_weight_decay",
        ),
        "mAP",
    ),
    OfficialBenchmark(
        "stable_diffusion",
        None,  # two targets, FID (lower is better) and CLIP (higher is better): no single number
        True,
        SAMPLES,
        EPOCHS_TO_CONVERGE,
        (
            "opt_adamw_beta_1",
            "opt_adamw_beta_2",
            "opt_adamw_epsilon",
            "opt_adamw_weight_decay",
            "opt_base_learning_rate",
            "opt_learning_rate_warmup_steps",
        ),
        "FID (<= 90) and CLIP score (>= 0.15)",
    ),
    OfficialBenchmark(
        "llama2_70b_lora",
        0.925,
        False,
        SAMPLES,
        SAMPLES_TO_CONVERGE,
        (
            "opt_base_learning_rate",
            "opt_max_grad_norm",
            "opt_learning_rate_warmup_epochs",
            "opt_learning_rate_decay_boundary_epochs",
            "gradient_accumulation_steps",
            "lora_r",
            "lora_alpha",
            "max_steps",
        ),
        "validation loss (cross-entropy)",
    ),
    OfficialBenchmark(
        "rgat",
        0.72,
        True,
        EPOCHS,
        EPOCHS_TO_CONVERGE,
        ("opt_base_learning_rate",),
        "node classification accuracy",
    ),
    OfficialBenchmark(
        "llama31_405b",
        5.6,
        False,
        SAMPLES,
        EPOCHS_TO_CONVERGE,
        ("opt_base_learning_rate", "opt_learning_rate_warmup_steps", "gradient_accumulation_steps"),
        _LOG_PERPLEXITY,
        rcp_allowance=46080,
    ),
    OfficialBenchmark(
        "llama31_8b",
        3.3,
        False,
        SAMPLES,
        EPOCHS_TO_CONVERGE,
        ("opt_base_learning_rate", "opt_learning_rate_warmup_samples", "gradient_accumulation_steps"),
        _LOG_PERPLEXITY,
    ),
    OfficialBenchmark(
        "flux1",
        0.586,
        False,
        SAMPLES,
        SAMPLES_TO_CONVERGE,
        (
            "opt_adamw_beta_1",
            "opt_adamw_beta_2",
            "opt_adamw_epsilon",
            "opt_adamw_weight_decay",
            "opt_base_learning_rate",
            "opt_learning_rate_warmup_steps",
            "opt_gradient_clip_norm",
        ),
        "validation loss",
    ),
    OfficialBenchmark(
        "gpt_oss_20b",
        3.34,
        False,
        SAMPLES,
        EPOCHS_TO_CONVERGE,
        ("opt_base_learning_rate", "opt_learning_rate_warmup_samples", "gradient_accumulation_steps"),
        _LOG_PERPLEXITY,
    ),
    OfficialBenchmark(
        "deepseekv3_671b",
        3.6,
        False,
        SAMPLES,
        EPOCHS_TO_CONVERGE,
        (
            "opt_base_learning_rate",
            "opt_learning_rate_warmup_steps",
            "opt_learning_rate_decay_steps",
            "gradient_accumulation_steps",
        ),
        _LOG_PERPLEXITY,
    ),
    OfficialBenchmark(
        "qwen35_397b_grpo",
        0.69,  # strictly above: the check is `value > target_accuracy`
        True,
        SAMPLES,
        EPOCHS_TO_CONVERGE,
        (
            "opt_base_learning_rate",
            "opt_gradient_clip_norm",
            "num_prompts_per_step",
            "num_generations_per_prompt",
            "gradient_accumulation_steps",
        ),
        "validation accuracy",
    ),
    OfficialBenchmark(
        "dlrmv4",
        0.75,
        True,
        SAMPLES,
        EPOCHS_TO_CONVERGE,
        ("opt_base_learning_rate", "opt_learning_rate_warmup_steps", "gradient_accumulation_steps"),
        "AUC",
    ),
)

BENCHMARKS: dict[str, OfficialBenchmark] = {b.name: b for b in _TABLE}


def get(name: str) -> OfficialBenchmark | None:
    """The facts of an official benchmark; None for a name the official tools do not know."""
    return BENCHMARKS.get(name)


def names() -> list[str]:
    return list(BENCHMARKS)


def eval_unit(name: str) -> str:
    """SAMPLES or EPOCHS: epochs for a name the official tools do not know, as the rcp_checker reads
    `epoch_num` for every benchmark it does not single out."""
    facts = get(name)
    return facts.eval_unit if facts is not None else EPOCHS


def converge_key(name: str) -> str:
    """The convergence list's name in an RCP record of `name`: the rcp_checker reads "Epochs to
    converge" unless it singles the benchmark out, so our own RCP files follow the same rule."""
    facts = get(name)
    return facts.converge_key if facts is not None else EPOCHS_TO_CONVERGE
