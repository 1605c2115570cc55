"""The vocabulary table of a base that narrows its vocabulary (`ttt base`, `train/base_model.py`): raw
token id -> model id, kept ids first and one "other" id for the rest (built by `loader.vocab_table`).
Read here, in data/, because the tasks that load such a base map their token ids through it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from timetotrain.errors import UserError

VOCAB_TABLE = "vocab_table.npy"


def load_vocab_table(folder: Path, keep: int) -> torch.Tensor:
    """The base's raw id -> model id table, checked to map into `keep` kept ids plus one "other" id."""
    path = Path(folder) / VOCAB_TABLE
    if not path.is_file():
        raise UserError(
            f"--init-checkpoint {folder} has no {VOCAB_TABLE}: this tier narrows the vocabulary as its base "
            "did; pass the folder `ttt base` wrote"
        )
    try:
        table = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # an object array (pickled) is refused, never unpickled
        raise UserError(
            f"{path} is not a numeric .npy table ({e}); pass the folder `ttt base` wrote"
        ) from None
    if table.ndim != 1 or table.min() < 0 or table.max() != keep:
        raise UserError(
            f"{path} maps ids into [0, {int(table.max())}], this tier keeps {keep} ids plus one other: "
            "the base was made for another tier"
        )
    return torch.from_numpy(table.astype(np.int64))
