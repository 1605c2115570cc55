"""dlrmv4's reference tier through the real training loop: the logs `train.loop.run` writes at GBS 8,192, 16,384
and 32,768 pass the official compliance engine with closed_dlrmv4.yaml on the 6.1.0 common rules (`ttt check
--ruleset 6.1.0`, and the engine called directly), and `ttt score --ruleset 6.1.0` reads each as a compliant
converged run at its GBS; an LR outside the band is refused before run_start by the same path (and by `ttt run`
itself), with no result file.

What is real. All of `loop.run`: preflight (`--set global_batch_size`, the task's `validate`, `mlperf.keys.
check_rules` on the official closed files), cache_clear, init_start, the submission, seed, hyperparameter,
parallelism and precision keys, config_filename, init_stop, run_start, the timed loop with its `train_loss`
record per step (read one step late), evaluation where the closed rules put it at each GBS (the first eval at
step 7,000 / 4,340 / 2,870, then every 280 / 140 / 70 steps), block and eval records, run_stop; the dlrmv4
declaration and its reference tier as registered (GBS, the scaling law's LR, the 24,000-step warmup from 0, Adam
with the clip and row-wise Adagrad for the tables, the task's hyperparameter block, `ttt_model`: the reference
HSTU's family name and parameter count). At GBS 32,768 also the model build and `Training.step` (the schedule's
LR, forward, backward, clip, both optimizers' steps) on the stand-in model.

What is not. The model the family builds: a 4-row table looked up sparsely (row-wise Adagrad's) and a 2 -> 1
linear (Adam's, clipped), in place of the 600 GB HSTU. At GBS 8,192 and 16,384 the step itself: `prepare.build`
gives a `_StubStep` whose step returns a constant loss, as tests/test_official_common.py's does, since torch's
optimizer and autograd overhead on even a 2-parameter model is ~0.8 ms of CPU a step, ten times the loop's own
(docs/benchmarks/dlrmv4.md, "The reference tier's log path"), and 11,340 such steps would double the file's
time. The data: one fixed two-sample batch every step, in place of GBS Yambda-5B samples. The eval: a scripted
AUC (0.7503 at the first eval at GBS 8,192 and 16,384; 0.7498 then 0.7502 at 32,768, so one run goes on past a
missed eval), in place of the held-out window's. The stand-in benchmark (`stand_in`) is the registered one with
its task's data hooks and its family's build replaced, handed to `loop.run` as `RunOptions.benchmark` (a
declaration in place of a name); it keeps the name dlrmv4, so `ttt check` and `ttt score` judge its log by the
registered declaration and the official dlrmv4 files.
"""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import mllog, official_errors
from fakelogs import ttt_main
from torch import nn

from timetotrain.cli import main as ttt_cli
from timetotrain.errors import UserError
from timetotrain.mlperf.logger import ResultLog
from timetotrain.mlperf.results import parse_log
from timetotrain.spec.benchmark import apply_overrides
from timetotrain.spec.registry import get
from timetotrain.spec.task import RunData
from timetotrain.suite.dlrmv4 import WARMUP_STEPS, scaling_lr
from timetotrain.tasks.seqrec_rules import first_eval_samples
from timetotrain.train import loop, prepare

pytestmark = pytest.mark.e2e

BENCH = get("dlrmv4")
REF = BENCH.tier("reference")
# GBS -> (--set, first eval step, steps between evals, the scripted AUCs). The grid and the first eval are
# README.MD:653-654, :806-810's (tests/test_dlrmv4_rules.py checks them against the rule file at every GBS).
CASES = {
    8192: ([], 7000, 280, [0.7503]),  # the tier as declared: no --set
    16384: (["global_batch_size=16384"], 4340, 140, [0.7501]),
    32768: (["global_batch_size=32768"], 2870, 70, [0.7498, 0.7502]),
}
REAL_STEP = {32768}  # the GBS whose run builds the stand-in model and runs `Training.step`


class _Tiny(nn.Module):
    """The stand-in model: a table looked up sparsely, as HSTU's (row-wise Adagrad), and a linear (Adam)."""

    def __init__(self, cfg=None):
        super().__init__()
        self.embedding = nn.Embedding(4, 2)
        self.out = nn.Linear(2, 1)
        self.layers = nn.ModuleList()  # the harness's blocks (activation checkpointing, compile): none

    def forward(self, ids):
        return self.out(F.embedding(ids, self.embedding.weight, sparse=True)).squeeze(-1)


@torch.no_grad()
def _init(model, generator):
    for p in model.parameters():
        p.uniform_(-0.5, 0.5, generator=generator)


class _Data(RunData):
    def __init__(self, aucs):
        self.batch_, self.aucs = {"ids": torch.tensor([0, 3]), "y": torch.tensor([0.0, 1.0])}, list(aucs)

    def batch(self, step):
        return self.batch_

    def loss(self, model, batch, reduction="mean"):
        return F.binary_cross_entropy_with_logits(model(batch["ids"]), batch["y"], reduction=reduction)

    def evaluate(self, model, autocast=None):
        return self.aucs.pop(0)


class _Files:
    def __init__(self, data_dir):
        self.data_dir = data_dir

    def files(self):  # what cache_clear evicts: the folder's stand-in file
        return [self.data_dir / "stand_in.bin"]


class _StandInTask(type(BENCH.task)):
    """The registered task's rules (validate, eval grid, first eval, hyperparameter block); stand-in data."""

    def resolve(self, tier, data_dir, verify=True, init_checkpoint=None):
        return _Files(data_dir)

    def open(self, tier, resolved, seed, share, device):
        return _Data(CASES[tier.global_batch_size][3])

    def synthetic(self, tier, local_batch, generator, device):  # the warm-up before the clock
        return _Data([])


class _StubStep:
    """What `prepare.build` gives where the step is stubbed: the loop reads the loss and the stop votes from
    `step` and hands `model` to the eval; nothing else of a `Training`."""

    model = bare = autocast = load_seconds = None

    def __init__(self):
        self.out = torch.tensor([0.6931, 0.0])  # [global mean loss, ranks voting to stop]

    @staticmethod
    def sched(step):
        return 0.0

    def step(self, step, batch, accum, loss_fn, stop_vote=False, sums=None):
        return self.out


def stand_in():
    """dlrmv4 with the stand-in task and model; the family keeps its name and parameter count (`ttt_model`)."""
    tables = lambda m: [m.embedding.weight]  # noqa: E731
    family = dataclasses.replace(BENCH.family, build=_Tiny, init=_init, table_parameters=tables)
    return dataclasses.replace(BENCH, task=_StandInTask(), family=family)


def _data(tmp_path):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "stand_in.bin").write_bytes(bytes(16))
    return data


def _run(tmp_path, sets, monkeypatch=None):
    """A run of the stand-in through `loop.run`; with `monkeypatch`, on the stub step."""
    # One intra-op thread: the stand-in's tensors are a few elements, and two threads' parallel regions on a
    # busy 2-core host made each op take milliseconds.
    torch.set_num_threads(1)  # restored after the test (conftest)
    if monkeypatch is not None:
        monkeypatch.setattr(prepare, "build", lambda prep: _StubStep())
    logs = tmp_path / "logs"
    opts = loop.RunOptions(stand_in(), "reference", _data(tmp_path), logs, seed=7, sets=sets, echo=False)
    return loop.run(opts)


@pytest.mark.slow
@pytest.mark.parametrize("gbs", list(CASES))
def test_the_loop_log_at_each_rcp_batch_size_passes_the_closed_rules(tmp_path, capsys, monkeypatch, gbs):
    sets, first, every, aucs = CASES[gbs]
    res = _run(tmp_path, sets, None if gbs in REAL_STEP else monkeypatch)
    steps = first + every * (len(aucs) - 1)
    assert (res.status, res.exit_code, res.steps) == ("success", 0, steps), res.reason
    recs = mllog(res.log_path)
    keys = {r["key"]: r["value"] for r in recs}
    assert (keys["submission_benchmark"], keys["submission_division"]) == ("dlrmv4", "closed")
    assert (keys["global_batch_size"], keys["opt_base_learning_rate"]) == (gbs, scaling_lr(gbs))
    assert keys["opt_learning_rate_warmup_steps"] == WARMUP_STEPS == REF.warmup_steps
    assert keys["ttt_model"] == BENCH.model_key(REF)  # the reference HSTU, as `ttt check` expects
    evals = [r for r in recs if r["key"] == "eval_accuracy"]
    at = [(first + k * every) * gbs for k in range(len(aucs))]
    assert [r["metadata"]["samples_count"] for r in evals] == at
    assert evals[0]["metadata"]["samples_count"] == first_eval_samples(REF.data, gbs)
    assert [r["value"] for r in evals] == aucs
    losses = [r["value"] for r in recs if r["key"] == "train_loss"]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    # The timed records besides train_loss: one block to each eval point, the next block after a missed one.
    start = next(i for i, r in enumerate(recs) if r["key"] == "run_start")
    timed = [(r["key"], r["metadata"].get("samples_count")) for r in recs[start:] if r["key"] != "train_loss"]
    want = [("run_start", None), ("block_start", 0)]
    for k, point in enumerate(at):
        want += [(key, point) for key in ("block_stop", "eval_start", "eval_accuracy", "eval_stop")]
        want += [("block_start", point)] if k < len(at) - 1 else [("run_stop", point)]
    assert timed == want

    capsys.readouterr()
    assert ttt_main(["check", str(res.log_path), "--ruleset", "6.1.0"]) == 0, capsys.readouterr().out[-3000:]
    out = capsys.readouterr().out
    assert "official mlperf_logging engine: PASS" in out, out[-3000:]
    # The official engine directly, from common.yaml down the chain it enqueues (closed_common, closed_dlrmv4).
    assert official_errors(res.log_path, "6.1.0", "reference") == []

    # One run: no score (dlrmv4 needs 10), but the run is read as a compliant result at this GBS, and the RCP
    # checker reads the GBS from the log as the official one does (the last line naming global_batch_size).
    ttt_main(["score", str(tmp_path / "logs"), "--ruleset", "6.1.0", "--json"])
    (s,) = json.loads(capsys.readouterr().out)["results"]
    what = [s[k] for k in ("benchmark", "tier", "global_batch_size", "ruleset")]
    assert what == ["dlrmv4", "reference", gbs, "6.1.0"]
    (run,) = s["runs"]
    assert [run[k] for k in ("status", "compliant", "samples_to_converge")] == ["success", True, at[-1]], run
    assert s["rcp"]["bs"] == gbs and "error" not in s["rcp"]["message"], s["rcp"]


@pytest.mark.bad_input
@pytest.mark.parametrize("gbs", list(CASES))
def test_an_lr_outside_the_band_is_refused_before_run_start(tmp_path, capsys, gbs):
    """1.6 x the scaling law's LR (the band is 0.5-1.5 x): refused by the loop's preflight, and by `ttt run`
    on the registered benchmark, in one line, before any log line; the key a user may reach for first,
    learning_rate, is no setting at all."""
    lr, logs = 1.6 * scaling_lr(gbs), tmp_path / "logs"
    band = f"[{scaling_lr(gbs) / 2:g}, {1.5 * scaling_lr(gbs):g}] at global_batch_size={gbs}"
    with pytest.raises(UserError, match=band.replace("[", r"\[")):
        _run(tmp_path, [f"global_batch_size={gbs}", f"lr={lr}"])
    data = _data(tmp_path)
    for key in ("lr", "learning_rate"):
        capsys.readouterr()
        argv = ["run", "dlrmv4", "--tier", "reference", "--data", str(data), "--logdir", str(logs), "--quiet"]
        assert ttt_cli([*argv, "--set", f"global_batch_size={gbs}", "--set", f"{key}={lr}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ttt: error: --set"), err
        assert (band if key == "lr" else "'learning_rate' is not a setting") in err, err
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != data], "a file was written"


def test_the_rcp_checker_reads_the_logged_batch_size_after_a_set_one(tmp_path):
    """The official RCP checker (and the result_summarizer's GBS column) take the batch size from the last line
    whose text names global_batch_size (rcp_checker.read_submission_file): the init block logs `ttt_set` and
    `ttt_config`, which name it after `--set global_batch_size=16384`, before the hyperparameter block, so the
    checker and `ttt score` read 16,384, not the list ["global_batch_size=16384"]."""
    from mlperf_logging.rcp_checker.rcp_checker import read_submission_file

    sets = ["global_batch_size=16384"]
    tier = apply_overrides(BENCH, REF, sets)
    prep = prepare.preflight(BENCH, tier, tmp_path, None, "fp32", 0, False, device="cpu", seed=1)
    prep.seed = 1
    log = ResultLog(tmp_path)
    extra = {"ttt_data": "/data", "ttt_set": sets, "ttt_config": {"values": {"set": sets}}}
    prepare.log_init_keys(log, prep, "org", "platform", extra)
    copy = tmp_path / "init_block.txt"
    copy.write_text(log.live_path.read_text())
    log.close()
    assert read_submission_file(str(copy), "6.1.0", False)[2] == 16384
    assert parse_log(copy).global_batch_size == 16384
