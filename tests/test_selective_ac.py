"""Selective activation checkpointing (`--ac-every K`, train/parallel.py): every K-th block wrapped, the step
unchanged, `ttt plan`'s estimate between none and every block, bad K refused in one line."""

import dataclasses

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from timetotrain.cli import main
from timetotrain.errors import UserError
from timetotrain.spec.registry import get
from timetotrain.train import parallel
from timetotrain.train.memory import activation_bytes, estimate, plan

BENCH = get("llama31_8b")


def _model(layers=4):
    torch.manual_seed(0)
    return BENCH.family.build(dataclasses.replace(BENCH.tier("tiny").model, n_layers=layers))


def test_every_second_block_of_four_is_wrapped_and_the_step_is_unchanged():
    """--ac-every 2 on a 4-layer model wraps exactly blocks 0 and 2; loss and every gradient equal no AC."""
    plain, selective = _model(), _model()
    parallel.apply(selective, parallel.Plan(activation_checkpointing=2), torch.device("cpu"), BENCH.family)
    wrapped = [i for i, b in enumerate(selective.layers) if isinstance(b, CheckpointWrapper)]
    assert wrapped == [0, 2]
    tokens = torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (plain, selective):
        loss = m(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    named = dict(plain.named_parameters())
    for name, p in selective.named_parameters():
        ref = named[name.replace("._checkpoint_wrapped_module", "")]
        torch.testing.assert_close(p.grad, ref.grad, rtol=0, atol=0, msg=name)
    # Plan's old bool still means every block (True) or none.
    every = _model()
    parallel.apply(every, parallel.Plan(activation_checkpointing=True), torch.device("cpu"), BENCH.family)
    assert all(isinstance(b, CheckpointWrapper) for b in every.layers)
    assert parallel.Plan(activation_checkpointing=2).describe() == "single process, fp32, AC every 2nd block"


def test_the_plan_estimate_lies_between_no_checkpointing_and_every_block():
    tier = BENCH.tier("reference")
    cfg, T = tier.model, 8192
    none, every, half = (activation_bytes(BENCH.family, cfg, T, 2, ac) for ac in (0, 1, 2))
    assert every < half < none
    # 16 of 32 blocks keep their whole count, 16 only their input: half the way, less the shared terms.
    assert half - every == pytest.approx(16 * T * 2 * (BENCH.family.activation_elements(cfg) - cfg.dim))
    rows = [estimate(BENCH, tier, 0, 8, 80, "fsdp", ac, 1, True) for ac in (0, 2, 1)]
    assert rows[0].total > rows[1].total > rows[2].total
    # `ttt plan --ac-every 2` plans that only; `--ac` every block only (the audit: it printed the plan of
    # no --ac); the default both none and every block.
    _, got, _ = plan(BENCH, tier, 8, 80, "fsdp=8", ac=2)
    assert {r.ac for r in got} == {2} and got[0].activations == rows[1].activations
    assert {r.ac for r in plan(BENCH, tier, 8, 80, "fsdp=8", ac=1)[1]} == {1}
    assert {r.ac for r in plan(BENCH, tier, 8, 80, "fsdp=8")[1]} == {0, 1}


def test_plan_ac_flags_change_the_table_and_the_launch_line(capsys):
    argv = ["plan", "llama31_8b", "--gpus", "8", "--gpu-mem", "80", "--parallel", "fsdp=8"]
    tables = []
    for extra in ([], ["--ac"], ["--ac-every", "2"]):
        assert main(argv + extra) == 0
        tables.append(capsys.readouterr().out)
    assert len(set(tables)) == 3
    assert "fsdp=8        on " in tables[1] and "fsdp=8        off" not in tables[1]
    assert "fsdp=8        1/2" in tables[2] and "activation checkpointing every 2nd block" in tables[2]
    assert "--parallel fsdp=8 --precision bf16 --set micro_batch_size=2 --ac-every 2\n" in tables[2]


@pytest.mark.parametrize("k", ["0", "-1", "33"])
def test_a_bad_k_is_one_line(k, capsys):
    assert main(["plan", "llama31_8b", "--gpus", "8", "--gpu-mem", "80", "--ac-every", k]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"ttt: error: --ac-every {k}: checkpoint every K-th block, K from 1 (every block, as --ac) up to the "
        "model's 32 blocks; 2 wraps blocks 0, 2, 4, ..."
    ]


def test_run_refuses_more_than_the_blocks_before_building(tmp_path):
    from timetotrain.train import prepare

    tier = BENCH.tier("tiny")
    with pytest.raises(UserError, match=r"--ac-every 3: .* up to the model's 2 blocks"):
        prepare.preflight(BENCH, tier, tmp_path, None, "fp32", 3, False, device="cpu")
    assert (
        prepare.preflight(
            BENCH, tier, tmp_path, None, "fp32", 2, False, device="cpu"
        ).plan.activation_checkpointing
        == 2
    )


@pytest.mark.parametrize("command", ["run", "synth", "plan"])
def test_the_flag_teaches(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--ac-every K" in text and "checkpoint every K-th block (blocks 0, K, 2K, ...)" in text
    assert "K=1 is --ac" in text
