"""`models/common/fused.py`: hand-written backward passes equal autograd's on the unfused graph."""

import torch
import torch.nn.functional as F

from timetotrain.models.common.fused import qkv_rope, swiglu, weight_by_probs
from timetotrain.models.common.layers import apply_rope
from timetotrain.train.simulate import _Allocations


def test_qkv_rope_matches_split_and_apply_rope():
    B, T, n_kv, g, hd = 2, 5, 3, 2, 8
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, n_kv, g + 2, hd, generator=gen, dtype=torch.float64, requires_grad=True)
    ang = torch.rand(T, hd // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = ang.cos(), ang.sin()
    q_ref, k_ref, v_ref = qkv.split([g, 1, 1], dim=3)
    q_ref = apply_rope(q_ref.reshape(B, T, n_kv * g, hd), cos[:, None], sin[:, None])
    k_ref = apply_rope(k_ref.squeeze(3), cos[:, None], sin[:, None])
    v_ref = v_ref.squeeze(3)
    q, k, v = qkv_rope(qkv, cos, sin)
    for a, b in ((q, q_ref), (k, k_ref), (v, v_ref)):
        assert a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    weights = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (q, k, v)]
    (ref,) = torch.autograd.grad(
        sum((t * w).sum() for t, w in zip((q_ref, k_ref, v_ref), weights, strict=True)), qkv
    )
    (got,) = torch.autograd.grad(sum((t * w).sum() for t, w in zip((q, k, v), weights, strict=True)), qkv)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)


def test_swiglu_matches_silu_times_up():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 2 * 6, generator=gen, dtype=torch.float64, requires_grad=True)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = swiglu(x)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-14)
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    (g_got,) = torch.autograd.grad((got * w).sum(), x)
    torch.testing.assert_close(g_got, g_ref, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(swiglu, (x[:1, :2].detach().requires_grad_(),))


def _weighted(a, p):
    return (a * p.unsqueeze(-1)).to(a.dtype)  # autograd's graph of the same computation


def test_weight_by_probs_equals_autograd_bit_for_bit_in_bf16():
    gen = torch.Generator().manual_seed(2)
    a0 = torch.randn(300, 40, generator=gen).to(torch.bfloat16)
    p0 = torch.rand(300, generator=gen)
    g = torch.randn(300, 40, generator=gen).to(torch.bfloat16)
    out = {}
    for name, fn in (("ref", _weighted), ("got", weight_by_probs)):
        a, p = a0.clone().requires_grad_(), p0.clone().requires_grad_()
        y = fn(a, p)
        y.backward(g)
        out[name] = (y, a.grad, p.grad)
    for ref, got in zip(out["ref"], out["got"], strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got, ref)
    p64 = p0[:3].double().requires_grad_()
    assert torch.autograd.gradcheck(
        weight_by_probs, (torch.randn(3, 5, dtype=torch.float64, requires_grad=True), p64)
    )


def test_weight_by_probs_backward_holds_two_fp32_copies_at_most():
    # The reason it exists: autograd's backward of the same graph holds three fp32 [copies, f] tensors.
    a = torch.randn(4096, 256).to(torch.bfloat16).requires_grad_()
    p = torch.rand(4096, requires_grad=True)
    g = torch.randn(4096, 256).to(torch.bfloat16)
    fp32 = 4096 * 256 * 4
    peaks = {}
    for name, fn in (("ref", _weighted), ("got", weight_by_probs)):
        y = fn(a, p)
        with _Allocations(torch.device("cpu")) as seen:
            torch.autograd.grad(y, (a, p), g)
        peaks[name] = seen.peak
    assert peaks["ref"] >= 3 * fp32  # the graph's three fp32 tensors
    assert peaks["got"] <= 2.1 * fp32  # the shared cast-up gradient and one product (p's gradient beside)


def test_weight_by_probs_leaves_an_fp32_gradient_untouched():
    a = torch.randn(6, 4, requires_grad=True)
    p = torch.rand(6, requires_grad=True)
    g = torch.randn(6, 4)
    kept = g.clone()
    torch.autograd.grad(weight_by_probs(a, p), (a, p), g)
    assert torch.equal(g, kept)
