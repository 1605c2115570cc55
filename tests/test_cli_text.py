"""What `ttt` says about itself and its inputs: every command and flag described, counts in words a person
writes ("1 run", "1 GPU"), and a note where a log is checked against a ruleset it says it does not follow."""

import argparse
import json
import re
import shutil

from conftest import strict_loads
from fakelogs import tier_log, tiny_runs, ttt_main

from timetotrain.cli import build_parser, main
from timetotrain.mlperf.results import ruleset_note
from timetotrain.mlperf.score import format_text, score_tree


def _undescribed(p: argparse.ArgumentParser, name: str) -> list[str]:
    out = [] if p.description or name == "ttt" else [f"{name}: no description"]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, sp in a.choices.items():
                out += _undescribed(sp, f"{name} {sub}")
        elif not isinstance(a, argparse._HelpAction | argparse._VersionAction) and not a.help:
            out.append(f"{name}: {a.option_strings or a.dest} has no help")
    return out


def test_every_command_has_a_description_and_every_flag_help():
    assert _undescribed(build_parser(), "ttt") == []


def test_counts_read_as_words(tmp_path, capsys):
    tiny_runs(tmp_path / "llama31_8b" / "tiny", n=1)
    text = format_text(score_tree(tmp_path))
    assert "note: 1 run is too few for an olympic mean" in text and "1 runs" not in text
    out = tmp_path / "pkg"
    assert (
        main(["package", "--org", "O", "--system", "s", "--results", str(tmp_path), "--out", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert "llama31_8b: 1 result file, the package checker wants exactly 10" in printed
    script = next(out.rglob("run_and_time.sh")).read_text()
    assert (
        "# Reproduces the llama31_8b run of results/s/llama31_8b/" in script
        and "1 result files" not in printed
    )
    assert main(["plan", "llama31_8b", "--tier", "tiny", "--gpus", "1", "--gpu-mem", "8"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert ", 1 GPU x 8 GiB, " in head and re.search(r": \d+\.\d\d M parameters", head)


def _with_ruleset(path, ruleset: str):
    """The log with the `ttt_ruleset` line every `ttt run` and `ttt synth` log carries."""
    lines = path.read_text().splitlines()
    rec = json.loads(lines[-1].removeprefix(":::MLLOG "))
    rec.update(key="ttt_ruleset", value=ruleset, event_type="POINT_IN_TIME")
    lines.insert(3, ":::MLLOG " + json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_log_of_another_ruleset_gets_one_note(tmp_path, capsys):
    ours = _with_ruleset(tier_log(tmp_path / "ours" / "result_0.txt", 5, 3200, 1.0), "6.0.0")
    assert ruleset_note(ours, "6.0.0") is None
    assert (
        ruleset_note(ours, "5.1.0")
        == f"{ours} was written for ruleset 6.0.0 (its ttt_ruleset), checked against 5.1.0"
    )
    # Official logs state no ruleset; the folder of a round's published results names it.
    plain = tier_log(tmp_path / "plain" / "result_0.txt", 5, 3200, 1.0)
    assert ruleset_note(plain, "6.0.0") is None
    v51 = tmp_path / "mlperf_results_v5.1" / "Org" / "results" / "box" / "llama31_8b" / "result_0.txt"
    v51.parent.mkdir(parents=True)
    shutil.copy(plain, v51)
    assert ruleset_note(v51, "5.1.0") is None
    capsys.readouterr()
    assert ttt_main(["check", str(v51), "--json"]) == 0
    out, err = capsys.readouterr()
    note = strict_loads(out)["ruleset_note"]
    assert "naming MLPerf Training v5.1" in note and note.endswith(
        "pass --ruleset 5.1.0 for that round's rules"
    )
    assert err == f"note: {note}\n"


def _texts(p: argparse.ArgumentParser):
    yield p.format_help()
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sp in a.choices.values():
                yield from _texts(sp)


def test_help_points_at_data_a_user_has():
    """`../shared/data` is this project's development folder; a user of the package has the folder
    `ttt data download fixtures` writes. Every command's help (and its examples) names that one."""
    helps = list(_texts(build_parser()))
    assert not [h.splitlines()[0] for h in helps if "shared/data" in h]
    assert any("ttt data download fixtures --out sources" in h for h in helps)


def test_one_thread_reads_as_a_word(monkeypatch):
    import torch

    from timetotrain.train import peak, synth

    monkeypatch.setattr(peak, "measure_cpu_peak", lambda: 1.0)  # the figure is not what is checked here
    for n, words in ((1, "1 thread;"), (2, "2 threads;")):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)
        assert f"matmul peak 0.0 GFLOP/s, {words}" in synth._peak(torch.device("cpu")).source
