"""What a decoder needs to compute on a part of each sequence (context parallelism), without knowing how
the parts are spread or exchanged: a `SequenceShard`, handed to `forward(..., shard=...)` from outside.

The model receives the WHOLE `[B, T]` tokens and labels (a few bytes per position) and keeps its own
positions (`local`): what is shifted along the sequence (DeepSeek's multi-token prediction: token i+k at
position i) is shifted in the global order first, so a chunk boundary is no boundary for it. RoPE reads
its tables at the global positions. Attention goes through `attend(window)`, the object a layer gets in
place of a mask: it computes this part's queries against the keys and values of the whole sequence
(`train/context_parallel.py` gathers them over the ranks that hold the sequence). Every loss term the
model returns is its SHARE of the one-process value: sums of this part's tokens divided by the
sequence-wide counts (`total`), so that the harness, summing the shares over the sequence's ranks, gets
exactly the value one process computes.

Nothing here communicates: `total` and `attend` are the harness's (`train/context_parallel.py`).
"""

from __future__ import annotations

import torch

from timetotrain.models.common.head_loss import linear_cross_entropy, logits_or_loss


class SequenceShard:
    """Which positions of each sequence this process computes, and how it reaches the rest."""

    positions: torch.Tensor  # [T_local] int64: the global positions of this part, in its order

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This part of a `[B, T, ...]` whole-sequence tensor."""
        return t.index_select(1, self.positions)

    def attend(self, window: int | None) -> ShardAttention:
        """The attention kernel of a layer with sliding `window` (None: the whole causal triangle)."""
        return ShardAttention(self, window)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float | None
    ) -> torch.Tensor:
        """Causal attention of this part's queries `[B, H, T_local, D]` against every key of the sequence
        (`k`/`v` `[B, H_kv, T_local, D]` are this part's: the implementation exchanges them); the band
        `p - window <= key <= p` by global position with `window`. Returns `[B, H, T_local, D_v]`."""
        raise NotImplementedError

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (counts, no gradient) summed over the parts of the sequence."""
        raise NotImplementedError


class ShardAttention:
    """What an attention layer gets instead of a mask under a `SequenceShard` (`layers.Attention`,
    DeepSeek's `LatentAttention`): call it with the layer's rotated q, k, v in `[B, heads, T, D]`."""

    def __init__(self, shard: SequenceShard, window: int | None):
        self.shard, self.window = shard, window

    def __call__(self, q, k, v, scale: float | None = None) -> torch.Tensor:
        return self.shard.attention(q, k, v, self.window, scale)


def rope_at(cos: torch.Tensor, sin: torch.Tensor, tokens: torch.Tensor, shard: SequenceShard | None):
    """(this part's tokens, the RoPE tables at their positions): the first `T` rows without a shard."""
    if shard is None:
        T = tokens.shape[1]
        return tokens, cos[:T], sin[:T]
    return shard.local(tokens), cos[shard.positions], sin[shard.positions]


def check_length(tokens: torch.Tensor, max_seq_len: int) -> None:
    if tokens.shape[1] > max_seq_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {max_seq_len}")


def labelled(labels: torch.Tensor) -> torch.Tensor:
    """The number of labelled positions of `labels` `[B, T]`: under a shard the whole sequences' too (every
    part holds the whole labels), so each part's share is exact however the labels spread."""
    return (labels != -100).sum()


def head_loss(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    labels: torch.Tensor | None,
    reduction: str,
    shard: SequenceShard | None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """`head_loss.logits_or_loss`; under a shard `labels` are the whole sequence's, and the loss is this
    part's share: its sum, divided by the sequence-wide count for "mean"; with `reduction="none"` this
    part's per-token values `[B, T_local]` in the shard's order (GRPO's log-probabilities, negated: the
    caller reaches the rest of the sequence through the shard). No logits."""
    if shard is None:
        return logits_or_loss(hidden, head, labels, reduction, temperature)
    if labels is None:
        raise NotImplementedError("a sharded sequence computes losses only (pass labels)")
    if reduction == "none":
        return logits_or_loss(hidden, head, shard.local(labels), reduction, temperature)
    total = linear_cross_entropy(hidden, head.weight, shard.local(labels), "sum")
    return total if reduction == "sum" else total / labelled(labels)
