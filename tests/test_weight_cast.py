"""`models/common/weight_cast.py`: inside a training step the MoE experts' stacked weights (which autocast's
cache does not see: `torch._grouped_mm` is not an autocast op) are cast to bf16 once per step, not once per
micro-batch. The loss and every gradient equal the per-micro-batch path it replaces at 1e-5 (bitwise on
this CPU), on both expert paths (grouped GEMM and the per-expert loop)."""

import pytest
import torch

from timetotrain.models.common import weight_cast
from timetotrain.models.gpt_oss import GptOss, GptOssConfig, init_weights
from timetotrain.train.step import train_step

CFG = GptOssConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=8, top_k=2, expert_ffn_dim=24,
    vocab_size=97, max_seq_len=32, sliding_window=4, init_std=0.1,
)  # fmt: skip


def _model(grouped: bool) -> GptOss:
    torch.manual_seed(0)
    m = GptOss(CFG)
    init_weights(m, torch.Generator().manual_seed(0))
    for layer in m.layers:
        layer.ffn.experts.use_grouped_mm = grouped
    return m


def _loss(model, mb):
    t = mb["tokens"]
    return model(t[:, :-1], labels=t[:, 1:])


def _step_grads(model, tokens, accum):
    grads = {}

    class Capture(torch.optim.SGD):  # the step's gradients, before train_step zeroes them
        def step(self, closure=None):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})

    opt = Capture(model.parameters(), lr=0.0)
    loss = train_step(
        model, opt, {"tokens": tokens}, accum, _loss, None, list(model.parameters()), torch.bfloat16
    )
    return loss, grads


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_experts_cast_once_per_step_equal_per_micro_batch(grouped, monkeypatch):
    tokens = torch.randint(0, CFG.vocab_size, (8, 17), generator=torch.Generator().manual_seed(1))
    ref = _model(grouped)
    ref_loss = 0.0
    for mb in tokens.chunk(4):  # the replaced path: a context per micro-batch, no weight cache
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(ref, {"tokens": mb}) / 4
        loss.backward()
        ref_loss += loss.detach()

    casts = []
    real = weight_cast.cast

    def counting(w, dtype):
        out = real(w, dtype)
        casts.append(out)
        return out

    monkeypatch.setattr(weight_cast, "cast", counting)
    model = _model(grouped)
    loss, grads = _step_grads(model, tokens, 4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)
    # 2 layers x (w1, w2) x 4 micro-batches asked; 4 distinct copies made (one per weight per step).
    assert len(casts) == 16 and len({id(c) for c in casts}) == 4


def test_cache_rules():
    w = torch.nn.Parameter(torch.randn(3, 4))
    assert weight_cast.cast(w, torch.bfloat16) is not weight_cast.cast(w, torch.bfloat16)  # no context
    with weight_cast.cached():
        a = weight_cast.cast(w, torch.bfloat16)
        assert weight_cast.cast(w, torch.bfloat16) is a
        with weight_cast.cached():  # nested: the same cache
            assert weight_cast.cast(w, torch.bfloat16) is a
        with torch.no_grad():
            w.add_(1.0)  # an in-place update (an optimizer step) invalidates the copy
        b = weight_cast.cast(w, torch.bfloat16)
        assert b is not a and torch.equal(b, w.detach().to(torch.bfloat16))
        with torch.no_grad():  # no grad mode: never cached (a copy without a graph must not be reused)
            assert weight_cast.cast(w, torch.bfloat16) is not weight_cast.cast(w, torch.bfloat16)
        view = w[0]
        assert weight_cast.cast(view, torch.bfloat16) is not weight_cast.cast(view, torch.bfloat16)
    assert not weight_cast.active()
