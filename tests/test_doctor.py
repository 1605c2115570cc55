"""`ttt --version` and `ttt doctor`: in-process, the figures checked against their sources."""

import importlib.metadata as md
import platform

import pytest
import torch
from conftest import strict_loads

from timetotrain.cli import doctor, main
from timetotrain.train.peak import accelerator_peak


def test_version_is_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"ttt {md.version('timetotrain')}\n"


def test_doctor_json(capsys, monkeypatch):
    monkeypatch.setattr("timetotrain.train.peak.measure_cpu_peak", lambda: 123e9)
    assert main(["doctor", "--json"]) == 0
    env = strict_loads(capsys.readouterr().out)
    assert (env["python"], env["torch"], env["cuda_build"]) == (
        platform.python_version(),
        torch.__version__,
        torch.version.cuda,
    )
    assert env["mlperf_logging"] == md.version("mlperf-logging")
    cpu, *gpus = env["devices"]
    assert (cpu["device"], cpu["peak_measured_flops"]) == ("cpu", 123e9)
    assert cpu["peak_flops"] == max(123e9, cpu["peak_theoretical_flops"] or 0)  # the larger: see test_peak.py
    assert isinstance(cpu["host_busy"], bool) and "load average (1 min)" in cpu["load_note"]
    assert len(gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for g in gpus:  # the peak `ttt synth` divides by, or null with the reason
        known = accelerator_peak(g["name"])
        assert g["peak_flops"] == (known[0] if known else None)
    # The peers are the extras' distributions, read from the package's own metadata.
    assert "tensorboard" in env["optional_peers"] and "wandb" in env["optional_peers"]
    assert env["optional_peers"]["pytest"] == md.version("pytest")


def test_doctor_text_fits_one_screen(capsys, monkeypatch):
    monkeypatch.setattr("timetotrain.train.peak.measure_cpu_peak", lambda: 123e9)
    monkeypatch.setattr("timetotrain.train.peak.theoretical_cpu_peak", lambda cores: None)
    monkeypatch.setattr(doctor, "_dist_version", lambda name: None)  # as on a bare install
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 24
    assert f"torch           {torch.__version__}" in out and "peak 123.0 GFLOP/s" in out
    assert "mlperf-logging  MISSING" in out and "optional peers  none" in out
