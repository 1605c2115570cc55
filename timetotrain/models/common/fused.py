"""Element-wise pieces of the decoder block with hand-written backward passes.

Written with plain PyTorch ops, so they run on every device, under autocast and under `torch.compile`.
What they save is memory traffic, which is what the element-wise part of a step costs: autograd's
generic backward of `split`/`chunk` is a `cat` (a full copy of the gradient), and its RoPE graph keeps
several intermediates. Here each gradient is written once, straight into its final buffer.

- `qkv_rope`: splits the fused QKV projection output (Megatron's grouped layout, see `llama.py`) into
  rotated q and k and plain v. The forward writes q and k rotated into fresh contiguous buffers (reading
  the strided slices directly, no reshape copy); the backward writes dq and dk rotated back, and dv, into
  one `dqkv` buffer. RoPE is a rotation, so its backward is the same rotation with `-sin`.
- `swiglu`: `silu(gate) * up` over the fused fc1 output `[..., 2 * ffn]`; the backward writes d(gate) and
  d(up) into one buffer of the input's shape (PyTorch's own fused `silu_backward` kernel does the silu part).
- `weight_by_probs`: an expert's activations `[copies, f]` times each copy's router probability, in the
  probabilities' dtype (fp32, as Megatron weighs them) and rounded back once. Autograd's graph of that
  (`(a * p[:, None]).to(a.dtype)`) holds three fp32 `[copies, f]` tensors at once in its backward (the
  gradient cast up, and one product for each input's gradient): at gpt_oss_20b's 65,536 routed copies a
  layer, 2.1 GiB at the start of the backward, the step's peak. This backward computes the same products
  and row sums in the same dtype (the same values), with at most two fp32 tensors alive and the same
  number of passes over memory (the cast-up gradient shared by both products, as autograd shares it).

All are tested against the unfused autograd graph for values and gradients.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """`out` = `x` rotated pairwise between its two halves: (x1 c - x2 s, x2 c + x1 s); `out` may be strided."""
    x1, x2 = x.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    if torch.compiler.is_compiling():
        # Dynamo breaks the graph at an `out=` into a strided view; compiled, the same products are copied
        # into the halves, which inductor fuses into the one kernel that writes them.
        o1.copy_(torch.addcmul(x1 * cos, x2, sin, value=-1))
        o2.copy_(torch.addcmul(x2 * cos, x1, sin))
        return
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)


class _QkvRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin):
        # qkv [B, T, n_kv, group + 2, hd]; cos/sin broadcast against [B, T, n_kv, heads, hd // 2].
        B, T, n_kv, g2, hd = qkv.shape
        g = g2 - 2
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
        q = qkv.new_empty(B, T, n_kv * g, hd)
        k = qkv.new_empty(B, T, n_kv, hd)
        _rotate(qkv[:, :, :, :g], cos, sin, q.view(B, T, n_kv, g, hd))
        _rotate(qkv[:, :, :, g], cos.squeeze(-2), sin.squeeze(-2), k)
        v = qkv[:, :, :, g + 1].contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.shape = qkv.shape
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        B, T, n_kv, g2, hd = ctx.shape
        g = g2 - 2
        dqkv = dq.new_empty(ctx.shape)
        _rotate(dq.view(B, T, n_kv, g, hd), cos, -sin, dqkv[:, :, :, :g])
        _rotate(dk, cos.squeeze(-2), -sin.squeeze(-2), dqkv[:, :, :, g])
        dqkv[:, :, :, g + 1].copy_(dv)
        return dqkv, None, None


def qkv_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv` `[B, T, n_kv, group + 2, hd]` (per KV group: `group` query heads, one key, one value head);
    `cos`/`sin` `[T, hd // 2]`. Returns q `[B, T, n_kv * group, hd]` and k `[B, T, n_kv, hd]` rotated, and v
    `[B, T, n_kv, hd]`, each contiguous."""
    return _QkvRope.apply(qkv, cos[:, None, None], sin[:, None, None])


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        if torch.compiler.is_compiling():  # no `out=` into the strided halves (a graph break): see `_rotate`
            dgate = torch.ops.aten.silu_backward(grad * up, gate)
            return torch.cat([dgate, grad * torch.nn.functional.silu(gate)], dim=-1)
        dx = torch.empty_like(x)
        dgate, dup = dx.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=dgate)
        torch.mul(grad, torch.nn.functional.silu(gate), out=dup)
        return dx


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x` = `[..., 2 * f]` holding gate then up; returns `[..., f]`."""
    return _SwiGLU.apply(x)


class _WeightByProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, probs):
        ctx.save_for_backward(a, probs)
        return (a * probs.unsqueeze(-1)).to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, probs = ctx.saved_tensors
        # The gradient in the probabilities' dtype once, shared by both products as autograd shares it; p's
        # product and row sum first, then a's product written over the shared copy.
        up = grad.to(probs.dtype)
        dp = (up * a).sum(dim=-1) if ctx.needs_input_grad[1] else None
        if ctx.needs_input_grad[0]:
            # Over the copy only: where the gradient is already in that dtype, `up` is autograd's own tensor.
            da = (up * probs.unsqueeze(-1) if up is grad else up.mul_(probs.unsqueeze(-1))).to(a.dtype)
        else:
            da = None
        return da, dp


def weight_by_probs(a: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """`a` `[copies, f]` times `probs` `[copies]` per row, computed in `probs`' dtype and returned in `a`'s."""
    return _WeightByProbs.apply(a, probs)
