"""`models/common/fused.py`: hand-written backward passes equal autograd's on the unfused graph."""

import torch
import torch.nn.functional as F

from timetotrain.models.common.fused import qkv_rope, swiglu
from timetotrain.models.common.layers import apply_rope


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
