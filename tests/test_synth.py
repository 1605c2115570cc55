"""`ttt synth`: random weights on random tokens, a complete log, sane figures, one log under torchrun."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import mllog, strict_loads, ttt_command, ttt_run
from fakelogs import tiny_runs, ttt_main

from timetotrain.train.synth import SynthOptions, _percentile, format_per_rank, per_rank, synth

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]


def test_synth_tiny_writes_log_and_summary(tmp_path):
    s = synth(SynthOptions("llama31_8b", "tiny", steps=3, warmup_steps=1, logdir=tmp_path, seed=11))
    d = tmp_path / "synth" / "llama31_8b" / "tiny"
    assert Path(s["log"]) == d / "result_0.txt"
    on_disk = json.loads((d / "summary.json").read_text())
    assert on_disk == json.loads((d / "summary_0.json").read_text())
    assert on_disk["tokens_per_s"] == pytest.approx(s["tokens_per_s"])
    assert s["tokens_per_s"] > 0 and s["mfu"] > 0
    # MFU is achieved model FLOP/s over the peak (a CPU's peak is measured at run time, so no bound on it).
    assert s["mfu"] == pytest.approx(s["model_tflops_per_s_per_device"] / s["peak_tflops_per_device"])
    assert s["samples_per_s"] == pytest.approx(s["tokens_per_s"] / 256)
    assert s["step_time_s"]["p50"] <= s["step_time_s"]["p90"] <= s["step_time_s"]["max"]
    # FLOPs identity: achieved = tokens/s x FLOPs/token.
    assert s["model_tflops_per_s"] * 1e12 == pytest.approx(s["tokens_per_s"] * s["model_flops_per_item"])
    # Random tokens: the model cannot beat the uniform guess by much after 4 steps.
    assert abs(s["final_loss"] - s["baseline_loss"]) < 1.0
    recs = mllog(d / "result_0.txt")
    keys = [r["key"] for r in recs]
    for k in (
        "cache_clear",
        "init_start",
        "submission_benchmark",
        "seed",
        "global_batch_size",
        "opt_name",
        "init_stop",
        "run_start",
        "block_start",
        "block_stop",
        "run_stop",
        "ttt_synth_tokens_per_s",
    ):
        assert k in keys, k  # fmt: skip
    assert keys.index("init_stop") < keys.index("run_start") < keys.index("run_stop")
    assert recs[-1]["metadata"]["status"] == "success"
    assert recs[-1]["metadata"]["samples_count"] == 4 * 16


@pytest.mark.slow
def test_synth_second_run_never_overwrites(tmp_path):
    synth(SynthOptions("llama31_8b", "tiny", steps=2, warmup_steps=0, logdir=tmp_path, seed=1))
    synth(SynthOptions("llama31_8b", "tiny", steps=2, warmup_steps=0, logdir=tmp_path, seed=2))
    d = tmp_path / "synth" / "llama31_8b" / "tiny"
    assert sorted(p.name for p in d.glob("result_*.txt")) == ["result_0.txt", "result_1.txt"]
    assert json.loads((d / "summary.json").read_text())["seed"] == 2
    assert json.loads((d / "summary_0.json").read_text())["seed"] == 1


@pytest.mark.slow
def test_synth_unwritable_logdir_is_one_line_before_any_model():
    proc = ttt_run("synth", "llama31_8b", "--tier", "tiny", "--logdir", "/proc/forbidden")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "not writable" in proc.stderr
    assert ":::MLLOG" not in proc.stdout


def torchrun_synth(*args: str) -> subprocess.CompletedProcess:
    """`ttt synth llama31_8b --tier tiny` for 2+1 steps in 2 gloo processes sharing the 2 cores."""
    cmd = ttt_command(
        "synth", "llama31_8b", "--tier", "tiny", "--steps", "2", "--warmup-steps", "1", *args, nproc=2
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_synth_under_torchrun_two_processes_one_log(tmp_path):
    proc = torchrun_synth("--logdir", str(tmp_path), "--seed", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = tmp_path / "synth" / "llama31_8b" / "tiny"
    assert [p.name for p in d.glob("result_*.txt")] == ["result_0.txt"]
    s = json.loads((d / "summary.json").read_text())
    assert s["world_size"] == 2 and s["tokens_per_s_per_device"] == pytest.approx(s["tokens_per_s"] / 2)
    # Each rank's figures, gathered after the window: they add up to the global rate, and the table shows them.
    assert [r["rank"] for r in s["per_rank"]] == [0, 1]
    assert sum(r["tokens_per_s"] for r in s["per_rank"]) == pytest.approx(s["tokens_per_s"])
    assert max(r["peak_memory_bytes"] for r in s["per_rank"]) == s["peak_memory_bytes"]
    assert all(0 < r["step_time_p50_s"] <= s["seconds_timed"] for r in s["per_rank"])
    assert "per rank:" in proc.stdout and proc.stdout.count("\n") > 14
    recs = mllog(d / "result_0.txt")
    assert [r["key"] for r in recs].count("run_start") == 1  # only rank 0 logged


@pytest.mark.slow
def test_tensor_parallel_ranks_share_their_samples(tmp_path):
    """Under tp=2 both ranks step through the same samples: the global rate is the per-rank rates' sum / 2
    (summing all ranks counted every sample twice)."""
    proc = torchrun_synth("--logdir", str(tmp_path), "--seed", "5", "--parallel", "tp=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "synth" / "llama31_8b" / "tiny" / "summary.json").read_text())
    ranks = [r["tokens_per_s"] for r in s["per_rank"]]
    assert s["tokens_per_s"] == pytest.approx(sum(ranks) / 2)
    assert s["samples_per_s"] == pytest.approx(s["tokens_per_s"] / 256)


def test_synth_results_live_apart_and_readers_of_results_skip_them(tmp_path, monkeypatch, capsys):
    """By default `ttt synth` writes ./synth/...; a synth log that sits in a tree of results anyway (the old
    default put it in ./logs) is skipped with a note by score, report and package, which then read the
    tree as if it were not there."""
    import shutil

    from timetotrain.cli import main
    from timetotrain.mlperf.compliance import RULESET
    from timetotrain.mlperf.results import parse_log

    monkeypatch.chdir(tmp_path)
    argv = ["synth", "llama31_8b", "--steps", "2", "--warmup-steps", "0", "--seed", "4", "--json"]
    assert main(argv) == 0
    # --json: the summary, strict JSON (json.loads would let a NaN through), the whole of stdout.
    printed = strict_loads(capsys.readouterr().out)
    made = Path("synth") / "llama31_8b" / "tiny"
    assert printed == json.loads((made / "summary.json").read_text()) | {
        "summary_path": printed["summary_path"]
    }
    assert [p.name for p in made.glob("result_*.txt")] == ["result_0.txt"]
    assert not Path("logs").exists()
    # The log says which ruleset it was written for (`ttt check` against another says so).
    assert parse_log(made / "result_0.txt").keys["ttt_ruleset"] == RULESET
    # A tree of results with a synth log inside it, as `--logdir logs` leaves it.
    tiny_runs(tmp_path / "logs" / "llama31_8b" / "tiny", n=10)
    shutil.copytree("synth", tmp_path / "logs" / "synth")
    assert ttt_main(["score", "logs", "--json"]) == 0
    out, err = capsys.readouterr()
    (only,) = json.loads(out)["results"]
    assert (only["benchmark"], len(only["runs"])) == ("llama31_8b", 10)
    note = [line for line in err.splitlines() if "ttt synth" in line]
    assert len(note) == 1 and note[0].startswith("note: skipped 1 `ttt synth` log ")
    assert "logs/synth/llama31_8b/tiny/result_0.txt" in note[0]
    assert ttt_main(["report", "logs", "--out", "report"]) == 0
    assert sorted(p.name for p in Path("report").glob("*.png")) == ["llama31_8b-tiny.png"]
    assert "skipped 1 `ttt synth` log" in capsys.readouterr().err
    assert ttt_main(["package", "--org", "o", "--system", "s", "--results", "logs", "--out", "pkg"]) == 0
    assert sorted(p.name for p in Path("pkg/results/s").iterdir()) == ["llama31_8b"]
    assert len(list(Path("pkg/results/s/llama31_8b").glob("result_*.txt"))) == 10
    # A tree of synth logs alone is no tree of results: one line that says so.
    capsys.readouterr()
    assert ttt_main(["score", "synth"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("ttt: error: only `ttt synth` logs under synth (") and len(err) == 2


def test_per_rank_rows_and_their_table():
    rows = per_rank([[1000.0, 0.5, 0.52, 2**30], [900.0, 0.55, 0.56, 2**31]], "tokens")
    assert rows[1] == {"rank": 1, "tokens_per_s": 900.0, "step_time_p50_s": 0.55, "step_time_mean_s": 0.56,
                       "peak_memory_bytes": 2**31}  # fmt: skip
    lines = format_per_rank({"item": "tokens", "per_rank": rows}).splitlines()
    assert "tokens/s" in lines[0] and "peak memory (GiB)" in lines[0]
    assert lines[2].split() == ["1", "900", "0.5500", "0.5600", "2.00"]


def test_percentile():
    assert _percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert _percentile([3.0], 0.5) == 3.0


@pytest.mark.slow
def test_compiled_blocks_train_on_cpu(tmp_path):
    from torch._dynamo.utils import counters

    counters.clear()
    s = synth(
        SynthOptions("llama31_8b", "tiny", steps=2, warmup_steps=1, logdir=tmp_path, seed=3, compile=True)
    )
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks really went through torch.compile
    assert s["parallel"].endswith("compiled")
    assert abs(s["final_loss"] - s["baseline_loss"]) < 1.0


@pytest.mark.slow
def test_bf16_with_activation_checkpointing_on_cpu(tmp_path):
    s = synth(
        SynthOptions(
            "llama31_8b", "tiny", steps=2, warmup_steps=1, logdir=tmp_path, seed=3, precision="bf16",
            activation_checkpointing=True,
        )
    )  # fmt: skip
    assert s["precision"] == "bf16" and "AC" in s["parallel"]
    recs = mllog(Path(s["log"]))
    assert next(r["value"] for r in recs if r["key"] == "lowest_numerical_precision_in_linear") == "bfloat16"
    assert abs(s["final_loss"] - s["baseline_loss"]) < 1.0


@pytest.mark.slow
def test_fsdp_bf16_under_torchrun(tmp_path):
    proc = torchrun_synth(
        "--logdir", str(tmp_path), "--seed", "5", "--parallel", "fsdp=2", "--precision", "bf16", "--ac"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "synth" / "llama31_8b" / "tiny" / "summary.json").read_text())
    assert s["parallel"].startswith("fsdp=2, bf16, AC") and s["world_size"] == 2


def test_flux_layers_keep_the_double_single_proportion():
    from timetotrain.models import flux
    from timetotrain.spec.registry import get

    ref = get("flux1").tier("reference").model
    split = {n: (c.n_double, c.n_single) for n in (1, 2, 3, 6, 57) for c in [flux.with_layers(ref, n)]}
    assert split == {1: (0, 1), 2: (1, 1), 3: (1, 2), 6: (2, 4), 57: (19, 38)}
    assert flux.with_layers(ref, 57) == ref and ref.n_layers == 57


def test_flux_synth_with_layers_counts_the_reduced_model(tmp_path):
    import dataclasses

    from timetotrain.models import flux
    from timetotrain.spec.registry import get
    from timetotrain.train.synth import format_table

    opts = SynthOptions("flux1", "tiny", steps=2, warmup_steps=0, logdir=tmp_path, seed=1, layers=3)
    s = synth(dataclasses.replace(opts, sets=["global_batch_size=4"]))  # small: only the counts matter
    assert s["layers"] == 3 and s["layers_of"] == 6  # of the tiny tier's 2 double + 4 single blocks
    assert s["layers_config"] == {"n_double": 1, "n_single": 2}
    reduced = dataclasses.replace(get("flux1").tier("tiny").model, n_double=1, n_single=2)
    assert s["model_flops_per_sample"] == flux.flops_per_sample(reduced)
    achieved = s["samples_per_s"] * flux.flops_per_sample(reduced)
    assert s["model_tflops_per_s"] * 1e12 == pytest.approx(achieved)
    assert s["mfu"] == pytest.approx(s["model_tflops_per_s_per_device"] / s["peak_tflops_per_device"])
    recs = mllog(Path(s["log"]))
    logged = next(r["value"] for r in recs if r["key"] == "ttt_model")
    assert logged["parameters"] == flux.param_count(reduced)  # the model that ran
    assert "3 of its 6 layers (n_double=1, n_single=2)" in format_table(s)
