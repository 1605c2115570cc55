"""The MLPerf keys a run logs before the clock: submission keys, the parallelism keys, and the check of
the hyperparameter block (each task writes its own: `Benchmark.hyperparameters`) against the rule file of
its division."""

from __future__ import annotations

from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir, rule_file
from timetotrain.suite.base import Benchmark, Tier, closed_violation


def submission_keys(bench: Benchmark, tier: Tier, org: str, plat: str) -> list[tuple[str, object]]:
    return [
        ("submission_benchmark", bench.name),
        ("submission_org", org),
        ("submission_division", tier.division),
        ("submission_status", "onprem"),
        ("submission_platform", plat),
    ]


def check_rules(bench: Benchmark, tier: Tier) -> None:
    """Refuse, before any log line, a configuration the rule file of its division would reject, and a
    closed one that breaks a training rule no rule file checks (`suite.base.closed_violation`)."""
    if tier.name == "reference":
        if tier.division != "closed":
            return
        files = [official_rules_dir() / f for f in bench.closed_rules]
    else:
        files = [rule_file(bench.name, tier.name)]
    logged = submission_keys(bench, tier, "x", "x") + bench.hyperparameters(tier)
    problems = hparam_violations(files, logged)
    if problems:
        hint = " (or --set division=open)" if tier.name == "reference" else ""
        raise UserError(f"{bench.name} {tier.name}: {problems[0]}: change the --set value{hint}")
    if tier.name == "reference":
        reason = closed_violation(bench, tier)
        if reason is not None:
            raise UserError(f"{bench.name} {tier.name}: {reason}")


def parallel_keys(plan, micro_batch: int) -> list[tuple[str, object]]:
    """The optional parallelism and precision keys of the 6.0 rules (integers / approved precision names)."""
    return [
        ("tensor_parallelism", getattr(plan, "tp", 1)),
        ("pipeline_parallelism", 1),
        ("context_parallelism", 1),
        ("expert_parallelism", getattr(plan, "ep", 1)),
        ("micro_batch_size", micro_batch),
        ("lowest_numerical_precision_in_linear", "bfloat16" if plan.precision == "bf16" else "fp32"),
    ]
