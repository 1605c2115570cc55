"""Compliance: the official engine on whole logs, and the official hyperparameter rules before a run.

Rule files are data: the official `training_6.0.0/*.yaml` for reference tiers, ours (in each benchmark's
`rules_dir`, `suite/rules/` for the packaged ones) for tiers that are not closed configurations. Both are
evaluated by mlperf_logging's own engine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

RULESET = "6.0.0"


def official_rules_dir() -> Path:
    import mlperf_logging.compliance_checker as cc

    return Path(cc.__file__).parent


def rule_file(benchmark: str, tier: str) -> Path | None:
    """None means: the official ruleset entry point (common.yaml), as for a real submission."""
    if tier == "reference":
        return None
    from timetotrain import suite

    path = suite.get(benchmark).rules_dir / f"{benchmark}_{tier}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no rule file for {benchmark} tier {tier} at {path}")
    return path


def read_log_keys(path: Path) -> dict[str, object]:
    """First value of each MLLOG key (enough to pick the rule file)."""
    keys: dict[str, object] = {}
    with open(path, encoding="latin-1") as f:
        for line in f:
            _, sep, payload = line.partition(":::MLLOG ")
            if not sep:
                continue
            try:
                rec = json.loads(payload)
            except json.JSONDecodeError:
                continue
            keys.setdefault(rec.get("key"), rec.get("value"))
    return keys


@dataclass
class Verdict:
    ok: bool
    config: str
    output: str


def check_log(path: Path, ruleset: str = RULESET) -> Verdict:
    """Run `python -m mlperf_logging.compliance_checker` (the official engine) with the right rule file."""
    keys = read_log_keys(path)
    bench = str(keys.get("submission_benchmark", ""))
    tier = str(keys.get("ttt_tier", "reference"))
    rules = rule_file(bench, tier) if bench else None
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training"]
        cmd += ["--ruleset", ruleset, "--log_output", str(Path(tmp, "compliance.log"))]
        if rules is not None:
            cmd += ["--config", str(rules)]
        cmd.append(str(path))
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
    out = (proc.stdout + proc.stderr).strip()
    return Verdict(proc.returncode == 0, str(rules) if rules else f"training_{ruleset}/common.yaml", out)


class _Line:
    """What a rule's CHECK sees as `ll` for a key that is not yet in a log."""

    timestamp = 0.0


def hparam_violations(rule_files: list[Path], logged: list[tuple[str, object]]) -> list[str]:
    """Evaluate every rule of `rule_files` that concerns a logged hyperparameter, in log order, with the
    official engine's semantics (CHECK before POST, shared state `s`). Keys a rule requires exactly once
    but that are absent are reported too. Rules about the run itself (eval results, run structure) are
    skipped: they need a trained model."""
    from mlperf_logging.compliance_checker.mlp_compliance import is_integer

    records: dict[str, dict] = {}
    for f in rule_files:
        for item in yaml.load(f.read_text(), Loader=yaml.BaseLoader) or []:
            if "KEY" in item:
                records[item["KEY"]["NAME"]] = item["KEY"]
    state = {"s": {}, "is_integer": is_integer, "math": math, "enqueue_config": lambda _c: None}
    problems = []
    seen = set()
    for key, value in logged:
        rec = records.get(key)
        if rec is None:
            continue
        seen.add(key)
        local = {"v": {"value": value, "metadata": {}}, "ll": _Line()}
        checks = rec.get("CHECK", [])
        for expr in checks if isinstance(checks, list) else [checks]:
            try:
                ok = eval(expr.strip(), state, local)
            except Exception as e:  # a rule that cannot be evaluated is a failure, as in the engine
                ok, expr = False, f"{expr.strip()} ({type(e).__name__}: {e})"
            if not ok:
                problems.append(f"{key}={value!r} fails `{expr.strip()}`")
        if "POST" in rec:
            exec(rec["POST"].strip(), state, local)
    run_keys = {"eval_accuracy", "run_start", "run_stop", "init_start", "init_stop", "cache_clear"}
    for key, rec in records.items():
        if rec.get("REQ") == "EXACTLY_ONE" and key not in seen and key not in run_keys:
            problems.append(f"{key} is required by the rules but not logged")
    return problems
