"""The benchmark registry: name -> Benchmark, each loaded from its module in `timetotrain/suite/` by name.

This load by name is the one sanctioned upward path: the declarations (`suite/`) sit above the harness
(`train/`), the logs (`mlperf/`) and this folder, which reach a benchmark only through `get(name)`, never
by importing `suite`. Modules import lazily so `ttt list` stays fast.

Benchmarks outside the package (one in development, or a test's) are added by naming their modules in
the environment variable TTT_EXTRA_BENCHMARKS (comma-separated import paths, each defining `BENCHMARK`);
every `ttt` command then knows them, and `ttt list` shows those with `listed=True`.
"""

from __future__ import annotations

import importlib
import os

from timetotrain.errors import UserError

_MODULES = {
    "llama31_8b": "timetotrain.suite.llama31_8b",
    "gpt_oss_20b": "timetotrain.suite.gpt_oss_20b",
    "llama2_70b_lora": "timetotrain.suite.llama2_70b_lora",
    "deepseekv3_671b": "timetotrain.suite.deepseekv3_671b",
    "flux1": "timetotrain.suite.flux1",
    "llama31_405b": "timetotrain.suite.llama31_405b",
    "rgat": "timetotrain.suite.rgat",
    "dlrm_dcnv2": "timetotrain.suite.dlrm_dcnv2",
    "qwen35_397b_grpo": "timetotrain.suite.qwen35_397b_grpo",
    "dlrmv4": "timetotrain.suite.dlrmv4",
}
EXTRA_ENV = "TTT_EXTRA_BENCHMARKS"


def _extra() -> dict[str, object]:
    out = {}
    for path in filter(None, (p.strip() for p in os.environ.get(EXTRA_ENV, "").split(","))):
        try:
            bench = importlib.import_module(path).BENCHMARK
        except (ImportError, AttributeError) as e:
            raise UserError(
                f"{EXTRA_ENV}: {path!r} is not an importable module with a BENCHMARK ({e})"
            ) from e
        out[bench.name] = bench
    return out


def names(listed_only: bool = True) -> list[str]:
    extra = [n for n, b in _extra().items() if b.listed or not listed_only]
    return list(_MODULES) + extra


def get(name: str):
    if name in _MODULES:
        return importlib.import_module(_MODULES[name]).BENCHMARK
    extra = _extra()
    if name in extra:
        return extra[name]
    raise UserError(f"unknown benchmark {name!r}: choose one of {', '.join(names())} (see `ttt list`)")


def known(name: str) -> bool:
    return name in _MODULES or name in _extra()
