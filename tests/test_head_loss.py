"""`models/common/head_loss.py`: the chunked head + cross-entropy equals the materialised-logits path."""

import pytest
import torch
import torch.nn.functional as F

from timetotrain.models.common.head_loss import chunk_rows, linear_cross_entropy


def _inputs(n=50, d=16, v=37, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[::4] = -100  # EOD-masked positions
    return h, w, y


def _grads(loss, *xs):
    loss.backward()
    out = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    return out


@pytest.mark.parametrize("rows", [7, 16, 50, 64])  # a ragged last chunk, several chunks, one, more than n
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradients_match_cross_entropy(rows, reduction):
    h, w, y = _inputs()
    ref = F.cross_entropy(h @ w.T, y, reduction=reduction)
    dh_ref, dw_ref = _grads(ref * 1.7, h, w)  # a non-unit incoming gradient, as `loss / accum` gives
    got = linear_cross_entropy(h, w, y, reduction, rows=rows)
    dh, dw = _grads(got * 1.7, h, w)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-10, atol=1e-12)


def test_batched_shapes_and_frozen_weight():
    h, w, y = _inputs(n=24)
    w.requires_grad_(False)
    h3, y3 = h.view(2, 12, -1), y.view(2, 12)
    got = linear_cross_entropy(h3, w, y3, rows=5)
    (dh,) = _grads(got, h)
    ref = F.cross_entropy((h @ w.T), y)
    (dh_ref,) = _grads(ref, h)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(dh, dh_ref)
    assert w.grad is None


def test_no_grad_is_a_plain_loss_and_all_ignored_is_nan_like_pytorch():
    h, w, y = _inputs()
    with torch.no_grad():
        got = linear_cross_entropy(h, w, y, "sum", rows=8)
    assert not got.requires_grad
    torch.testing.assert_close(got, F.cross_entropy(h @ w.T, y, reduction="sum").detach())
    none = torch.full_like(y, -100)
    assert torch.isnan(linear_cross_entropy(h, w, none)) and torch.isnan(F.cross_entropy(h @ w.T, none))


def test_bf16_autocast_is_as_accurate_as_the_upcast_logits_path():
    h, w, y = _inputs(n=64, d=32, v=200, dtype=torch.float32)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    truth = F.cross_entropy(h64 @ w64.T, y)
    truth_grads = _grads(truth, h64, w64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((h @ w.T).float(), y)  # what the unfused bf16 step computes
        got = linear_cross_entropy(h, w, y, rows=16)
    ref_grads, got_grads = _grads(ref, h, w), _grads(got, h, w)
    assert got.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got_grads)

    def err(a, b):
        return (a.double() - b).abs().max().item()

    assert err(got, truth) <= 1.5 * err(ref, truth) + 1e-6
    for g, r, t in zip(got_grads, ref_grads, truth_grads, strict=True):
        assert 0 < err(g, t) <= 1.5 * err(r, t)  # bf16 error present, and no larger than the usual path's


def test_backward_twice_is_refused_and_bad_input_named():
    h, w, y = _inputs()
    loss = linear_cross_entropy(h, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, "none")
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, y[:-1])


def test_chunk_rows():
    # One rule on every device (what `ttt plan --simulate` relies on): 512 rows, at most 256 MiB of logits.
    assert chunk_rows(4096, 32_000) == 512
    assert chunk_rows(100, 32_000) == 100
    assert chunk_rows(8192, 1_000_000) == (256 << 20) // (4 * 1_000_000)
    assert chunk_rows(10**6, 10**9) == 16


@pytest.mark.parametrize("bench", ["llama31_8b", "gpt_oss_20b"])
def test_model_with_labels_gives_the_loss_of_its_logits_and_the_same_gradients(bench):
    """`model(tokens, labels=...)`, what every step and eval calls, equals cross-entropy of the model's logits."""
    from timetotrain.spec.registry import get

    b = get(bench)
    tier = b.tier("tiny")

    def model():
        torch.manual_seed(0)
        return b.family.build(tier.model).double()

    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, tier.model.vocab_size, (2, 33), generator=gen)
    labels = tokens[:, 1:].masked_fill(tokens[:, :-1] % 5 == 0, -100)
    a, m = model(), model()
    ref = F.cross_entropy(a(tokens[:, :-1]).flatten(0, 1), labels.flatten())
    got = m(tokens[:, :-1], labels=labels)
    ref.backward()
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    for (name, pa), pb in zip(a.named_parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-9, atol=1e-13, msg=name)
    with torch.no_grad():
        total = m(tokens[:, :-1], labels=labels, reduction="sum")
    torch.testing.assert_close(total, ref.detach() * (labels != -100).sum(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("rows", [16, 37])
def test_bf16_logits_path_equals_the_fp32_buffer_path(rows):
    """Under bf16 autocast on a CPU the bf16-logits path (the default) gives the loss, dh and dW of the
    fp32-buffer path it replaced (1e-5, fp32 comparison; bitwise here: the same arithmetic in the same
    order, and a CPU has no fp32-output bf16 GEMM, so dW accumulates as before)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(100, 32, generator=g)
    w = torch.randn(300, 32, generator=g) * 0.2
    y = torch.randint(0, 300, (100,), generator=g)
    y[::9] = -100
    out = []
    for lowp in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_cross_entropy(hh, ww, y, rows=rows, lowp=lowp)
        loss.backward()
        out.append((loss.detach(), hh.grad, ww.grad))
    for before, after in zip(*out, strict=True):
        torch.testing.assert_close(after.float(), before.float(), rtol=1e-5, atol=1e-5)


def test_softmax_xent_grad_matches_autograd():
    """The one-pass function: loss and in-place gradient equal F.cross_entropy's (sum) and its gradient."""
    from timetotrain.models.common.head_loss import softmax_xent_grad_

    g = torch.Generator().manual_seed(1)
    z = torch.randn(20, 50, generator=g, dtype=torch.float64)
    y = torch.randint(0, 50, (20,), generator=g)
    valid = torch.ones(20, dtype=torch.bool)
    valid[3] = False
    ref_z = z.clone().requires_grad_()
    ref = F.cross_entropy(ref_z, torch.where(valid, y, -100), reduction="sum")
    ref.backward()
    got = softmax_xent_grad_(z, y.unsqueeze(1), valid, grad=True)
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z, ref_z.grad.to(z.dtype), rtol=1e-6, atol=1e-6)
