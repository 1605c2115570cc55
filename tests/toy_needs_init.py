"""tests/toy_benchmark.py's benchmark as one whose tiers start from a checkpoint (`init_from`), for
tests/test_init_warning.py (TTT_EXTRA_BENCHMARKS=toy_needs_init, with tests/ on the path)."""

import dataclasses

from toy_benchmark import BENCHMARK as TOY

NEEDS = "a test checkpoint (toy safetensors)"
BENCHMARK = dataclasses.replace(TOY, init_from=NEEDS)
