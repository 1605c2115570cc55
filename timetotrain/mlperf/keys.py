"""The MLPerf keys a run logs before the clock: submission keys, the parallelism keys, and the check of
the hyperparameter block (each task writes its own: `Benchmark.hyperparameters`) against the rule file of
its division."""

from __future__ import annotations

from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir, tier_rule_file
from timetotrain.spec.benchmark import Benchmark, Tier, closed_violation


def submission_keys(bench: Benchmark, tier: Tier, org: str, plat: str) -> list[tuple[str, object]]:
    return [
        ("submission_benchmark", bench.name),
        ("submission_org", org),
        ("submission_division", tier.division),
        ("submission_status", "onprem"),
        ("submission_platform", plat),
    ]


def check_rules(
    bench: Benchmark, tier: Tier, hyperparameters: list[tuple[str, object]] | None = None
) -> None:
    """Refuse, before any log line, a configuration the rule file of its division would reject, and a
    closed one that breaks a training rule no rule file checks (`spec.benchmark.closed_violation`).
    `hyperparameters`: the block the run will log (`train/prepare.Prepared.hyperparameters`), so that what
    is checked is what is logged; None (`ttt check`, no run): the block of one process."""
    if tier.name == "reference":
        if tier.division != "closed":
            return
        files = [official_rules_dir() / f for f in bench.closed_rules]
    else:
        files = [tier_rule_file(bench, tier.name)]
    # With the keys every run logs after the hyperparameters (one process, fp32 here: the rules only ask
    # that they are present and well formed), which rule files from 6.1 on require.
    if hyperparameters is None:
        hyperparameters = bench.hyperparameters(tier)
    logged = submission_keys(bench, tier, "x", "x") + hyperparameters
    logged += parallel_keys(None, bench.micro_batch(tier)) + config_keys(bench, tier)
    problems = hparam_violations(files, logged)
    if problems:
        hint = " (or --set division=open)" if tier.name == "reference" else ""
        raise UserError(f"{bench.name} {tier.name}: {problems[0]}: change the --set value{hint}")
    if tier.name == "reference":
        reason = closed_violation(bench, tier)
        if reason is not None:
            raise UserError(f"{bench.name} {tier.name}: {reason}")


def parallel_keys(plan, micro_batch: int) -> list[tuple[str, object]]:
    """The parallelism and precision keys: optional in the 6.0 rules, each required exactly once from 6.1
    on (integers >= 1, approved precision names). `plan` None: one process in fp32."""
    return [
        ("tensor_parallelism", getattr(plan, "tp", 1)),
        ("pipeline_parallelism", getattr(plan, "pp", 1)),
        ("context_parallelism", getattr(plan, "cp", 1)),
        ("expert_parallelism", getattr(plan, "ep", 1)),
        ("micro_batch_size", micro_batch),
        ("lowest_numerical_precision_in_linear", "fp8" if _fp8(plan) else _precision(plan)),
        # bf16 autocast runs the attention kernels (SDPA) in bf16 too; float8 covers linears only.
        ("lowest_numerical_precision_in_attn", _precision(plan)),
        ("lowest_numerical_precision_in_comm", _comm_precision(plan)),
    ]


def _fp8(plan) -> bool:
    return getattr(plan, "precision", "fp32") == "fp8"


def _precision(plan) -> str:
    """The non-float8 compute: bf16, or fp32 (under fp8, `Plan.high`)."""
    compute = getattr(plan, "compute", getattr(plan, "precision", "fp32"))
    return "bfloat16" if compute == "bf16" else "fp32"


def _comm_precision(plan) -> str:
    """The narrowest dtype a collective of the plan carries: under bf16, FSDP2 gathers bf16 parameters
    (train/parallel.py) and TP / EP exchange bf16 activations; DDP and a single process reduce fp32
    gradients (FSDP2 reduces in fp32 too). Under fp8's tensorwise recipe FSDP2 gathers float8 weights
    (train/float8.py); TP's activations stay in the non-float8 precision."""
    if _fp8(plan) and getattr(plan, "fsdp", 1) > 1 and getattr(plan, "fp8_recipe", "") == "tensorwise":
        return "fp8"
    sharded = any(getattr(plan, k, 1) > 1 for k in ("fsdp", "tp", "ep"))
    return "bfloat16" if _precision(plan) == "bfloat16" and sharded else "fp32"


def config_keys(bench: Benchmark, tier: Tier) -> list[tuple[str, object]]:
    """`config_filename`, required from 6.1 on: the configuration a run was launched with. Ours is the tier
    declaration (`<benchmark>_<tier>`, the name of its rule file and RCP), whose --set changes the logged
    hyperparameters record."""
    return [("config_filename", f"{bench.name}_{tier.name}")]
