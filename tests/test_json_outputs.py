"""Every `--json` output and JSON file for other programs is strict JSON: what `python -m json.tool`, jq or
JSON.parse accept (no NaN, no Infinity). A figure that has no value is null, with its reason beside it.
(`ttt synth --json` is checked in tests/test_synth.py, on the synth run that test makes anyway.)"""

import json
import math

from conftest import strict_loads
from fakelogs import tier_log, tiny_runs, ttt_main

from timetotrain import strictjson
from timetotrain.cli import main


def test_non_finite_figures_become_null_with_a_reason():
    doc = {"a": math.nan, "b": [1.0, -math.inf], "c": {"d": math.inf, "d_reason": "said by the writer"}}
    out = strict_loads(strictjson.dumps(doc))
    assert out["a"] is None and "nan" in out["a_reason"]
    assert out["b"] == [1.0, None]
    assert out["c"] == {"d": None, "d_reason": "said by the writer"}
    assert json.dumps(doc) != strictjson.dumps(doc)  # Python's own writes NaN, which strict parsers reject


def test_score_and_report_json_of_one_run(tmp_path, capsys):
    """One run: no olympic mean, no CV, no RCP mean of the runs. Python's json wrote NaN for them."""
    tiny_runs(tmp_path / "logs" / "llama31_8b" / "tiny", n=1)
    capsys.readouterr()
    ttt_main(["score", str(tmp_path / "logs"), "--json"])
    (s,) = strict_loads(capsys.readouterr().out)["results"]
    assert len(s["runs"]) == 1 and s["rcp"]["submission_mean"] is None
    assert ttt_main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "rep")]) == 0
    assert strict_loads((tmp_path / "rep" / "scores.json").read_text()) == {"results": [s]}


def test_check_json(tmp_path, capsys):
    log = tier_log(tmp_path / "result_0.txt", 5, 3200, 1.0)
    capsys.readouterr()
    assert ttt_main(["check", str(log), "--json"]) == 0
    doc = strict_loads(capsys.readouterr().out)
    assert (doc["log"], doc["verdict"], doc["ok"]) == (str(log), "PASS", True)
    assert doc["rules"].endswith("llama31_8b_tiny.yaml")


def test_plan_json(capsys):
    from timetotrain.spec import registry
    from timetotrain.train.memory import GiB, plan

    argv = ["plan", "llama31_8b", "--tier", "tiny", "--gpus", "1", "--gpu-mem", "8", "--json"]
    assert main(argv) == 0
    doc = strict_loads(capsys.readouterr().out)
    bench = registry.get("llama31_8b")
    n, rows, best = plan(bench, bench.tier("tiny"), 1, 8, None)
    assert doc["parameters"] == n and len(doc["rows"]) == len(rows)
    assert [r["total_gib"] for r in doc["rows"]] == [r.total / GiB for r in rows]
    assert doc["suggestion"]["parallel"] == best.parallel and "--parallel" in doc["suggestion"]["run_flags"]
    # Nothing fits: the suggestion is null, and the document says why.
    assert main(argv[:-3] + ["--gpu-mem", "0.0001", "--json"]) == 1
    doc = strict_loads(capsys.readouterr().out)
    assert doc["suggestion"] is None and "nothing fits" in doc["suggestion_reason"]


def test_run_json_is_the_whole_stdout(tmp_path, capsys, monkeypatch):
    """The toy benchmark (tests/toy_benchmark.py) in-process: no MLLOG echo, one summary object."""
    from toy_benchmark import make_data

    monkeypatch.setenv("TTT_EXTRA_BENCHMARKS", "toy_benchmark")
    make_data(tmp_path / "data")
    argv = ["run", "toy_classify", "--tier", "tiny", "--data", str(tmp_path / "data")]
    assert main(argv + ["--logdir", str(tmp_path / "logs"), "--seed", "1", "--json"]) == 0
    doc = strict_loads(capsys.readouterr().out)
    (run,) = doc["runs"]
    assert (doc["met_target"], doc["of"], run["seed"], run["status"]) == (1, 1, 1, "success")
    assert run["log"] == str(tmp_path / "logs" / "toy_classify" / "tiny" / "result_0.txt")
