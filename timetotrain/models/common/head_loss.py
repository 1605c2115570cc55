"""LM head and token cross-entropy fused, one chunk of tokens at a time, never holding the full logits.

The usual path writes `[tokens, vocab]` logits, an fp32 copy, their log-softmax and, in the backward, a
zero-filled gradient of the same size: four passes over an array that is 256 MB at the 20 M-parameter
bench config (2,048 tokens x 32k vocabulary) and 4 GB for one 8k-token Llama 3.1 micro-batch. On a CPU those
passes, and the page faults of allocating them afresh every step, cost a quarter of the step.

Here the forward walks the tokens in chunks whose logits fit in cache. For each chunk it computes the
logits, their log-sum-exp and the loss, then, since the gradient of cross-entropy is known in closed form
(`softmax - onehot`), it turns the same buffer into that gradient in place and multiplies it straight into
the gradients of the hidden states and of the head weight. The backward only scales them by the incoming
gradient. The matmul work is the same three products as the unfused head (logits, dX, dW); what goes away
is the memory traffic. Numerically it is the same loss and gradient; the test compares both to
`F.cross_entropy` on materialised logits.

The gradients are computed in the forward only when autograd will want them (grad mode on and an input
requiring grad); under `torch.no_grad()` (evaluation) it is a chunked loss and nothing else.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100

# Tokens per chunk. On a CPU the logits matmul needs about 512 rows to run near the matmul peak, and the
# in-place softmax over those rows then still runs from the last-level cache (measured with bench/vs_hf.py:
# the 20M config gains 4% from 128 to 512 rows and nothing beyond; the tiny tier is flat from 128 to 512).
# The same rule on every device: 512 rows of a 128k vocabulary are a 0.5 TFLOP matmul per chunk at d=4096,
# large enough for a GPU, and a device-independent size is what lets `ttt plan --simulate` (which runs the
# step on CPU fake tensors for a GPU) see the chunk the GPU run allocates. (Until 2026-12 a GPU took 1 GiB of
# fp32 logits per chunk; the smaller chunk is not yet measured on a GPU.)
_ROWS = 512
_MAX_BYTES = 256 << 20


def chunk_rows(n_tokens: int, vocab: int) -> int:
    """Tokens per chunk (see above), never more than `n_tokens` nor fewer than 16."""
    return max(16, min(n_tokens, _ROWS, _MAX_BYTES // (4 * vocab)))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    reduction: str = "mean",
    rows: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `labels`, as `F.cross_entropy(..., ignore_index=-100)`.

    `hidden` `[..., d]`, `weight` `[vocab, d]`, `labels` `[...]` (int64, -100 = ignored). `reduction`
    "mean" (over labelled tokens; NaN when there are none, as PyTorch) or "sum". Under autocast the matmuls
    run in the autocast dtype and the softmax in fp32, as `F.cross_entropy(logits.float(), ...)` would.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden rows but {y.shape[0]} labels")
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    rows = rows or chunk_rows(h.shape[0], weight.shape[0])
    grads = torch.is_grad_enabled()
    want = (grads and h.requires_grad, grads and weight.requires_grad)
    valid = y != IGNORE_INDEX
    total = _LinearCrossEntropy.apply(h, weight, y, valid, dtype, rows, want)
    if reduction == "sum":
        return total
    return total / valid.sum()


def logits_or_loss(
    hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor | None, reduction: str = "mean"
) -> torch.Tensor:
    """What a causal LM's `forward` returns from its final hidden states: the logits of `head` without
    `labels`; with them, the token cross-entropy computed here without materialising the logits."""
    if labels is None:
        return head(hidden)
    return linear_cross_entropy(hidden, head.weight, labels, reduction)


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """`out` (+)= `a @ b` without a temporary when dtypes agree; a bf16 product is summed into fp32 `out`."""
    if a.dtype != out.dtype:
        if first:
            out.copy_(a @ b)
        else:
            out.add_(a @ b)
    elif first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, y, valid, dtype, rows, want):
        want_dh, want_dw = want
        dev = h.device
        with torch.autocast(dev.type, enabled=False):
            x = h.to(dtype)
            w = weight.to(dtype)
            # The softmax runs in fp32 at least (fp64 stays fp64, which the exactness tests use).
            acc = torch.promote_types(dtype, torch.float32)
            target = torch.where(valid, y, 0).unsqueeze(1)
            total = torch.zeros((), dtype=acc, device=dev)
            dh = torch.empty_like(x) if want_dh else None
            dw = torch.empty(weight.shape, dtype=acc, device=dev) if want_dw else None
            # One logits buffer for every chunk: a fresh one per chunk costs page faults on a CPU.
            buf = torch.empty(min(rows, x.shape[0]), w.shape[0], dtype=acc, device=dev)
            for s in range(0, x.shape[0], rows):
                xs, ts, vs = x[s : s + rows], target[s : s + rows], valid[s : s + rows]
                z = buf[: xs.shape[0]]
                if dtype == acc:
                    torch.mm(xs, w.T, out=z)
                else:
                    z.copy_(xs @ w.T)
                # log-sum-exp by hand, in place, so that the buffer ends up holding exp(z - max).
                zmax = z.amax(dim=1, keepdim=True)
                z_target = z.gather(1, ts)
                sumexp = z.sub_(zmax).exp_().sum(dim=1, keepdim=True)
                lse = zmax + sumexp.log()
                total += torch.where(vs.unsqueeze(1), lse - z_target, 0.0).sum()
                if not (want_dh or want_dw):
                    continue
                # softmax - onehot on labelled rows, 0 on ignored ones.
                vf = vs.unsqueeze(1).to(z.dtype)
                g = z.mul_(vf / sumexp).scatter_add_(1, ts, vf.neg()).to(dtype)
                if want_dh:
                    torch.mm(g, w, out=dh[s : s + rows])
                if want_dw:
                    _add_product(dw, g.T, xs, first=s == 0)
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.used:
            raise RuntimeError("linear_cross_entropy: its backward can run only once (no retain_graph)")
        ctx.used = True
        dh, dw = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        # Scaled in place: these buffers are ours and become the gradients, with no further allocation.
        grad_h = None if dh is None else dh.mul_(grad_total).to(h_dtype)
        grad_w = None if dw is None else dw.mul_(grad_total).to(w_dtype)
        return grad_h, grad_w, None, None, None, None, None
