"""The official-benchmark facts (timetotrain/spec/official.py) against the installed mlperf_logging:
each fact copied as data there is read back here from the package's own rule files, RCP files and
checker code, so an mlperf_logging update that changes one fails here."""

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fakelogs import _line

from timetotrain.mlperf.results import captured_logging, parse_log
from timetotrain.spec import official

pytestmark = pytest.mark.parity


def _pkg_dir(sub: str) -> Path:
    import mlperf_logging

    return Path(mlperf_logging.__file__).parent / sub


def _closed_yaml(name: str, ruleset: str) -> Path:
    return _pkg_dir("compliance_checker") / f"training_{ruleset}" / f"closed_{name}.yaml"


def _rcp_json(name: str, ruleset: str) -> Path:
    return _pkg_dir("rcp_checker") / f"training_{ruleset}" / f"rcps_{name}.json"


def _known(kind: str) -> set[str]:
    """Benchmark names with a closed rule file ("yaml") or an RCP file ("rcp") in any covered ruleset."""
    found = set()
    for rs in official.RULESETS:
        if kind == "yaml":
            files = (_pkg_dir("compliance_checker") / f"training_{rs}").glob("closed_*.yaml")
            found |= {p.stem.removeprefix("closed_") for p in files} - {"common"}
        else:
            files = (_pkg_dir("rcp_checker") / f"training_{rs}").glob("rcps_*.json")
            found |= {p.stem.removeprefix("rcps_") for p in files}
    return found


def test_every_benchmark_the_official_tools_know_is_in_the_table():
    from mlperf_logging.benchmark_meta import get_allowed_benchmarks

    summarizer = {b for rs in official.RULESETS for b in get_allowed_benchmarks("training", rs)}
    assert set(official.names()) == summarizer == _known("yaml") == _known("rcp") | {"stable_diffusion"}
    for b in official.names():
        facts = official.get(b)
        assert facts.name == b and facts.rulesets
        assert all(b in get_allowed_benchmarks("training", rs) for rs in facts.rulesets)
    assert official.get("llama31_8b").rulesets == ("5.1.0", "6.0.0", "6.1.0")
    assert official.get("resnet") is None and official.get("") is None


def _official_target(name: str, ruleset: str) -> tuple[float | None, bool | None]:
    """(target, higher is better) as the closed rule file's eval_accuracy check states it."""
    path = _closed_yaml(name, ruleset)
    rules = yaml.safe_load(path.read_text())
    checks = [r["KEY"].get("ATLEAST_ONE_CHECK", "") for r in rules if "KEY" in r]
    keys = {r["KEY"]["NAME"]: r["KEY"] for r in rules if "KEY" in r}
    if "eval_accuracy" not in keys:  # stable_diffusion: FID and CLIP on a virtual key
        assert any("FID" in c and "CLIP" in c for c in checks), path
        return None, None
    check = keys["eval_accuracy"]["ATLEAST_ONE_CHECK"]
    m = re.search(r"v\['value'\]\s*(<=|>=|<|>)\s*([0-9.]+)", check)
    if m is None:  # compared with a number set in the file's BEGIN code
        m = re.search(r"v\['value'\]\s*(<=|>=|<|>)\s*s\['target_accuracy'\]", check)
        value = re.search(r"'target_accuracy':\s*([0-9.]+)", path.read_text()).group(1)
        return float(value), m.group(1).startswith(">")
    return float(m.group(2)), m.group(1).startswith(">")


@pytest.mark.parametrize("name", official.names())
def test_target_and_direction_are_the_closed_rule_files(name):
    facts = official.get(name)
    seen = [rs for rs in official.RULESETS if _closed_yaml(name, rs).is_file()]
    assert seen
    for rs in seen:
        target, higher = _official_target(name, rs)
        assert target == facts.target, (name, rs)
        if higher is not None:
            assert higher == facts.higher_is_better, (name, rs)


def _eval_log(path: Path, name: str) -> Path:
    """A log whose one eval line carries both units: the value read back says which the reader used."""
    meta = {"samples_count": 1234, "epoch_num": 5.6789}
    evals = [("FID", 80.0), ("CLIP", 0.2)] if name == "stable_diffusion" else [(None, 0.5)]
    lines = [
        _line(1, "POINT_IN_TIME", "submission_benchmark", name),
        _line(2, "POINT_IN_TIME", "global_batch_size", 64),
        *[
            _line(3, "POINT_IN_TIME", "eval_accuracy", v, **meta, **({"metric": m} if m else {}))
            for m, v in evals
        ],
        _line(4, "INTERVAL_END", "run_stop", status="success"),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name", official.names())
def test_eval_unit_is_what_the_rcp_checker_reads(tmp_path, name):
    from mlperf_logging.rcp_checker import rcp_checker

    log = _eval_log(tmp_path / "result_0.txt", name)
    facts = official.get(name)
    for rs in facts.rulesets:
        with captured_logging():
            not_converged, point, bs, bench = rcp_checker.read_submission_file(str(log), rs, False)
        assert (not_converged, bs, bench) == (0, 64, name)
        assert point == (1234 if facts.eval_unit == official.SAMPLES else 5.679), (name, rs)
    # and our parser takes the same convergence point
    assert parse_log(log).samples_to_converge == point
    assert official.eval_unit(name) == facts.eval_unit


def test_unknown_benchmarks_count_in_epochs_like_the_rcp_checker(tmp_path):
    log = _eval_log(tmp_path / "result_0.txt", "my_new_bench")
    assert official.eval_unit("my_new_bench") == official.EPOCHS
    assert parse_log(log).samples_to_converge == 5.679
    assert official.converge_key("my_new_bench") == official.EPOCHS_TO_CONVERGE


@pytest.mark.parametrize("name", sorted(_known("rcp")))
def test_converge_key_and_hyperparams_are_the_official_rcp_files(name):
    from mlperf_logging.rcp_checker import rcp_checker

    facts = official.get(name)
    other = ({official.SAMPLES_TO_CONVERGE, official.EPOCHS_TO_CONVERGE} - {facts.converge_key}).pop()
    for rs in official.RULESETS:
        path = _rcp_json(name, rs)
        if not path.is_file():
            continue
        records = json.loads(path.read_text())
        for rec in records.values():
            assert facts.converge_key in rec and other not in rec, (name, rs)
            assert tuple(rec["Hyperparams"]) == facts.rcp_hparams, (name, rs)
        with captured_logging():  # the checker reads the list under the name it expects
            checker = rcp_checker.RCP_Checker("training", rs, name, False)
        assert all(r["Epochs to converge"] for r in checker.rcp_data.values())


@pytest.mark.parametrize(
    "name, ruleset", [("llama31_405b", "5.0.0"), ("llama31_405b", "6.0.0"), ("llama31_8b", "5.1.0")]
)
def test_min_mean_allowance_is_the_rcp_checkers(name, ruleset):
    """A submission mean just under the RCP's minimum acceptable mean passes exactly when the checker
    grants an allowance, and by as much as official.py says."""
    from mlperf_logging.rcp_checker import rcp_checker

    allowance = official.get(name).min_mean_allowance(ruleset)
    with captured_logging():
        checker = rcp_checker.RCP_Checker("training", ruleset, name, False)
        rec = next(iter(checker.pruned_rcp_data.values()))
        inside = rec["Min Epochs"] - (allowance / 2 if allowance else 1.0)
        outside = rec["Min Epochs"] - allowance - 1.0
        runs = checker.submission_runs
        ok_inside, _ = checker._eval_submission_record(copy.deepcopy(rec), [inside] * runs, "")
        ok_outside, _ = checker._eval_submission_record(copy.deepcopy(rec), [outside] * runs, "")
    assert ok_inside == bool(allowance) and not ok_outside
    assert official.get(name).min_mean_allowance("4.1.0") == 0.0


def test_official_facts_import_nothing_heavy():
    code = (
        "import sys, timetotrain.spec.official as o; o.get('rgat').rulesets; "
        "print(sorted({'torch', 'numpy', 'scipy', 'matplotlib'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
