"""The valid range of a run seed, checked in preflight. Kept free of torch: the CLI checks `--seed` with
`--runs` before it blocks SIGTERM/SIGINT, and importing torch first would start threads that do not
inherit that block (train/abort.py)."""

from __future__ import annotations

from timetotrain.errors import UserError

SEED_LIMIT = 2**32  # numpy's RandomState (the data shuffle) takes seeds in [0, 2**32)


def check_seed(seed: int | None, flag: str = "--seed") -> None:
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise UserError(f"{flag} {seed} is out of range: use an integer in [0, 2**32 - 1 = {SEED_LIMIT - 1}]")
