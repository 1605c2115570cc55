"""Run seeds: their valid range, checked in preflight, and the seeds of a set of runs (`ttt run --runs`,
`ttt suite`). Kept free of torch: the CLI checks `--seed` with `--runs` before it blocks SIGTERM/SIGINT,
and importing torch first would start threads that do not inherit that block (train/abort.py)."""

from __future__ import annotations

import secrets

from timetotrain.errors import UserError

SEED_LIMIT = 2**32  # numpy's RandomState (the data shuffle) takes seeds in [0, 2**32)


def check_seed(seed: int | None, flag: str = "--seed") -> None:
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise UserError(f"{flag} {seed} is out of range: use an integer in [0, 2**32 - 1 = {SEED_LIMIT - 1}]")


def run_seeds(seed: int | None, runs: int) -> list[int]:
    """Distinct seeds for a set of runs: SEED, SEED+1, ... when given, else fresh random ones."""
    if seed is not None:
        check_seed(seed)
        check_seed(seed + runs - 1, f"--seed {seed} with --runs {runs}: the last seed")
        return [seed + i for i in range(runs)]
    seeds: list[int] = []
    while len(seeds) < runs:
        s = secrets.randbelow(2**31 - 1)
        if s not in seeds:
            seeds.append(s)
    return seeds
