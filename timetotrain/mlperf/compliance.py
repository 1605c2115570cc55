"""Compliance: the official engine on whole logs, and the official hyperparameter rules before a run.

Rule files are data: the official `training_6.0.0/*.yaml` for reference tiers, ours (in each benchmark's
`rules_dir`, `suite/rules/` for the packaged ones, assembled on the official common rules by
mlperf/rule_files.py) for tiers that are not closed configurations. Both are evaluated by mlperf_logging's
own engine.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlperf_logging.compliance_checker as cc
import yaml
from mlperf_logging.benchmark_meta import get_allowed_benchmarks

from timetotrain import fileio
from timetotrain.errors import UserError
from timetotrain.mlperf.structure import Finding, check_structure, records
from timetotrain.spec import official, registry

if TYPE_CHECKING:  # spec/benchmark.py imports torch, which `ttt run`'s seed check must not wait for
    from timetotrain.spec.benchmark import Benchmark

RULESET = "6.0.0"


def official_rules_dir() -> Path:
    return Path(cc.__file__).parent


def rule_file(benchmark: str, tier: str) -> Path | None:
    """The rule file of a benchmark named in a log (`tier_rule_file`)."""
    return tier_rule_file(registry.get(benchmark), tier)


def tier_rule_file(bench: Benchmark, tier: str) -> Path | None:
    """Our rule file of `bench`'s `tier`, in the benchmark's own `rules_dir`; None means the official ruleset
    entry point (common.yaml), as for a real submission."""
    if tier == "reference":
        return None
    path = bench.rules_dir / f"{bench.name}_{tier}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no rule file for {bench.name} tier {tier} at {path}")
    return path


def rulesets() -> list[str]:
    """The training rulesets the installed mlperf_logging has rule files for (training_X.Y.Z folders)."""
    names = (p.name.removeprefix("training_") for p in official_rules_dir().glob("training_*"))
    return sorted((n for n in names if re.fullmatch(r"\d+\.\d+\.\d+", n)), key=_version_key)


def _version_key(ruleset: str) -> tuple[int, ...]:
    return tuple(int(x) for x in ruleset.split("."))


def check_ruleset(ruleset: str) -> str:
    """A UserError before any work for a ruleset the engine has no rules for: left to the official
    tools, it ends in their FileNotFoundError traceback or in NaN scores."""
    known = rulesets()
    if ruleset not in known:
        raise UserError(
            f"--ruleset {ruleset!r} is not a training ruleset of the installed mlperf_logging: choose one "
            f"of {', '.join(known[-4:])} (or older: {', '.join(known[:-4])})"
        )
    return ruleset


def log_rules(path: Path, keys: dict[str, object], ruleset: str = RULESET) -> Path | None:
    """The rule file of the tier a log claims (its `ttt_tier`; none means reference), or a UserError
    naming the log when nothing can judge it: not an MLPerf log, no benchmark, or a benchmark or tier
    no rule file covers. None means the ruleset's official common.yaml."""
    if not any(k is not None for k in keys):
        raise UserError(f"{path} holds no :::MLLOG lines: it is not an MLPerf result log")
    bench = keys.get("submission_benchmark")
    if bench in (None, ""):
        raise UserError(f"{path} logs no submission_benchmark: it is not a complete MLPerf result log")
    bench, tier = str(bench), str(keys.get("ttt_tier", "reference"))
    if tier == "reference":
        if bench in get_allowed_benchmarks("training", ruleset):
            return None
        facts = official.get(bench)
        where = (
            f"it is one of {', '.join(facts.rulesets)}: pass --ruleset {facts.rulesets[-1]}"
            if facts is not None and facts.rulesets
            else "an unknown benchmark"
        )
        raise UserError(
            f"{path}: submission_benchmark {bench!r} is not a benchmark of MLPerf Training {ruleset} ({where})"
        )
    if not registry.known(bench):
        raise UserError(
            f"{path}: submission_benchmark {bench!r} of ttt_tier {tier!r} is not a timetotrain benchmark "
            f"(ours: {', '.join(registry.names())})"
        )
    if tier not in registry.get(bench).tiers:
        raise UserError(
            f"{path}: ttt_tier {tier!r} is not a tier of {bench} (its tiers: {', '.join(registry.get(bench).tiers)})"
        )
    try:
        return rule_file(bench, tier)
    except FileNotFoundError as e:
        raise UserError(f"{path}: {e}") from e


def read_log_keys(path: Path) -> dict[str, object]:
    """First value of each MLLOG key (enough to pick the rule file)."""
    keys: dict[str, object] = {}
    for rec in records(path):
        keys.setdefault(rec.key, rec.value)
    return keys


@dataclass
class Verdict:
    """The official engine's verdict and ttt's own findings (mlperf/structure.py) on one log; it passes
    only when both do."""

    official: bool
    config: str
    output: str  # the engine's report
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.official and not self.findings


def tier_ruleset(bench, requested: str) -> str:
    """The ruleset a tier of ours is judged under: the requested one where its benchmark belongs to it
    (llama31_8b tiny under 6.1.0 then meets 6.1's common rules), else the benchmark's own (rgat tiny under
    the default 6.0.0 keeps the 5.1.0 rules its file was assembled on)."""
    return requested if official.official_benchmark(bench.name, requested) else bench.ruleset


def check_log(path: Path, ruleset: str = RULESET) -> Verdict:
    """Run `python -m mlperf_logging.compliance_checker` (the official engine) with the right rule file: the
    official chain for a reference log; for a tier of ours its shipped rule file, or, under another
    ruleset its benchmark belongs to, the same layers assembled on that ruleset's common rules. Then ttt's
    own checks (mlperf/structure.py), which a log must pass as well."""
    check_ruleset(ruleset)
    keys = read_log_keys(path)
    rules = log_rules(path, keys, ruleset)
    with tempfile.TemporaryDirectory() as tmp:
        engine_ruleset, config = ruleset, f"training_{ruleset}/common.yaml"
        if rules is not None:
            # heavy (1.5 s: torch, through spec.benchmark): `ttt --help` imports this module
            from timetotrain.mlperf.rule_files import assemble

            bench, tier = registry.get(str(keys["submission_benchmark"])), str(keys["ttt_tier"])
            engine_ruleset = tier_ruleset(bench, ruleset)
            config = str(rules)
            if engine_ruleset != bench.ruleset:
                rules = Path(tmp, rules.name)
                fileio.write_text(rules, assemble(bench, tier, engine_ruleset))
                config = f"{config} assembled on training_{engine_ruleset}"
        cmd = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training"]
        cmd += ["--ruleset", engine_ruleset, "--log_output", str(Path(tmp, "compliance.log"))]
        if rules is not None:
            cmd += ["--config", str(rules)]
        cmd.append(str(Path(path).resolve()))  # the engine runs in tmp: a relative path would miss
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
    out = (proc.stdout + proc.stderr).strip()
    return Verdict(proc.returncode == 0, config, out, check_structure(path))


class _Line:
    """What a rule's CHECK sees as `ll` for a key that is not yet in a log."""

    timestamp = 0.0


def hparam_violations(rule_files: list[Path], logged: list[tuple[str, object]]) -> list[str]:
    """Evaluate every rule of `rule_files` that concerns a logged hyperparameter, in log order, with the
    official engine's semantics (CHECK before POST, shared state `s`). Keys a rule requires exactly once
    but that are absent are reported too. Rules about the run itself (eval results, run structure) are
    skipped: they need a trained model."""
    # heavy (8 ms, 5% of `ttt --help`, which imports this module): only the rule check before a run needs it
    from mlperf_logging.compliance_checker.mlp_compliance import is_integer

    records: dict[str, dict] = {}
    begin: list[str] = []
    for f in rule_files:
        for item in yaml.load(f.read_text(), Loader=yaml.BaseLoader) or []:
            if "KEY" in item:
                records[item["KEY"]["NAME"]] = item["KEY"]
            elif "BEGIN" in item:
                begin.append(item["BEGIN"]["CODE"])
    state = {"s": {}, "is_integer": is_integer, "math": math, "enqueue_config": lambda _c: None}
    # The engine runs a file's BEGIN code when it loads the file, before any of its checks: a POST may read
    # what it set (closed_dlrmv4.yaml's global_batch_size POST reads s['train_samples'] from its BEGIN).
    for code in begin:
        exec(code.strip(), state)
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
