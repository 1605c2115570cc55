"""Ruleset 6.1.0 end to end for the logs `ttt run` writes: `ttt check`, `ttt score` and `ttt package` take
`--ruleset 6.1.0`. 6.1 requires the parallelism, precision and `config_filename` keys exactly once (optional
in 6.0), so a log without them fails there and only there; the loop logs of every tier of every benchmark
6.1 keeps pass the official 6.1 files (tests/test_official_common.py)."""

import json

import pytest
from fakelogs import tiny_runs, ttt_main

from timetotrain.mlperf.package import check_package

pytestmark = pytest.mark.e2e

SIX_ONE_KEYS = (
    "tensor_parallelism",
    "expert_parallelism",
    "lowest_numerical_precision_in_attn",
    "config_filename",
)


@pytest.fixture
def tiny_tree(tmp_path):
    tiny_runs(tmp_path / "logs" / "llama31_8b" / "tiny")
    return tmp_path / "logs"


def _score(tree, ruleset, capsys):
    capsys.readouterr()
    assert ttt_main(["score", str(tree), "--ruleset", ruleset, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["results"][0]


def test_score_under_6_1_equals_6_0_for_a_benchmark_both_keep(tiny_tree, capsys):
    new, old = _score(tiny_tree, "6.1.0", capsys), _score(tiny_tree, "6.0.0", capsys)
    assert new["ruleset"] == "6.1.0"
    assert new["rcp"]["verdict"] == old["rcp"]["verdict"] == "Pass"
    assert (new["score_minutes"], new["samples_to_converge"]) == (
        old["score_minutes"],
        old["samples_to_converge"],
    )
    assert all(r["compliant"] for r in new["runs"]), new["runs"]


def test_check_under_6_1_needs_the_keys_6_1_requires(tiny_tree, tmp_path, capsys):
    log = tiny_tree / "llama31_8b" / "tiny" / "result_0.txt"
    assert ttt_main(["check", str(log), "--ruleset", "6.1.0"]) == 0
    for key in SIX_ONE_KEYS:
        cut = tmp_path / f"cut_{key}" / "result_0.txt"
        cut.parent.mkdir()
        cut.write_text(
            "".join(ln + "\n" for ln in log.read_text().splitlines() if f'"key": "{key}"' not in ln)
        )
        capsys.readouterr()
        assert ttt_main(["check", str(cut), "--ruleset", "6.1.0"]) == 1
        assert key in capsys.readouterr().out
        assert ttt_main(["check", str(cut), "--ruleset", "6.0.0"]) == 0  # optional there


def test_package_under_6_1_fails_only_as_documented(tiny_tree, tmp_path, capsys):
    """The tree is written and the official 6.1 package checker runs on it; a tiny tier's logs are not
    closed results (docs/submission.md: the open division's placeholder target, the TODO status), and
    nothing else fails: no 6.1-only key is missing."""
    out = tmp_path / "pkg"
    argv = ["package", "--org", "ttt", "--system", "box", "--results", str(tiny_tree), "--out", str(out)]
    assert ttt_main(argv + ["--ruleset", "6.1.0"]) == 0
    ok, output = check_package(out, "6.1.0")
    assert not ok
    assert "Failed checks for eval_accuracy : v['value'] < 1.0" in output
    assert "Field status contains a non valid value" in output
    assert not [k for k in SIX_ONE_KEYS if f"occurrence of '{k}'" in output]
