"""`ttt plan --simulate` (timetotrain/train/simulate.py) against a real run.

The tiny tier's sharded layouts on 2 ranks, simulated (fake process group, fake tensors) and measured for real
(2 gloo processes under torchrun, real tensors) with the same tracker through the same build and step:
parameter, gradient and optimizer bytes equal, the activations at the peak within 10%. And layouts that
cannot be built fail with one line naming what does not divide.

Run as a script (by torchrun) this file is the worker: it writes its rank's measured bytes to a file."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

from timetotrain.cli import main
from timetotrain.errors import UserError
from timetotrain.train import prepare
from timetotrain.train.simulate import _combine, _in_child, simulate, simulate_rank
from timetotrain.train.synth import with_layers

pytestmark = pytest.mark.distributed

LAYOUTS = [("llama31_8b", "fsdp=2"), ("gpt_oss_20b", "ep=2,fsdp=2")]


def _measure_real(bench: str, spec: str, out: Path) -> None:
    b, t = prepare.resolve_tier(bench, "tiny", [])
    rank = int(os.environ["RANK"])
    m = simulate_rank(b, t, 2, spec, rank, "fp32", False, fake=False)
    out.with_suffix(f".{rank}.json").write_text(json.dumps(dataclasses.asdict(m)))


@pytest.mark.parametrize("bench,spec", LAYOUTS)
def test_simulated_bytes_match_a_real_gloo_run(bench, spec, tmp_path):
    out = tmp_path / "real"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), __file__, bench, spec, str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    b, t = prepare.resolve_tier(bench, "tiny", [])
    sim = simulate(b, t, 2, spec, precision="fp32")
    for rank in (0, 1):
        real = json.loads(out.with_suffix(f".{rank}.json").read_text())
        fake = dataclasses.asdict(sim.ranks[rank])
        for key in ("parameters", "gradients", "optimizer"):
            assert fake[key] == real[key] > 0, (rank, key, fake[key], real[key])
        for phase in ("forward", "backward", "optimizer step"):  # each phase's peak, and its activations
            f, r = fake["phases"][phase], real["phases"][phase]
            assert abs(sum(f.values()) - sum(r.values())) <= 0.10 * sum(r.values()), (rank, phase, f, r)
            assert abs(f["activations"] - r["activations"]) <= 0.10 * max(r["activations"], 1), (rank, phase)


def test_plan_simulate_adds_the_simulated_column_and_the_report(capsys):
    main(["plan", "llama31_8b", "--tier", "tiny", "--gpus", "2", "--gpu-mem", "1", "--parallel", "fsdp=2",
          "--precision", "fp32", "--simulate"])  # fmt: skip
    out = capsys.readouterr().out
    table, report = out.split("\nsimulated: ", 1)
    assert "simulated" in table.splitlines()[1]
    sim_row = next(ln for ln in table.splitlines() if ln.startswith("fsdp=2") and ln.split()[4] != "-")
    assert sim_row.split()[6].endswith("G")  # the simulated column holds a size on the simulated row
    assert "rank 0" in report and "rank 1" in report and "ratio simulated / formula" in report


def test_layers_extrapolate_to_the_full_depth():
    """Rank 0 of fsdp=2 at 3 and 4 tiny layers, extrapolated, gives what 5 layers give: identical layers add
    identical bytes (what `--layers` relies on)."""
    b, t = prepare.resolve_tier("llama31_8b", "tiny", [])
    at = {
        n: _in_child(simulate_rank, b, with_layers(b, t, n), 2, "fsdp=2", 0, "fp32", False) for n in (3, 4, 5)
    }
    extra = _combine(at[3], at[4], 2.0)
    assert extra.parameters == at[5].parameters and extra.optimizer == at[5].optimizer
    for phase in ("forward", "backward"):
        a, w = sum(extra.phases[phase].values()), sum(at[5].phases[phase].values())
        assert abs(a - w) <= 0.02 * w, (phase, a, w)


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "bench,gpus,spec,says",
    [
        ("llama31_8b", 3, "tp=3", "layers.*.attn.qkv.weight"),
        ("gpt_oss_20b", 3, "ep=3,fsdp=3", "layers.0.ffn.experts.w1"),
    ],
)
def test_a_layout_that_cannot_be_built_fails_in_one_line(bench, gpus, spec, says):
    b, t = prepare.resolve_tier(bench, "tiny", [])
    t = dataclasses.replace(t, global_batch_size=gpus * 4, eval_samples=gpus * 4)
    with pytest.raises(UserError) as e:
        simulate(b, t, gpus, spec, precision="fp32")
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


if __name__ == "__main__":
    _measure_real(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
