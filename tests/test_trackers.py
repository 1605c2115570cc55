"""Experiment trackers: TensorBoard events hold the result log's own values; W&B (a stand-in module: the
real package is heavy and needs no network here) gets the same records; a missing package is one line."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import mllog, require, ttt_command
from toy_benchmark import make_data

from timetotrain.errors import UserError
from timetotrain.train import trackers as trk

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent


def tb_scalars(folder: Path, tag: str | None = None):
    """(step, value) of one tag; without a tag, the tags."""
    acc = require("tensorboard.backend.event_processing.event_accumulator")
    (run,) = [p for p in folder.iterdir() if p.is_dir()]
    ea = acc.EventAccumulator(str(run), size_guidance={acc.SCALARS: 0})
    ea.Reload()
    if tag is None:
        return ea.Tags()["scalars"]
    return [(e.step, e.value) for e in ea.Scalars(tag)]


@pytest.mark.slow
def test_tensorboard_holds_the_logged_train_loss(tmp_path):
    require("torch.utils.tensorboard")
    make_data(tmp_path / "data")
    env = {**os.environ, "TTT_EXTRA_BENCHMARKS": "toy_benchmark", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))}  # fmt: skip
    cmd = ttt_command("run", "toy_classify", "--tier", "tiny", "--data", str(tmp_path / "data"), "--logdir",
                      str(tmp_path / "logs"), "--seed", "3", "--quiet", "--tensorboard", str(tmp_path / "tb"))  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (log,) = (tmp_path / "logs" / "toy_classify" / "tiny").glob("result_*.txt")
    records = mllog(log)
    logged = [(r["metadata"]["step_num"], r["value"]) for r in records if r["key"] == "train_loss"]
    evals = [r["value"] for r in records if r["key"] == "eval_accuracy"]
    assert len(logged) > 10
    events = tb_scalars(tmp_path / "tb", "train_loss")
    assert [s for s, _ in events] == [s for s, _ in logged]
    # TensorBoard keeps float32.
    assert [v for _, v in events] == pytest.approx([v for _, v in logged], rel=1e-6)
    assert [v for _, v in tb_scalars(tmp_path / "tb", "eval_accuracy")] == pytest.approx(evals, rel=1e-6)
    lrs = tb_scalars(tmp_path / "tb", "lr")
    assert len(lrs) == len(logged) and all(v > 0 for _, v in lrs)
    (rate,) = [t for t in tb_scalars(tmp_path / "tb") if t.endswith("_per_s")]  # the task's items per second
    assert len(tb_scalars(tmp_path / "tb", rate)) == len(logged)


class FakeRun:
    def __init__(self, **kw):
        self.init = kw
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, values, step):
        self.logged.append((dict(values), step))

    def finish(self):
        self.finished = True


def test_wandb_gets_loss_lr_eval_and_expert_load_offline(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    t = trk.open_trackers(None, True, "gpt_oss_20b-tiny-seed1",
                          {"global_batch_size": 16, "items_per_sample": 256, "item": "tokens"}, tmp_path / "wb")  # fmt: skip
    t.lr_at = lambda i: 1e-3 * (i + 1)
    t.on_event("run_start", None, None)
    t.on_event("train_loss", 5.5, {"step_num": 1, "samples_count": 16})
    t.on_event("train_loss", 5.25, {"step_num": 2, "samples_count": 32})
    t.on_event(
        "ttt_rollout_stats", {"reward": 0.25, "zero_std_groups": 0.5}, {"step_num": 2, "samples_count": 32}
    )
    t.on_event("ttt_expert_load", {"min": 3, "max": 9, "cv": 0.5}, {"samples_count": 320})
    t.on_event("ttt_tokens_per_expert", [[1, 2], [3, 4]], {"samples_count": 320})
    t.on_event("eval_accuracy", 5.1, {"samples_count": 320})
    t.on_event("ttt_synth_mfu", 0.25, None)  # `ttt synth`: its summary figures, once
    t.close()
    (run,) = runs
    assert run.init["mode"] == "offline" and run.finished
    first, second = run.logged[0], run.logged[1]
    assert first[1] == 1 and first[0]["train_loss"] == 5.5 and first[0]["lr"] == pytest.approx(1e-3)
    assert second[0]["lr"] == pytest.approx(2e-3) and second[0]["tokens_per_s"] > 0
    assert ({"rollouts/reward": 0.25, "rollouts/zero_std_groups": 0.5}, 2) in run.logged  # GRPO, per step
    assert ({"expert_load/min": 3.0, "expert_load/max": 9.0, "expert_load/cv": 0.5}, 20) in run.logged
    assert ({"tokens_per_expert/0": 4.0, "tokens_per_expert/1": 6.0}, 20) in run.logged
    assert ({"eval_accuracy": 5.1}, 20) in run.logged
    assert run.logged[-1] == ({"synth/mfu": 0.25}, 0)


def test_a_missing_tracker_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(UserError, match=r"pip install 'timetotrain\[wandb\]'"):
        trk.open_trackers(None, True, "x", {}, tmp_path)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError, match=r"timetotrain\[tensorboard\]"):
        trk.open_trackers(tmp_path / "tb", False, "x", {}, tmp_path)
    assert trk.open_trackers(None, False, "x", {}, tmp_path) is None
