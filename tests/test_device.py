"""`train/device.py`: the CPU allocator setting applies on glibc and defers to a user's own; a tier's CPU
thread count applies unless OMP_NUM_THREADS chooses one."""

import platform

import pytest
import torch

from timetotrain.train import device, prepare


def test_keep_freed_memory_defers_to_user_allocator_settings(monkeypatch):
    for key in device._MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    assert device.keep_freed_memory() is (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert device.keep_freed_memory() is False


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("env", "want"), [(None, 1), ("2", 2)])
def test_a_tier_takes_its_cpu_thread_count_unless_the_user_chose_one(
    monkeypatch, capsys, tmp_path, threads_restored, env, want
):
    """qwen35_397b_grpo tiny runs on one thread (its RCP's); OMP_NUM_THREADS always wins, and a tier
    without a count keeps torch's."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if env is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    torch.set_num_threads(2)
    bench, tier = prepare.resolve_tier("qwen35_397b_grpo", "tiny", [])
    prep = prepare.preflight(bench, tier, tmp_path, None, "fp32", False, False, device="cpu")
    prepare.start_device(prep, "cpu", seed=1)
    assert torch.get_num_threads() == want
    note = capsys.readouterr().err
    assert ("1 CPU thread, the tiny tier's setting (OMP_NUM_THREADS chooses another)" in note) is (
        env is None
    )
    assert device.set_cpu_threads(None) is False  # no count: torch's own default stays
