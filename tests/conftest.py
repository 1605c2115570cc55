"""Shared test helpers."""

import importlib
import os

import pytest


def require(name: str):
    """Import and return module `name`; skip the test when it is missing, except under CI=true where it fails.

    A laptop without the optional test peers should still run the rest of the suite, but CI must never
    turn a missing dependency into a silent pass.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        message = f"{name} is not importable ({exc})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; required under CI=true", pytrace=False)
        pytest.skip(f"{message}; install the test extras to run this test")
