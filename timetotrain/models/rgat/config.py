"""The rgat family's configuration: `RGATConfig`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RGATConfig:
    relations: tuple[tuple[str, str, str], ...]
    in_dim: int = 1024
    hidden: int = 512
    heads: int = 4
    n_layers: int = 3
    classes: int = 2983
    dropout: float = 0.2
    target_type: str = "paper"
