"""The flux family's configuration: `FluxConfig` (its defaults are FLUX.1's sizes) and the shapes derived from it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FluxConfig:
    dim: int = 3072
    n_heads: int = 24
    n_double: int = 19
    n_single: int = 38
    mlp_ratio: float = 4.0
    latent_channels: int = 16
    patch: int = 2
    latent_size: int = 32  # latent height = width (256^2 images, VAE downsampling 8)
    txt_dim: int = 4096  # T5-XXL hidden size
    txt_len: int = 256  # T5 tokens per sample
    vec_dim: int = 768  # CLIP-L pooled output
    axes_dim: tuple[int, int, int] = (16, 56, 56)
    theta: float = 10000.0
    time_dim: int = 256  # sinusoidal timestep features
    eps: float = 1e-6  # LayerNorm and QK RMSNorm

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if sum(self.axes_dim) != self.head_dim or any(d % 2 for d in self.axes_dim):
            raise ValueError(f"axes_dim {self.axes_dim} must be even and sum to head_dim {self.head_dim}")
        if self.latent_size % self.patch:
            raise ValueError(f"latent_size {self.latent_size} is not a multiple of patch {self.patch}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def in_channels(self) -> int:
        return self.latent_channels * self.patch**2

    @property
    def grid(self) -> int:
        return self.latent_size // self.patch

    @property
    def img_len(self) -> int:
        return self.grid**2

    @property
    def mlp_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)

    @property
    def seq_len(self) -> int:
        return self.txt_len + self.img_len

    @property
    def n_layers(self) -> int:
        """Blocks in `model.layers`: the double-stream ones, then the single-stream ones."""
        return self.n_double + self.n_single
