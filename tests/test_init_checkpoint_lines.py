"""`ttt plan` and `ttt run --dry-run` for tiers that start from a checkpoint (continued pretraining,
fine-tuning): the launch line carries --init-checkpoint CKPT and is preceded by where CKPT and the data come
from; a dry run without the flag warns in one line. Tiers that start from the family's init or from a
shipped base need nothing."""

import shlex

import pytest
from conftest import strict_loads

from timetotrain.cli import main
from timetotrain.spec import registry
from timetotrain.spec.benchmark import init_needed
from timetotrain.train.launch import before_launch, format_launch, launch_lines

ALL = [(n, t) for n in registry.names() for t in registry.get(n).tiers]
# The benchmarks whose reference starts from a published checkpoint (MLPerf Training 6.0/6.1 rules).
CONTINUED = {"llama31_405b", "deepseekv3_671b", "llama2_70b_lora", "qwen35_397b_grpo"}


@pytest.mark.parametrize("name,tier", ALL, ids=[f"{n}-{t}" for n, t in ALL])
def test_the_launch_line_carries_the_checkpoint_a_tier_starts_from(name, tier):
    bench = registry.get(name)
    t = bench.tier(tier)
    needed = init_needed(bench, t)
    # The reference of a continued or fine-tuned model needs it; a tier with a shipped base loads its own.
    assert bool(needed) == (name in CONTINUED and (t.base is None or t.base.shipped is None)), needed
    for gpus in (8, 16):  # one node, and two (the sbatch lines too)
        how = launch_lines(name, tier, "--parallel dp=8", gpus, 8, before_launch(bench, t))
        runs = [how["command"], *how.get("slurm", [])[-1:]]
        assert all(("--init-checkpoint CKPT" in r) == bool(needed) for r in runs), runs
        text = "\n".join(format_launch(how))
        assert ("CKPT: " in text) == bool(needed) and ("DATA: " in text) == bool(needed)
        if needed:
            assert text.index("CKPT: ") < text.index("DATA: ") < text.index(how["command"])


def test_plan_then_dry_run_of_a_fine_tuning_reference(capsys, monkeypatch):
    """The plan's text and JSON for llama2_70b_lora reference (LoRA on Llama 2 70B) on 8 GPUs; the launch
    line's `ttt run` as a dry run passes without the warning, and warns in one line once the flag is gone."""
    argv = ["plan", "llama2_70b_lora", "--gpus", "8", "--gpu-mem", "80", "--parallel", "fsdp=8"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "    CKPT: Llama 2 70B (MLCommons' fused-qkv safetensors" in text
    assert "    DATA: ttt data prepare --for llama2_70b_lora --tier reference --src SRC --out DATA" in text
    assert main([*argv, "--json"]) == 0
    launch = strict_loads(capsys.readouterr().out)["suggestion"]["launch"]
    assert launch["before"]["init_checkpoint"].startswith("Llama 2 70B")
    argv = shlex.split(launch["command"])
    ttt = argv[argv.index("-m") + 2 :]  # run llama2_70b_lora --tier reference ... --init-checkpoint CKPT ...
    assert ttt[ttt.index("--init-checkpoint") + 1] == "CKPT"
    monkeypatch.setenv("WORLD_SIZE", "8")  # as torchrun starts each of the 8 ranks
    assert main([*ttt, "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err
    i = ttt.index("--init-checkpoint")
    assert main([*ttt[:i], *ttt[i + 2 :], "--dry-run", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(
        "ttt: warning: llama2_70b_lora --tier reference starts from Llama 2 70B (MLCommons' fused-qkv "
    )
    assert "without --init-checkpoint CKPT the run would start from random weights" in err
    assert strict_loads(out)["init_checkpoint"]["warning"] in err


@pytest.mark.parametrize(
    "argv",
    [
        ["llama31_8b", "--tier", "tiny"],  # from scratch
        ["llama2_70b_lora", "--tier", "tiny"],  # the shipped base
        ["llama31_405b", "--tier", "reference", "--init-checkpoint", "ckpt"],
    ],
)
def test_no_warning_where_the_start_is_settled(argv, capsys):
    assert main(["run", *argv, "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_dry_run_of_the_405b_reference_without_its_checkpoint_warns(capsys):
    assert main(["run", "llama31_405b", "--tier", "reference", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert err == (
        "ttt: warning: llama31_405b --tier reference starts from Meta's Llama 3.1 405B checkpoint (Hugging Face "
        "safetensors; embedding and head cut to 32,768 rows): without --init-checkpoint CKPT the run would start "
        "from random weights and measure nothing the benchmark means\n"
    )
