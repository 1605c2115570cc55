"""`head_loss.linear_logprobs`, GRPO's per-token log-probabilities through the chunked head: equal to
`token_logprobs` of the materialised logits (today's path) in value and in the gradients wrt the hidden states
and the head weight, at any chunk size and temperature, without holding `[tokens, vocab]` logits."""

import pytest
import torch

from timetotrain.models.common.head_loss import linear_logprobs
from timetotrain.tasks.policy_gradient import token_logprobs


def _inputs(n=50, d=16, v=37, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    # A per-token incoming gradient, as GRPO's advantages and importance weights make it.
    up = torch.randn(n, generator=g, dtype=dtype)
    return h, w, y, up


def _value_and_grads(f, h, w, up):
    out = f(h, w)
    (out * up).sum().backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    return out.detach(), grads


def _whole(temperature):
    return lambda h, w, y: token_logprobs((h @ w.T).unsqueeze(0), y.unsqueeze(0), temperature)[0]


# Chunks of 7 and 16 rows leave a ragged last chunk of the 50; 50 is one chunk; 64 is more than the rows.
@pytest.mark.parametrize("rows", [7, 16, 50, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_values_and_gradients_equal_the_whole_logits_path(rows, temperature):
    h, w, y, up = _inputs()
    ref, (dh_ref, dw_ref) = _value_and_grads(lambda h, w: _whole(temperature)(h, w, y), h, w, up)
    got, (dh, dw) = _value_and_grads(lambda h, w: linear_logprobs(h, w, y, temperature, rows=rows), h, w, up)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-6)


def test_fp64_is_exact_to_rounding_and_batched_shapes_keep_their_shape():
    h, w, y, up = _inputs(n=24, dtype=torch.float64)
    h3, y3, up3 = h.view(2, 12, -1), y.view(2, 12), up.view(2, 12)
    # token_logprobs returns fp32; the same formula in fp64.
    ref, ref_grads = _value_and_grads(
        lambda h, w: (h.view(2, 12, -1) @ w.T / 0.8).log_softmax(-1).gather(-1, y3[..., None])[..., 0],
        h,
        w,
        up3,
    )
    got, got_grads = _value_and_grads(
        lambda h, w: linear_logprobs(h.view(2, 12, -1), w, y3, 0.8, 5), h, w, up3
    )
    assert got.shape == (2, 12) and h3.shape == (2, 12, 16)
    torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13)
    for a, b in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_temperature_zero_is_one_ignored_targets_are_zero_and_no_grad_keeps_nothing():
    h, w, y, _ = _inputs()
    torch.testing.assert_close(linear_logprobs(h, w, y, 0.0), linear_logprobs(h, w, y, 1.0), rtol=0, atol=0)
    y = y.clone()
    y[::4] = -100
    got = linear_logprobs(h, w, y, rows=8)
    assert (got[::4] == 0).all()
    keep = y != -100
    torch.testing.assert_close(got[keep], _whole(1.0)(h, w, y.clamp(min=0))[keep])
    got.sum().backward()
    assert (h.grad[::4] == 0).all()
    with torch.no_grad():
        assert not linear_logprobs(h, w, y).requires_grad
    with pytest.raises(ValueError, match="targets"):
        linear_logprobs(h, w, y[:-1])


def test_a_frozen_head_gets_no_gradient():
    h, w, y, up = _inputs()
    w.requires_grad_(False)
    (linear_logprobs(h, w, y, 1.3, rows=9) * up).sum().backward()
    assert w.grad is None and h.grad is not None


def test_bf16_autocast_is_as_accurate_as_the_upcast_logits_path():
    """Under bf16 autocast the chunks' logits are the bf16 GEMM's, upcast for the softmax, as
    `token_logprobs(head(h))` computes them: no less accurate than that path against an fp64 truth."""
    h, w, y, up = _inputs(n=64, d=32, v=200)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    truth, truth_grads = _value_and_grads(lambda h, w: _whole(0.9)(h, w, y), h64, w64, up.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_grads = _value_and_grads(lambda h, w: _whole(0.9)(h, w, y), h, w, up)
        got, got_grads = _value_and_grads(lambda h, w: linear_logprobs(h, w, y, 0.9, rows=16), h, w, up)
    assert got.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got_grads)

    def err(a, b):
        return (a.double() - b).abs().max().item()

    assert err(got, truth) <= 1.5 * err(ref, truth) + 1e-6
    for g, r, t in zip(got_grads, ref_grads, truth_grads, strict=True):
        assert 0 < err(g, t) <= 1.5 * err(r, t)


def test_what_autograd_keeps_is_the_hidden_states_not_the_logits():
    """Saved for the backward: the compute-dtype hidden states (here the input itself), the head weight (the
    parameter, no copy) and the targets; nothing of `[tokens, vocab]`."""
    T, d, V = 64, 32, 1000
    h = torch.randn(T, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    y = torch.randint(0, V, (T,))
    seen = []

    def pack(t):
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = linear_logprobs(h, w, y, 0.7)
    assert all(t.numel() < T * V for t in seen)
    assert [t.data_ptr() for t in seen if t.is_floating_point()] == [h.data_ptr(), w.data_ptr()]
    assert sum(t.numel() * t.element_size() for t in seen) == (T * d + V * d) * 4 + T * (8 + 1)
    out.sum().backward()
