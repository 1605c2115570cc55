import math

import pytest
import torch
import torch.nn.functional as F

from timetotrain.models.common.layers import sliding_window_mask
from timetotrain.models.common.moe import MoE, grouped_mm_supported
from timetotrain.models.common.moe import TopKRouter as Router
from timetotrain.models.gpt_oss import (
    GPT_OSS_20B,
    GptOss,
    active_param_count,
    flops_per_token,
    init_weights,
    param_count,
)
from timetotrain.models.gpt_oss import GptOssConfig as MoEConfig

# A window of 4 against 20-token sequences makes the band bite on every windowed layer.
TINY = MoEConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    n_experts=6,
    top_k=2,
    expert_ffn_dim=24,
    vocab_size=97,
    max_seq_len=32,
    sliding_window=4,
    init_std=0.1,
)

# Closed forms for GPT_OSS_20B (see the test below for the arithmetic).
GPT_OSS_20B_PARAMS = 20_488_418_112
GPT_OSS_20B_ACTIVE = 3_766_907_712


def moe_layer(cfg) -> MoE:
    """The MoE layer of a GPT-OSS block, on its own."""
    return MoE(
        Router(cfg.dim, cfg.n_experts, cfg.top_k), cfg.n_experts, cfg.top_k, cfg.dim, cfg.expert_ffn_dim
    )


# --- MoE layer: grouped vs a naive per-token reference -----------------------------------------------------


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts one by one, weights = softmax over the k selected logits."""
    f = moe.experts.w2.shape[2]
    out = []
    for t in range(x.shape[0]):
        logits = moe.router.weight @ x[t]
        top, ids = logits.topk(moe.top_k)
        weights = top.softmax(-1)
        acc = torch.zeros_like(x[t])
        for w, e in zip(weights, ids.tolist(), strict=True):
            w1 = moe.experts.w1[e]
            hidden = F.silu(w1[:f] @ x[t]) * (w1[f:] @ x[t])
            acc = acc + w * (moe.experts.w2[e] @ hidden)
        out.append(acc)
    return torch.stack(out)


def _uneven_moe(dtype: torch.dtype) -> tuple[MoE, torch.Tensor]:
    torch.manual_seed(0)
    moe = moe_layer(TINY).to(dtype)
    with torch.no_grad():
        for p in (moe.router.weight, moe.experts.w1, moe.experts.w2):
            p.normal_(0.0, 0.3)
        # Inputs with a positive mean and two expert rows pointing against it: experts 4 and 5 lose every
        # token, so the grouped path sees empty groups.
        moe.router.weight[4:] = -1.0
    x = (torch.randn(3, 8, TINY.dim, dtype=dtype) + 1.0).requires_grad_(True)
    return moe, x


def _check_parity(dtype: torch.dtype, use_grouped_mm: bool, tol: float) -> None:
    """Outputs and gradients within `tol`, relative elementwise and to each tensor's largest magnitude."""
    moe, x = _uneven_moe(dtype)
    moe.experts.use_grouped_mm = use_grouped_mm
    params = (moe.router.weight, moe.experts.w1, moe.experts.w2)
    grad_out = torch.randn_like(x)

    out = moe(x)
    grads = torch.autograd.grad(out, (x, *params), grad_out)
    counts = moe.tokens_per_expert
    assert counts[4:].tolist() == [0, 0] and (counts[:4] > 0).all(), counts

    ref = _naive_moe(moe, x.view(-1, TINY.dim)).view_as(x)
    ref_grads = torch.autograd.grad(ref, (x, *params), grad_out)

    names = ("output", "grad input", "grad router", "grad w1", "grad w2")
    for name, a, b in zip(names, (out, *grads), (ref, *ref_grads), strict=True):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale, msg=lambda m, n=name: f"{n}: {m}")
    # Experts without tokens get exactly zero gradient.
    assert grads[2][4:].abs().max() == 0 and grads[3][4:].abs().max() == 0


def test_loop_path_matches_naive_fp64():
    _check_parity(torch.float64, use_grouped_mm=False, tol=1e-12)


def test_grouped_mm_path_matches_naive_fp32():
    if not grouped_mm_supported(torch.device("cpu"), torch.float32, TINY.dim, TINY.expert_ffn_dim):
        pytest.skip("torch._grouped_mm is missing or does not run on CPU fp32 here; the loop path is tested")
    _check_parity(torch.float32, use_grouped_mm=True, tol=2e-6)


def test_grouped_mm_probe_rejects_fp64():
    # `_grouped_mm` takes only fp32/bf16/fp16, so fp64 must fall back to the loop without raising.
    assert not grouped_mm_supported(torch.device("cpu"), torch.float64, TINY.dim, TINY.expert_ffn_dim)


def test_expert_paths_agree_under_bf16_autocast():
    moe, x = _uneven_moe(torch.float32)
    outs = []
    for use in (False, True):
        if use and not grouped_mm_supported(
            torch.device("cpu"), torch.bfloat16, TINY.dim, TINY.expert_ffn_dim
        ):
            pytest.skip("torch._grouped_mm does not run on CPU bf16 here")
        moe.experts.use_grouped_mm = use
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(moe(x))
    assert outs[0].dtype == torch.bfloat16
    # Equal here, but the two paths may accumulate in different orders on other builds: bf16 tolerance.
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2 * outs[0].abs().max().item())


# --- router ------------------------------------------------------------------------------------------------


def test_router_topk_then_softmax():
    torch.manual_seed(1)
    router = Router(16, 8, 3)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(50, 16)
    probs, ids = router(x)
    logits = x @ router.weight.T
    top, expected_ids = logits.topk(3, dim=-1)
    assert torch.equal(ids.sort(-1).values, expected_ids.sort(-1).values)
    torch.testing.assert_close(probs.sum(-1), torch.ones(50))
    torch.testing.assert_close(probs, top.softmax(-1))
    # Not the pre-softmax variant: full-softmax probabilities of the selected experts sum to less than 1.
    assert (logits.softmax(-1).gather(1, ids).sum(-1) < 0.999).any()


def test_router_runs_in_fp32_under_autocast():
    torch.manual_seed(2)
    router = Router(16, 8, 2)
    torch.nn.init.normal_(router.weight)  # the module leaves it uninitialized (the family's init fills it)
    router = router.bfloat16()
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probs, _ = router(x)
    assert probs.dtype == torch.float32
    expected = (x.float() @ router.weight.float().T).topk(2, dim=-1).values.softmax(-1)
    torch.testing.assert_close(probs, expected)


# --- attention ---------------------------------------------------------------------------------------------


def _naive_attention(attn, x: torch.Tensor, theta: float, window: int | None) -> torch.Tensor:
    """Separate Q/K/V projections, per-head RMSNorm, RoPE by angle, a score loop per (head, position)."""
    B, T, d = x.shape
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    g = H // Hkv
    w = attn.qkv.weight.view(Hkv, g + 2, hd, d)
    q = (x @ w[:, :g].reshape(H * hd, d).T).view(B, T, H, hd)
    k = (x @ w[:, g].reshape(Hkv * hd, d).T).view(B, T, Hkv, hd)
    v = (x @ w[:, g + 1].reshape(Hkv * hd, d).T).view(B, T, Hkv, hd)

    def rms(t, weight):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    half = hd // 2
    freq = theta ** (-torch.arange(half, dtype=x.dtype) * 2 / hd)
    angle = torch.arange(T, dtype=x.dtype)[:, None, None] * freq
    cos, sin = angle.cos(), angle.sin()

    def rope(t):
        a, b = t[..., :half], t[..., half:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)

    q, k = rope(q), rope(k)
    out = torch.zeros(B, T, H, hd, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                lo = 0 if window is None else max(0, i - window)
                keys = k[b, lo : i + 1, h // g]
                p = (keys @ q[b, i, h] / math.sqrt(hd)).softmax(-1)
                out[b, i, h] = p @ v[b, lo : i + 1, h // g]
    return out.reshape(B, T, H * hd) @ attn.proj.weight.T


def _tiny_model(seed: int = 0) -> GptOss:
    torch.manual_seed(seed)
    model = GptOss(TINY).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # so a dropped or misplaced QK-norm shows up
    return model


def test_sliding_window_mask_band():
    m = sliding_window_mask(10, 3)
    for i in range(10):
        assert [j for j in range(10) if m[i, j]] == list(range(max(0, i - 3), i + 1))


@pytest.mark.parametrize("layer", [0, 1])
def test_attention_matches_naive(layer):
    model = _tiny_model()
    block = model.layers[layer]
    assert (block.window is not None) == (layer == 0)  # 1-indexed odd layers slide
    T = 20
    x = torch.randn(2, T, TINY.dim, dtype=torch.float64)
    cos, sin = model.rope_cos[:T].double(), model.rope_sin[:T].double()
    mask = model.window_mask(T, block.window, x.device)
    out = block.attn(x, cos, sin, mask)
    window = block.window
    ref = _naive_attention(block.attn, x, TINY.rope_theta, window)
    # fp64 inputs, but the model's RoPE tables and its norms (llama.RMSNorm upcasts to exactly fp32) are fp32
    # by design: ~1e-8 differences; a wrong band or layout would differ at ~1e-1.
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    if block.window is not None:
        # The band really changes the result (guards against a mask that is silently ignored).
        full = _naive_attention(block.attn, x, TINY.rope_theta, None)
        assert (out - full).abs().max() > 1e-6


def test_band_in_blocks_equals_the_masked_square():
    """From 4 windows on, windowed layers compute the band in blocks of W queries; same result as the full
    [T, T] mask (and the plain mask below 4 windows)."""
    from timetotrain.models.common.layers import band_blocks_mask, sliding_window_mask

    model = _tiny_model()
    attn = model.layers[0].attn
    T, W = 24, TINY.sliding_window
    assert model.window_mask(T, W, torch.device("cpu")).shape == (T // W, W, 2 * W)
    assert model.window_mask(12, W, torch.device("cpu")).shape == (12, 12)
    x = torch.randn(2, T, TINY.dim, dtype=torch.float64)
    cos, sin = model.rope_cos[:T].double(), model.rope_sin[:T].double()
    blocks = attn(x, cos, sin, band_blocks_mask(T // W, W))
    square = attn(x, cos, sin, sliding_window_mask(T, W))
    torch.testing.assert_close(blocks, square, rtol=1e-12, atol=1e-12)


def test_window_mask_cached_per_length():
    model = _tiny_model()
    assert model.window_mask(20, 4, torch.device("cpu")) is model.window_mask(20, 4, torch.device("cpu"))


# --- model, init, telemetry --------------------------------------------------------------------------------


def test_forward_backward_and_telemetry():
    model = _tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 20))
    logits = model(tokens)
    assert logits.shape == (2, 20, TINY.vocab_size)
    F.cross_entropy(logits.view(-1, TINY.vocab_size), tokens.view(-1)).backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    counts = model.tokens_per_expert()
    assert counts.shape == (TINY.n_layers, TINY.n_experts) and counts.dtype == torch.long
    assert counts.sum(1).tolist() == [2 * 20 * TINY.top_k] * TINY.n_layers


def test_init_statistics():
    cfg = MoEConfig(
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        n_experts=4,
        top_k=2,
        expert_ffn_dim=64,
        vocab_size=512,
        max_seq_len=16,
    )
    with torch.device("meta"):
        model = GptOss(cfg)
    model.to_empty(device="cpu")
    init_weights(model, torch.Generator().manual_seed(0))
    std, res = 0.008, 0.008 / math.sqrt(2 * cfg.n_layers)
    expect = {
        "embed.weight": std,
        "head.weight": std,
        "attn.qkv.weight": std,
        "ffn.router.weight": std,
        "ffn.experts.w1": std,
        "attn.proj.weight": res,
        "ffn.experts.w2": res,
    }
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        s = next(v for k, v in expect.items() if name.endswith(k))
        # Five standard errors: the mean's is s/sqrt(n), the sample std's about s/sqrt(2n).
        n = p.numel()
        assert abs(p.mean().item()) < 5 * s / math.sqrt(n), name
        assert p.std().item() == pytest.approx(s, rel=5 / math.sqrt(2 * n)), name
    assert model.rope_cos.isfinite().all() and model.tokens_per_expert().sum() == 0


def test_reference_param_counts_on_meta():
    with torch.device("meta"):
        model = GptOss(GPT_OSS_20B)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * GPT_OSS_20B.top_k // GPT_OSS_20B.n_experts
    assert total == param_count(GPT_OSS_20B) == GPT_OSS_20B_PARAMS
    assert active == active_param_count(GPT_OSS_20B) == GPT_OSS_20B_ACTIVE
    # 2 * 128,256 * 2880 embed + head; per layer QKV 2880*5120, out 4096*2880, router 2880*32,
    # experts 32 * 3 * 2880^2, norms 2*2880 + 2*64; final norm 2880.
    per_layer = 2880 * 5120 + 4096 * 2880 + 2880 * 32 + 32 * 3 * 2880**2 + 2 * 2880 + 2 * 64
    assert total == 24 * per_layer + 2 * 128_256 * 2880 + 2880
    assert [b.window is not None for b in model.layers] == [i % 2 == 0 for i in range(24)]


def test_flops_window_layers_count_the_band():
    cfg = GPT_OSS_20B
    # Below the window a windowed layer is a full causal layer.
    short = flops_per_token(cfg, 64)
    dense = 6 * (active_param_count(cfg) - cfg.vocab_size * cfg.dim - 24 * (2 * 2880 + 128) - 2880)
    assert short == pytest.approx(dense + 12 * 64 * 64 * 24 * 32)
    T = 8192
    full_layers = 12 * 64 * 64 * 12 * T / 2
    window_layers = 12 * 64 * 64 * 12 * (128 - 128**2 / (2 * T))
    assert flops_per_token(cfg, T) == pytest.approx(dense + full_layers + window_layers)
    assert flops_per_token(cfg, T, causal=False) == pytest.approx(dense + 12 * 64 * 64 * 12 * (T + 128))
