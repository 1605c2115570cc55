"""Where each token of a batch's jagged sequences sits.

Every sample's sequence is [contextual tokens | history events | candidates] (the reference's order:
ContextualPreprocessor prepends the contextual tokens to the merged history+candidates, modules/
preprocessors.py:283-318, merged at modules/dlrm_hstu.py main_forward). Per-token work (norms, projections,
MLPs) runs on the flat values [T, D], sample after sample, as the reference's jagged tensors do, so padding
costs nothing there; attention alone pads to [B, N, ...], N the longest sequence of the batch, as the
reference's PyTorch attention does (ops/pytorch/pt_hstu_attention.py `_pad_qkv`). Moving between the two is
one index_copy / index_select with `pad_index`, exact in both directions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _ranges(lengths: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Concatenated arange(starts[i], starts[i] + lengths[i])."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=lengths.device)
    first = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
    return first + torch.arange(total, device=lengths.device)


@dataclass(frozen=True)
class SequenceLayout:
    batch: int
    max_len: int  # N: the longest sequence (contextual + history + candidates) of the batch
    lengths: torch.Tensor  # [B] sequence lengths s_i
    num_targets: torch.Tensor  # [B] candidates c_i (the last c_i tokens of each sequence)
    contextual: int  # leading contextual tokens of every sequence
    merged_uih: (
        torch.Tensor
    )  # [T_u] where each history event sits among the merged (history+candidate) tokens
    merged_candidates: torch.Tensor  # [T_c] where each candidate sits there
    full_contextual: torch.Tensor  # [B * contextual] where each contextual token sits in the full sequence
    full_merged: torch.Tensor  # [T_u + T_c] where each merged token sits in the full sequence
    full_candidates: torch.Tensor  # [T_c] where each candidate sits in the full sequence
    pad_index: torch.Tensor  # [T] each token's row in the padded [B * N] layout
    sample: torch.Tensor  # [T] each token's sample
    position: torch.Tensor  # [T] each token's position in its sequence

    @property
    def tokens(self) -> int:
        return int(self.pad_index.shape[0])

    @staticmethod
    def build(uih_lengths: torch.Tensor, num_candidates: torch.Tensor, contextual: int) -> SequenceLayout:
        u, c = uih_lengths.long(), num_candidates.long()
        dev = u.device
        b = int(u.shape[0])
        merged_len = u + c
        merged_start = torch.cumsum(merged_len, 0) - merged_len
        seq_len = merged_len + contextual
        seq_start = torch.cumsum(seq_len, 0) - seq_len
        n = int(seq_len.max()) if b else 0
        arange_b = torch.arange(b, device=dev)
        ctx = torch.full((b,), contextual, dtype=torch.long, device=dev)
        full_contextual = _ranges(ctx, seq_start)
        full_merged = _ranges(merged_len, seq_start + contextual)
        sample = torch.repeat_interleave(arange_b, seq_len)
        position = torch.arange(int(seq_len.sum()), device=dev) - torch.repeat_interleave(seq_start, seq_len)
        merged_candidates = _ranges(c, merged_start + u)
        return SequenceLayout(
            batch=b,
            max_len=n,
            lengths=seq_len,
            num_targets=c,
            contextual=contextual,
            merged_uih=_ranges(u, merged_start),
            merged_candidates=merged_candidates,
            full_contextual=full_contextual,
            full_merged=full_merged,
            full_candidates=full_merged[merged_candidates],
            pad_index=sample * n + position,
            sample=sample,
            position=position,
        )

    def to_padded(self, values: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, N, ...], zeros past each sequence's end."""
        out = values.new_zeros((self.batch * self.max_len, *values.shape[1:]))
        return out.index_copy(0, self.pad_index, values).view(self.batch, self.max_len, *values.shape[1:])

    def from_padded(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, N, ...] -> [T, ...]."""
        return padded.reshape(self.batch * self.max_len, *padded.shape[2:]).index_select(0, self.pad_index)


def place(total: int, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A [total, ...] tensor with each part's rows at its index (the jagged concatenations of the reference,
    concat_2D_jagged)."""
    first = parts[0][1]
    out = first.new_zeros((total, *first.shape[1:]))
    for index, values in parts:
        out = out.index_copy(0, index, values)
    return out
