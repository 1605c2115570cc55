"""The decoder stack every LLM family here shares: token embedding -> N pre-norm blocks -> final RMSNorm
-> untied LM head, with RoPE tables as buffers. A family supplies its config and its blocks; parallelism,
activation checkpointing and compilation are applied from outside, per `Decoder.layers[i]`.

A block is `x + attn(attn_norm(x))`, then `h + ffn(ffn_norm(h))`, where `ffn` is a dense SwiGLU
(`layers.FeedForward`) or a mixture of experts (`moe.MoE`). A block's `window` (None or a width) selects
a sliding-window attention band for that layer.

The config is read by attribute: `dim`, `n_layers`, `head_dim`, `vocab_size`, `max_seq_len`, `norm_eps`,
`rope_theta`, `rope_scaling` (None for plain RoPE) and `init_std`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from timetotrain.models.common.layers import (
    Attention,
    NativeWindow,
    RMSNorm,
    band_blocks_mask,
    native_window_works,
    rope_tables,
    sliding_window_mask,
)
from timetotrain.models.common.sequence_shard import SequenceShard, check_length, head_loss


class Block(nn.Module):
    def __init__(self, dim: int, norm_eps: float, attn: nn.Module, ffn: nn.Module, window: int | None = None):
        super().__init__()
        self.window = window
        self.attn_norm = RMSNorm(dim, norm_eps)
        self.attn = attn
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.ffn = ffn

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return h + self.ffn(self.ffn_norm(h))

    def init_weights(self, normal, std: float, residual_std: float) -> None:
        self.attn.init_weights(normal, std, residual_std)
        self.ffn.init_weights(normal, std, residual_std)
        nn.init.ones_(self.attn_norm.weight)
        nn.init.ones_(self.ffn_norm.weight)


def check_attention_shape(n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """The constraints of grouped-query attention with RoPE, for a family's config `__post_init__`."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")


class Decoder(nn.Module):
    """Built initialised (`init_weights` with the global RNG); on the meta device nothing is computed.

    A family passes `make_ffn(layer)` (the block's FFN or MoE), and optionally `window_of(layer)` (a sliding
    window width or None), `qk_norm_eps` (per-head QK-norm in every layer) and `make_attn(layer)` (its own
    attention module, called as `attn(x, cos, sin, mask)`, instead of grouped-query `Attention`)."""

    def __init__(self, cfg, make_ffn, window_of=None, qk_norm_eps: float | None = None, make_attn=None):
        super().__init__()
        self._plain_attention = make_attn is None  # `Attention`, which takes a `NativeWindow`
        if make_attn is None:

            def make_attn(layer: int) -> nn.Module:
                return Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, qk_norm_eps)

        blocks = [
            Block(
                cfg.dim,
                cfg.norm_eps,
                make_attn(i),
                make_ffn(i),
                window=window_of(i) if window_of is not None else None,
            )
            for i in range(cfg.n_layers)
        ]
        self.cfg = cfg
        # nn.Embedding / nn.Linear (not bare Parameters) so module-swapping tools (float8, TP plans) find them.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Non-persistent: derived from the config, so checkpoints stay weights-only; `init_weights` and
        # `reset_rope` recompute them after a meta-device build + `to_empty`.
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        # One mask per (length, window, device), shared by the windowed layers and kept across steps.
        self._window_masks: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self.init_weights()

    def reset_rope(self) -> None:
        """Fill the RoPE tables; needed after `to_empty` when weights are loaded instead of initialised."""
        if self.rope_cos.is_meta:
            return
        c = self.cfg
        cos, sin = rope_tables(c.head_dim, c.rope_theta, c.max_seq_len, c.rope_scaling)
        with torch.no_grad():
            # Built on the CPU and copied, so every device gets bit-identical tables.
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def window_mask(
        self, seq_len: int, window: int | None, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor | NativeWindow | None:
        """The band mask of a windowed layer; None (the causal kernel) where the band is the whole triangle.

        Where torch's native windowed kernel runs and equals the mask path on this device for the attention
        dtype `dtype` (`layers.native_window_works`: CUDA, bf16/fp16), a `NativeWindow` instead: no mask,
        no repeated K/V. Elsewhere (CPUs, fp32) the masks below.

        From 4 windows on (and a whole number of them) the band is computed in blocks of W queries
        (`layers.windowed_attention`: O(T * 2W) instead of a masked T x T square); shorter sequences, where
        the square costs at most twice the blocks, keep the plain `[T, T]` mask."""
        if window is None or seq_len <= window + 1:
            return None
        c = self.cfg
        if self._plain_attention and native_window_works(device, dtype, c.n_heads, c.n_kv_heads, c.head_dim):
            return NativeWindow(window)
        key = (seq_len, window, device)
        if key not in self._window_masks:
            if seq_len >= 4 * window and seq_len % window == 0:
                mask = band_blocks_mask(seq_len // window, window, device)
            else:
                mask = sliding_window_mask(seq_len, window, device)
            self._window_masks[key] = mask
        return self._window_masks[key]

    def hidden(self, tokens: torch.Tensor, shard: SequenceShard | None = None) -> torch.Tensor:
        """Final-normed hidden states `[B, T, dim]`; lets a loss apply the head in chunks. Under a `shard`
        (context parallelism, `sequence_shard.py`) `tokens` are the whole sequences and the states this
        part's."""
        check_length(tokens, self.cfg.max_seq_len)
        tokens = tokens if shard is None else shard.local(tokens)
        return self.norm(self.blocks(self.embed(tokens), self.layers, shard))

    def blocks(self, x: torch.Tensor, layers, shard: SequenceShard | None = None) -> torch.Tensor:
        """Embedded tokens `x` `[B, T, dim]` through `layers` (all of `self.layers`, or a consecutive run of
        them: a pipeline stage's share), with the RoPE tables and window masks of length T (under a `shard`:
        the tables at its global positions, and its attention kernel)."""
        T = x.shape[1]
        if shard is None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        else:
            cos, sin = self.rope_cos[shard.positions], self.rope_sin[shard.positions]
        # The dtype attention computes in: autocast's where it is on, else the activations'.
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        for block in layers:
            if shard is None:
                mask = self.window_mask(T, block.window, x.device, dtype)
            else:
                mask = shard.attend(block.window)
            x = block(x, cos, sin, mask)
        return x

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        reduction: str = "mean",
        temperature: float = 1.0,
        shard: SequenceShard | None = None,
    ) -> torch.Tensor:
        """`tokens` `[B, T]` (int64) -> logits `[B, T, vocab_size]`; with `labels` `[B, T]` (-100 = ignored)
        -> their token cross-entropy instead, computed by `head_loss` without materialising the logits
        (`reduction="none"`: per token, of the logits / `temperature`). Under a `shard`: this part's share
        of the mean or sum (`sequence_shard.py`)."""
        return head_loss(self.hidden(tokens, shard), self.head, labels, reduction, shard, temperature)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Megatron-Core initialisation in place; also (re)computes the RoPE tables.

        N(0, init_std) for the embedding, the LM head and every matmul weight except the two that write into
        the residual stream (attention output, FFN/expert down projection), which get N(0, init_std /
        sqrt(2 * n_layers)); norm weights 1. Works on a model built on the meta device after `to_empty`.
        """
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)

        def normal(t: torch.Tensor, s: float) -> None:
            nn.init.normal_(t, mean=0.0, std=s, generator=generator)

        normal(self.embed.weight, std)
        for block in self.layers:
            block.init_weights(normal, std, residual_std)
        nn.init.ones_(self.norm.weight)
        normal(self.head.weight, std)
        self.reset_rope()
