"""HSTU's pointwise attention over jagged sequences: SiLU(alpha Q K^T) / N instead of a softmax, causal and
target-aware, as the reference's PyTorch path computes it (ops/pytorch/pt_hstu_attention.py:130-188,
`pytorch_hstu_mha`; the Triton kernel the reference trains with computes the same function,
ops/triton/triton_hstu_attention.py:482-483).

N is the longest sequence of the batch (the kernels' MAX_SEQ_LEN, the padded length): the reference divides
by it, so one sample's output depends on the batch's longest sequence. Kept, to be the same function.

The mask (`_get_valid_attn_mask`, pt_hstu_attention.py:33-84, with contextual_seq_len = 0 and no max_attn_len,
as the reference's STU layers are built, modules/dlrm_hstu.py:240-264): positions are clamped at the first
candidate, id(t) = min(t, s - c), and t attends u when t == u or id(t) > id(u). So a history token attends
itself and the tokens before it; each candidate attends the whole history (contextual tokens included) and
itself, never another candidate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from timetotrain.models.hstu.jagged import SequenceLayout


def valid_mask(layout: SequenceLayout) -> torch.Tensor:
    """[B, N, N] bool: which key each query attends."""
    n = layout.max_len
    ids = torch.arange(n, device=layout.lengths.device).view(1, n)
    ids = torch.minimum(ids, (layout.lengths - layout.num_targets).view(-1, 1))
    dist = ids.unsqueeze(2) - ids.unsqueeze(1)
    return torch.eye(n, dtype=torch.bool, device=ids.device).unsqueeze(0) | (dist > 0)


def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, alpha: float
) -> torch.Tensor:
    """q, k [T, H, A], v [T, H, V] jagged -> [T, H, V]."""
    pq, pk, pv = (layout.to_padded(x).transpose(1, 2) for x in (q, k, v))  # [B, H, N, .]
    scores = torch.einsum("bhxa,bhya->bhxy", pq, pk) * alpha
    scores = F.silu(scores) / layout.max_len
    scores = scores * valid_mask(layout).unsqueeze(1)
    out = torch.einsum("bhxy,bhyv->bhxv", scores, pv)
    return layout.from_padded(out.transpose(1, 2))
