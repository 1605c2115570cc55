"""`train/device.py`: the CPU allocator setting applies on glibc and defers to a user's own."""

import platform

from timetotrain.train import device


def test_keep_freed_memory_defers_to_user_allocator_settings(monkeypatch):
    for key in device._MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    assert device.keep_freed_memory() is (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert device.keep_freed_memory() is False
