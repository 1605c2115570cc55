"""`--precision fp8 --set fp8_recipe=mxfp8` (train/float8.py, torchao 0.18's MX training tensor) on a CPU,
where torchao emulates it: its linear's forward, input gradient and weight gradient equal an MXFP8
reference written here from the format (e4m3 elements, one power-of-two scale per 32 along the
contraction, RCEIL), a Llama and a GPT-OSS (experts through the grouped MXFP8 GEMM) train close to fp32,
only bias-free linears convert (torchao's MX linear drops a bias), and the refusals: a GPU below compute
capability 10.0 and any --parallel layout."""

import pytest
import torch
from conftest import small_llama

from timetotrain.errors import UserError
from timetotrain.models.gpt_oss import GptOss, GptOssConfig, init_weights
from timetotrain.spec.registry import get
from timetotrain.train import float8, parallel

pytest.importorskip("torchao.prototype.moe_training", reason="MXFP8 needs torchao >= 0.18")

CPU = torch.device("cpu")


def mx(recipe="mxfp8"):
    return parallel.Plan(precision="fp8", fp8_recipe=recipe, high="fp32")


def _mx_round(t: torch.Tensor) -> torch.Tensor:
    """MXFP8 quantize-dequantize along the last dim: scale 2^ceil(log2(amax / 448)) per 32 elements."""
    b = t.reshape(*t.shape[:-1], -1, 32)
    scale = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True) / 448.0)).clamp(min=-127))
    return ((b / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).reshape(t.shape)


@pytest.mark.parametrize("recipe", float8.MX_RECIPES)
def test_emulated_mxfp8_linear_equals_the_format(recipe):
    from torchao.quantization import quantize_

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g))
    w = lin.weight.detach().clone()
    quantize_(torch.nn.Sequential(lin), float8.mx_config(recipe, CPU), filter_fn=lambda m, _: m is lin)
    x = (3 * torch.randn(64, 64, generator=g)).requires_grad_()
    dy = torch.randn(64, 96, generator=g)
    y = lin(x)
    y.backward(dy)
    x0 = x.detach()
    torch.testing.assert_close(y, _mx_round(x0) @ _mx_round(w).T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, _mx_round(dy) @ _mx_round(w.T.contiguous()).T, rtol=1e-6, atol=1e-6)
    gw = (
        dy.T @ x0
        if recipe == "mxfp8_with_gw_hp"
        else _mx_round(dy.T.contiguous()) @ _mx_round(x0.T.contiguous()).T
    )
    torch.testing.assert_close(lin.weight.grad, gw, rtol=1e-5, atol=1e-4)


def _train(model, tokens, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = []
    for _ in range(steps):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_llama_trains_close_to_fp32_in_mxfp8():
    bench = get("llama31_8b")
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))  # 64 tokens
    losses = {}
    for name in ("fp32", "mxfp8"):
        model = bench.family.build(small_llama())
        bench.family.init(model, torch.Generator().manual_seed(0))
        if name != "fp32":
            parallel.apply(model, mx(), CPU, bench.family)
            assert float8.converted(model) == [
                f"layers.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "ffn.fc1", "ffn.fc2")
            ]
        losses[name] = _train(model, tokens)
    assert losses["mxfp8"][-1] < losses["mxfp8"][0]
    assert losses["mxfp8"] == pytest.approx(losses["fp32"], abs=0.03) and losses["mxfp8"] != losses["fp32"]


def test_gpt_oss_experts_train_in_mxfp8_on_cpu():
    """The grouped MXFP8 GEMM (emulated) runs here, unlike float8's `torch._scaled_grouped_mm`: MoE models
    are not refused under the MX recipes."""
    cfg = GptOssConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4, top_k=2, expert_ffn_dim=32,
        vocab_size=97, max_seq_len=64, sliding_window=8, init_std=0.05,
    )  # fmt: skip
    float8.check_model(cfg, CPU, "mxfp8")
    tokens = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name in ("fp32", "mxfp8"):
        torch.manual_seed(0)
        model = GptOss(cfg)
        init_weights(model, torch.Generator().manual_seed(0))
        if name != "fp32":
            parallel.apply(model, mx(), CPU, get("gpt_oss_20b").family)
            w1 = model.layers[0].ffn.experts.w1
            assert type(w1.data).__name__ == "MXFP8TrainingWeightWrapperTensor"
        losses[name] = _train(model, tokens)
    assert losses["mxfp8"][-1] < losses["mxfp8"][0]
    assert losses["mxfp8"] == pytest.approx(losses["fp32"], abs=0.05) and losses["mxfp8"] != losses["fp32"]


def test_only_bias_free_whole_block_linears_convert():
    assert float8.mx_converts(torch.nn.Linear(64, 32, bias=False), "layers.0.fc")
    assert not float8.mx_converts(torch.nn.Linear(64, 32, bias=True), "layers.0.fc")  # torchao drops it
    assert not float8.mx_converts(torch.nn.Linear(48, 32, bias=False), "layers.0.fc")  # 48 % 32
    assert float8.converts(torch.nn.Linear(48, 32, bias=True), "layers.0.fc")  # float8 takes both


def test_refusals(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    with pytest.raises(UserError, match=r"H200 \(compute capability 9.0\) has no MXFP8 GEMMs.*10.0\+"):
        float8.check_device(torch.device("cuda", 0), "mxfp8")
    float8.check_device(torch.device("cuda", 0), "tensorwise")  # float8 itself runs on sm90
    float8.check_device(CPU, "mxfp8")  # emulated
    with pytest.raises(UserError, match="MXFP8 runs in one process"):
        float8.check_mx_parallel("mxfp8", "fsdp=2")
    float8.check_mx_parallel("rowwise", "fsdp=2")
