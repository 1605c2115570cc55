"""The flux family's checkpoint interchange: our parameter names -> diffusers' `FluxTransformer2DModel`
tensors (the published FLUX.1 layout), for `train/checkpoint.load_hf_checkpoint`."""

from __future__ import annotations

import torch

from timetotrain.models.family import Source
from timetotrain.models.flux.config import FluxConfig


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def _swap_halves(ts: list[torch.Tensor]) -> torch.Tensor:
    # diffusers' AdaLayerNormContinuous yields (scale, shift); ours (and torchtitan's) (shift, scale).
    a, b = ts[0].chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def diffusers_mapping(cfg: FluxConfig) -> dict[str, Source]:
    """Our parameter name -> the diffusers `FluxTransformer2DModel` tensors it is made of (checkpoints without
    guidance embedding, patch_size 1 over our pre-patchified channels)."""
    m: dict[str, Source] = {}

    def lin(ours: str, theirs: str, combine=None, parts: tuple[str, ...] | None = None):
        for p in ("weight", "bias"):
            if parts is None:
                names = (f"{theirs}.{p}",)
                m[f"{ours}.{p}"] = Source(names, combine) if combine else Source(names)
            else:
                m[f"{ours}.{p}"] = Source(tuple(f"{theirs}.{x}.{p}" for x in parts), combine or _cat)

    lin("img_in", "x_embedder")
    lin("txt_in", "context_embedder")
    lin("time_in.fc1", "time_text_embed.timestep_embedder.linear_1")
    lin("time_in.fc2", "time_text_embed.timestep_embedder.linear_2")
    lin("vector_in.fc1", "time_text_embed.text_embedder.linear_1")
    lin("vector_in.fc2", "time_text_embed.text_embedder.linear_2")
    for i in range(cfg.n_double):
        o, t = f"layers.{i}", f"transformer_blocks.{i}"
        for s, mod, pre, ff, norm in (
            ("img", "norm1", "", "ff", ""),
            ("txt", "norm1_context", "add_", "ff_context", "added_"),
        ):
            lin(f"{o}.{s}.mod", f"{t}.{mod}.linear")
            qkv = (f"{pre}q_proj", f"{pre}k_proj", f"{pre}v_proj") if pre else ("to_q", "to_k", "to_v")
            lin(f"{o}.{s}.qkv", f"{t}.attn", parts=qkv)
            m[f"{o}.{s}.q_norm.weight"] = Source((f"{t}.attn.norm_{norm}q.weight",))
            m[f"{o}.{s}.k_norm.weight"] = Source((f"{t}.attn.norm_{norm}k.weight",))
            lin(f"{o}.{s}.proj", f"{t}.attn.to_add_out" if pre else f"{t}.attn.to_out.0")
            lin(f"{o}.{s}.fc1", f"{t}.{ff}.net.0.proj")
            lin(f"{o}.{s}.fc2", f"{t}.{ff}.net.2")
    for j in range(cfg.n_single):
        o, t = f"layers.{cfg.n_double + j}", f"single_transformer_blocks.{j}"
        lin(f"{o}.mod", f"{t}.norm.linear")
        for p in ("weight", "bias"):
            names = tuple(f"{t}.attn.to_{x}.{p}" for x in "qkv") + (f"{t}.proj_mlp.{p}",)
            m[f"{o}.linear1.{p}"] = Source(names, _cat)
        m[f"{o}.q_norm.weight"] = Source((f"{t}.attn.norm_q.weight",))
        m[f"{o}.k_norm.weight"] = Source((f"{t}.attn.norm_k.weight",))
        lin(f"{o}.linear2", f"{t}.proj_out")
    lin("final_mod", "norm_out.linear", combine=_swap_halves)
    lin("final_out", "proj_out")
    return m
