"""The native windowed-attention path (models/common/layers.py, `NativeWindow`): torch 2.13's `varlen_attn`
has no CPU kernel, so here it is replaced by a reference written from its documented semantics (per
sequence of `cu_seq`, query i sees keys i - left .. i + right; GQA maps head h to KV head h // (H / H_kv)).
Shown: on a CPU the decoder keeps the mask path (the golden tests' path); given a kernel with those
semantics, the native branch of a GPT-OSS model equals the mask path (loss and every gradient, 1e-5 fp32);
the on-device check accepts such a kernel and rejects one whose window is one key short. What only a GPU
shows (that torch's kernel has those semantics, and its speed) is `native_window_works` at run time and
bench/gpu_probe.py's `window` records."""

import pytest
import torch

from timetotrain.models.common import decoder, layers
from timetotrain.models.gpt_oss import GptOss, GptOssConfig, init_weights

CFG = GptOssConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4, top_k=2, expert_ffn_dim=24,
    vocab_size=97, max_seq_len=64, sliding_window=8, init_std=0.1,
)  # fmt: skip


def reference_varlen(shrink: int = 0):
    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False, scale=None):
        left, right = window_size
        assert right == 0 and (enable_gqa or q.shape[1] == k.shape[1])
        g = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            qs, ks, vs = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
            ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
            i = torch.arange(e - s).unsqueeze(1)
            j = torch.arange(e - s).unsqueeze(0)
            band = (j <= i + right) & (j >= i - (left - shrink))
            scores = (qs @ ks.transpose(-1, -2)) * (scale or qs.shape[-1] ** -0.5)
            p = scores.masked_fill(~band, float("-inf")).softmax(-1)
            out[s:e] = (p @ vs).transpose(0, 1)
        return out

    return varlen


def _grads(native: bool, monkeypatch):
    monkeypatch.setattr(decoder, "native_window_works", lambda *a: native)
    torch.manual_seed(0)
    model = GptOss(CFG)
    init_weights(model, torch.Generator().manual_seed(0))
    tokens = torch.randint(0, CFG.vocab_size, (3, 41), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_cpu_keeps_the_mask_path():
    assert not layers.native_window_works(torch.device("cpu"), torch.bfloat16, 4, 2, 8)
    model = GptOss(CFG)
    assert isinstance(model.window_mask(40, 8, torch.device("cpu"), torch.bfloat16), torch.Tensor)


def test_native_branch_equals_the_mask_path(monkeypatch):
    ref_loss, ref = _grads(False, monkeypatch)
    monkeypatch.setattr(layers, "_varlen_attn", lambda: reference_varlen())
    calls = []
    real = layers.native_windowed_attention
    monkeypatch.setattr(layers, "native_windowed_attention", lambda *a: calls.append(1) or real(*a))
    loss, got = _grads(True, monkeypatch)
    assert calls  # the windowed layer took the native branch
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.parametrize("shrink, ok", [(0, True), (1, False)], ids=["band", "one_key_short"])
def test_the_device_check_compares_against_the_mask(monkeypatch, shrink, ok):
    monkeypatch.setattr(layers, "_varlen_attn", lambda: reference_varlen(shrink))
    assert layers.window_kernel_agrees(torch.device("cpu"), torch.bfloat16, 4, 2, 8) is ok
