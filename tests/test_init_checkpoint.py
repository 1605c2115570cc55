"""Starting a run from a checkpoint: `build_training(..., init_checkpoint=...)` and `ttt run
--init-checkpoint` load Hugging Face or ttt weights in place of the benchmark's init, during init."""

import json

import pytest
import torch
from conftest import mllog, require, ttt_run
from test_e2e_tiny import tiny

from timetotrain.models.llama.hf import from_hf_state_dict, hf_config_kwargs
from timetotrain.spec.registry import get
from timetotrain.train.checkpoint import save_checkpoint
from timetotrain.train.step import build_training

pytestmark = [pytest.mark.parity, pytest.mark.e2e]

BENCH = get("llama31_8b")
TIER = BENCH.tier("tiny")


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """An HF LlamaForCausalLM of the tiny tier's shape, saved in 2 shards, and its state dict."""
    transformers = require("transformers")
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_kwargs(TIER.model))).float()
    out = tmp_path_factory.mktemp("hf_tiny")
    hf.save_pretrained(out, safe_serialization=True, max_shard_size=2_000_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2
    return out, from_hf_state_dict(hf.state_dict(), TIER.model)


def test_build_training_starts_from_hf_weights(hf_tiny):
    path, ours = hf_tiny
    tr = build_training(BENCH, TIER, torch.device("cpu"), seed=5, init_checkpoint=path)
    state = tr.bare.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ours.items())
    fresh = build_training(BENCH, TIER, torch.device("cpu"), seed=5).bare.state_dict()
    assert not torch.equal(fresh["embed.weight"], state["embed.weight"])  # not the benchmark's init


def test_build_training_starts_from_a_ttt_checkpoint(tmp_path):
    a = build_training(BENCH, TIER, torch.device("cpu"), seed=7)
    save_checkpoint(tmp_path / "ck", a.bare, None, step=0)
    b = build_training(BENCH, TIER, torch.device("cpu"), seed=8, init_checkpoint=tmp_path / "ck")
    assert all(torch.equal(x, y) for x, y in zip(a.bare.parameters(), b.bare.parameters(), strict=True))
    assert torch.equal(a.bare.rope_cos, b.bare.rope_cos)


@pytest.mark.slow
def test_ttt_run_init_checkpoint(hf_tiny, c4_prepared, tmp_path):
    path, _ = hf_tiny
    args = ["run", "llama31_8b", "--tier", "tiny", "--data", str(c4_prepared), "--logdir", str(tmp_path)]
    args += ["--seed", "1", "--max-steps", "2", "--quiet", "--init-checkpoint", str(path)]
    proc = ttt_run(*args, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]  # aborted at the step limit, after loading
    keys = {r["key"]: r["value"] for r in mllog(tmp_path / "llama31_8b" / "tiny" / "result_0.txt")}
    assert keys["ttt_init_checkpoint"] == str(path)


@pytest.mark.slow
def test_bad_init_checkpoint_is_one_line_before_any_log(c4_prepared, tmp_path):
    args = ["run", "llama31_8b", "--tier", "tiny", "--data", str(c4_prepared), "--logdir", str(tmp_path)]
    proc = ttt_run(*args, "--init-checkpoint", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--init-checkpoint" in proc.stderr
    assert not list(tmp_path.rglob("result_*"))  # failed in preflight: no log started


def test_ttt_run_saves_a_checkpoint_init_checkpoint_reads(c4_prepared, tmp_path, capsys):
    """`--save-checkpoint DIR` (issue 24): after run_stop, the trained model and optimizer; the folder is
    what `--init-checkpoint` accepts, and only an earlier checkpoint is ever replaced."""
    from timetotrain.cli import main
    from timetotrain.train.checkpoint import check_init_source, load_checkpoint
    from timetotrain.train.loop import _check_save_target

    ck = tmp_path / "ck"
    args = [
        "run",
        "llama31_8b",
        "--tier",
        "tiny",
        "--data",
        str(c4_prepared),
        "--logdir",
        str(tmp_path / "logs"),
    ]
    args += ["--seed", "4", "--max-steps", "2", "--quiet", "--save-checkpoint", str(ck)]
    assert main(args) == 1  # aborted at the step limit, then saved
    assert "saved the trained state (step 2)" in capsys.readouterr().err
    assert check_init_source(ck, BENCH.family) == "ours"
    fresh = build_training(BENCH, TIER, torch.device("cpu"), seed=4)
    init = {k: v.clone() for k, v in fresh.bare.state_dict().items()}
    step, extra = load_checkpoint(ck, fresh.bare, fresh.opt)
    assert (step, extra) == (2, {"benchmark": "llama31_8b", "tier": "tiny", "seed": 4})
    moved = [k for k, v in fresh.bare.state_dict().items() if not torch.equal(v, init[k])]
    assert "embed.weight" in moved  # the trained weights, not the seed's init
    assert all(int(s["step"]) == 2 for s in fresh.opt.state.values())  # and the optimizer after 2 steps
    _check_save_target(ck)  # an earlier checkpoint may be replaced
    (tmp_path / "notes").mkdir()
    args[args.index(str(ck))] = str(tmp_path / "notes")
    assert main(args) == 2  # anything else is not
    assert "--save-checkpoint" in capsys.readouterr().err and list((tmp_path / "notes").iterdir()) == []


@pytest.mark.slow
def test_a_run_checks_its_init_checkpoint_and_computes_its_hyperparameters_once(
    c4_prepared, tmp_path, monkeypatch
):
    """The preflight's `check_init_source` (which scans a Hugging Face folder's tensors) is the run's only
    one: the load takes its finding. And the hyperparameter block the rules check is the one the log holds,
    computed once."""
    from timetotrain.cli import main
    from timetotrain.spec.benchmark import Benchmark
    from timetotrain.train import checkpoint, loop

    save_checkpoint(
        tmp_path / "ck", build_training(BENCH, TIER, torch.device("cpu"), seed=7).bare, None, step=0
    )
    checks, check, blocks, block = [], checkpoint.check_init_source, [], Benchmark.hyperparameters

    def counted(*a, **k):
        checks.append(a[0])
        return check(*a, **k)

    def computed(*a, **k):
        blocks.append(block(*a, **k))
        return blocks[-1]

    monkeypatch.setattr(loop, "check_init_source", counted)
    monkeypatch.setattr(checkpoint, "check_init_source", counted)
    monkeypatch.setattr(Benchmark, "hyperparameters", computed)
    ck = ["--init-checkpoint", str(tmp_path / "ck")]
    assert main(tiny(c4_prepared, tmp_path / "logs", "--seed", "4", "--max-steps", "1", *ck)) == 1
    assert checks == [tmp_path / "ck"]
    assert len(blocks) == 1
    logged = {r["key"]: r["value"] for r in mllog(tmp_path / "logs" / "llama31_8b" / "tiny" / "result_0.txt")}
    assert all(logged[k] == json.loads(json.dumps(v)) for k, v in blocks[0])  # as the log's JSON holds it
