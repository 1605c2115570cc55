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


def clamped_ids(layout: SequenceLayout) -> torch.Tensor:
    """[B, N]: each position clamped at its sequence's first candidate."""
    ids = torch.arange(layout.max_len, device=layout.lengths.device).view(1, -1)
    return torch.minimum(ids, (layout.lengths - layout.num_targets).view(-1, 1))


def _mask(ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """[B, end - start, end]: queries start..end-1 against keys 0..end-1 (ids are non-decreasing, so a key
    after its query is never attended: keys past `end` are left out)."""
    q, k = ids[:, start:end], ids[:, :end]
    eye = torch.arange(start, end, device=ids.device).view(-1, 1) == torch.arange(end, device=ids.device)
    return eye.unsqueeze(0) | (q.unsqueeze(2) > k.unsqueeze(1))


def valid_mask(layout: SequenceLayout) -> torch.Tensor:
    """[B, N, N] bool: which key each query attends."""
    return _mask(clamped_ids(layout), 0, layout.max_len)


class _BlockedAttention(torch.autograd.Function):
    """The same function by blocks of queries, each against the keys up to its last query, with nothing of
    size N x N kept for the backward (it recomputes each block's scores): memory B H block N instead of
    B H N N, and about half the attention matmuls (the causal upper triangle is skipped)."""

    @staticmethod
    def forward(ctx, q, k, v, ids, alpha: float, block: int):
        n = q.shape[2]
        out = v.new_empty(*v.shape[:2], n, v.shape[3])
        for s in range(0, n, block):
            e = min(s + block, n)
            a = F.silu(torch.matmul(q[:, :, s:e], k[:, :, :e].transpose(-1, -2)) * alpha) / n
            out[:, :, s:e] = torch.matmul(a * _mask(ids, s, e).unsqueeze(1), v[:, :, :e])
        ctx.save_for_backward(q, k, v, ids)
        ctx.alpha, ctx.block = alpha, block
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, ids = ctx.saved_tensors
        alpha, block, n = ctx.alpha, ctx.block, q.shape[2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for s in range(0, n, block):
            e = min(s + block, n)
            mask = _mask(ids, s, e).unsqueeze(1) / n
            x = torch.matmul(q[:, :, s:e], k[:, :, :e].transpose(-1, -2)) * alpha
            sig = torch.sigmoid(x)
            g = grad[:, :, s:e]
            dv[:, :, :e] += torch.matmul((x * sig * mask).transpose(-1, -2), g)
            dx = torch.matmul(g, v[:, :, :e].transpose(-1, -2)) * mask * (sig * (1 + x * (1 - sig))) * alpha
            dq[:, :, s:e] = torch.matmul(dx, k[:, :, :e])
            dk[:, :, :e] += torch.matmul(dx.transpose(-1, -2), q[:, :, s:e])
        return dq, dk, dv, None, None, None


def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, alpha: float, block: int = 0
) -> torch.Tensor:
    """q, k [T, H, A], v [T, H, V] jagged -> [T, H, V]. `block` 0: one pair of matmuls over the padded batch
    (the reference's PyTorch path); > 0: query blocks of that many positions (_BlockedAttention)."""
    pq, pk, pv = (layout.to_padded(x).transpose(1, 2) for x in (q, k, v))  # [B, H, N, .]
    if block > 0:
        out = _BlockedAttention.apply(pq, pk, pv, clamped_ids(layout), alpha, block)
        return layout.from_padded(out.transpose(1, 2))
    scores = torch.einsum("bhxa,bhya->bhxy", pq, pk) * alpha
    scores = F.silu(scores) / layout.max_len
    scores = scores * valid_mask(layout).unsqueeze(1)
    out = torch.einsum("bhxy,bhyv->bhxv", scores, pv)
    return layout.from_padded(out.transpose(1, 2))
