"""Folders a user hands us are read only inside themselves.

A symlink (or an index entry naming `../x`) in a result tree, a checkpoint or an encoder folder could make
ttt copy, count or load a file from anywhere on the machine. Readers check each path with `check_inside`:
it must still lie under the folder once both are resolved (a link to another file of the same folder is
fine), else a one-line UserError names the path, where it leads and the folder."""

from __future__ import annotations

import os
from pathlib import Path

from timetotrain.errors import UserError


def outside(path: str | os.PathLike, root: str | os.PathLike) -> Path | None:
    """Where `path` resolves to, when that is not under the resolved `root`; None when it is."""
    target, top = Path(path).resolve(), Path(root).resolve()
    return None if target == top or top in target.parents else target


def check_inside(path: str | os.PathLike, root: str | os.PathLike, fix: str) -> None:
    target = outside(path, root)
    if target is not None:
        raise UserError(f"{path} resolves to {target}, outside {root}: refusing to read it; {fix}")
