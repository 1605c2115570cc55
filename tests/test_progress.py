"""Progress on long work: `ttt synth` says each phase as it starts, `ttt base` its first step at once and an
ETA, a slow checkpoint load its shards and tensors (timetotrain/progress.py LiveLine)."""

import dataclasses
import functools

import pytest
from conftest import random_hf_llama, require, small_llama

from timetotrain import progress
from timetotrain.models.llama import Llama
from timetotrain.models.llama.hf import hf_mapping
from timetotrain.spec.registry import get
from timetotrain.train import base_model
from timetotrain.train import checkpoint as ckpt
from timetotrain.train.synth import SynthOptions, synth


def test_synth_prints_a_line_as_each_phase_starts(tmp_path, capsys, monkeypatch):
    """The toy benchmark (tests/toy_benchmark.py): build, the first warm-up step, the timed window, its end,
    each on its own line before the work it names (stderr, so --json's stdout stays the summary)."""
    monkeypatch.setenv("TTT_EXTRA_BENCHMARKS", "toy_benchmark")
    synth(SynthOptions("toy_classify", "tiny", steps=2, warmup_steps=1, logdir=tmp_path, seed=1, echo=False))
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("synth toy_classify/tiny: ")]
    assert [line.split(": ", 1)[1].split(" ")[0] for line in lines] == ["building", "warm-up", "timing", "2"]
    assert "warm-up step 1/1 (the first step allocates memory)" in lines[1]
    assert lines[2].endswith("timing step 1/2") and " steps timed in " in lines[3]
    assert "synth" not in out


def test_base_prints_its_first_step_at_once_then_an_eta(c4_prepared, tmp_path, capsys):
    recipe = get("llama31_405b").tier("tiny").base
    pre = recipe.pretraining
    pre = dataclasses.replace(
        pre, max_steps=2, warmup_steps=1, eval_samples=2, data=dataclasses.replace(pre.data, seq_len=64)
    )
    recipe = dataclasses.replace(recipe, benchmark=dataclasses.replace(recipe.benchmark, tiers={"tiny": pre}))
    base_model.make_base(recipe, c4_prepared, tmp_path / "cache")
    err = capsys.readouterr().err.splitlines()
    what = f"base {recipe.benchmark.name}/{pre.name}: "
    assert err[0] == what + "pretraining 2 steps"
    # After step 1, not step 10: the step, its loss, the time so far and the steps left x the mean step.
    assert err[1].startswith(what + "step 1/2  loss ") and " elapsed, ETA " in err[1]
    assert err[-1] == what + "evaluating on 2 samples"


def test_base_eta_is_steps_left_times_the_mean_step(monkeypatch):
    monkeypatch.setattr(base_model.time, "monotonic", lambda: 1000.0 + 50.0)
    line = base_model._base_progress("base x/y", 10, 70, 2.5, t_steps=1000.0)  # 5 s a step, 60 left
    assert line == "base x/y: step 10/70  loss 2.5000  [0:50 elapsed, ETA 5:00]"
    assert base_model._clock(3 * 3600 + 61) == "3:01:01"


def test_checkpoint_load_prints_progress_only_once_slow(tmp_path, capsys, monkeypatch):
    """One file: silent while quicker than QUIET_S (a tiny checkpoint says nothing), then shard and tensor."""
    safetensors = require("safetensors.torch")
    cfg = small_llama()
    single = tmp_path / "single"
    single.mkdir()
    hf_sd = random_hf_llama(cfg).state_dict()
    safetensors.save_file(hf_sd, single / ckpt.HF_SINGLE)
    ckpt.load_hf_checkpoint(Llama(cfg), single, hf_mapping(cfg))
    assert "loading" not in capsys.readouterr().err
    monkeypatch.setattr(ckpt, "QUIET_S", 0.0)  # as if the load had already taken that long
    monkeypatch.setattr(ckpt, "LiveLine", functools.partial(progress.LiveLine, plain_interval=0.0))
    ckpt.load_hf_checkpoint(Llama(cfg), single, hf_mapping(cfg))
    err = capsys.readouterr().err.splitlines()
    n = len(hf_sd)  # every tensor of the file is read (no extras)
    at = f"loading single: shard 1/1 ({ckpt.HF_SINGLE})"
    assert err == [at] + [f"{at}, tensor {j}/{n}" for j in range(1, n + 1)] + ["loading single: 1/1 shards"]


@pytest.mark.parametrize("quiet", [0.0, 3600.0])
def test_live_line_quiet_period_and_due(quiet):
    class Sink:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return False

    sink = Sink()
    line = progress.LiveLine(sink, quiet_s=quiet)
    assert line.due() == (quiet == 0) and not line.shown
    line.update("a")
    line.update("b")  # within the plain interval: dropped
    line.update("c", force=True)  # forced: always
    assert sink.text == ("a\nc\n" if quiet == 0 else "c\n") and line.shown
