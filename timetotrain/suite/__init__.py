"""The benchmark registry: name -> Benchmark. Modules import lazily so `ttt list` stays fast."""

from __future__ import annotations

import importlib

from timetotrain.errors import UserError

_MODULES = {
    "llama31_8b": "timetotrain.suite.llama31_8b",
    "gpt_oss_20b": "timetotrain.suite.gpt_oss_20b",
}


def names() -> list[str]:
    return list(_MODULES)


def get(name: str):
    if name not in _MODULES:
        raise UserError(f"unknown benchmark {name!r}: choose one of {', '.join(_MODULES)} (see `ttt list`)")
    return importlib.import_module(_MODULES[name]).BENCHMARK
