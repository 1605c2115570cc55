"""`--precision fp8` (train/float8.py) on one process: which linears become float8 (the block linears of the
LLM families, LoRA's frozen bases but not its adapters, flux1's blocks; never the head, the embedding or
the router), that a float8 step trains, that the emulated tensorwise GEMM and CPU `torch._scaled_mm` agree,
what the MLPerf log states (only values the official 6.x rule files accept), and the refusals: a GPU
without float8 GEMMs and a device without a grouped float8 GEMM for MoE experts."""

import dataclasses
import re

import pytest
import torch
import yaml
from conftest import small_llama

from timetotrain.errors import UserError
from timetotrain.mlperf.compliance import official_rules_dir
from timetotrain.mlperf.keys import parallel_keys
from timetotrain.spec.registry import get
from timetotrain.train import float8, parallel

pytest.importorskip("torchao", reason="--precision fp8 needs torchao (the fp8 / test extras)")

CPU = torch.device("cpu")


def fp8(recipe="tensorwise", **kw):
    return parallel.Plan(precision="fp8", fp8_recipe=recipe, high="fp32", **kw)


def llama():
    bench = get("llama31_8b")
    model = bench.family.build(small_llama())
    bench.family.init(model, torch.Generator().manual_seed(0))
    return bench, model


def test_block_linears_become_float8_and_nothing_else():
    _, model = llama()
    parallel.apply(model, fp8(), CPU, get("llama31_8b").family)
    names = float8.converted(model)
    assert names == [
        f"layers.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "ffn.fc1", "ffn.fc2")
    ]
    assert type(model.head) is torch.nn.Linear and type(model.embed) is torch.nn.Embedding


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_step_trains_close_to_fp32(recipe):
    """Same init, same batch: the float8 loss follows fp32's to float8's rounding (a few 1e-3)."""
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name in ("fp32", recipe):
        _, model = llama()
        if name != "fp32":
            parallel.apply(model, fp8(recipe), CPU, get("llama31_8b").family)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        out = []
        for _ in range(2):
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[name] = out
    assert losses[recipe][-1] < losses[recipe][0]
    assert losses[recipe] == pytest.approx(losses["fp32"], abs=0.03)
    assert losses[recipe] != losses["fp32"]  # float8 did run


def test_emulated_tensorwise_equals_the_real_cpu_kernel():
    """The CPU's tensorwise path (emulated: train/float8.linear_config) rounds and scales exactly as
    `torch._scaled_mm`; shown at a size the real CPU kernel handles in well under a second."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    outs = []
    for emulate in (True, False):
        lin = torch.nn.Linear(32, 16, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)))
        m = convert_to_float8_training(torch.nn.Sequential(lin), config=Float8LinearConfig(emulate=emulate))
        y = m(x)
        (gx,) = torch.autograd.grad(y.square().sum(), x)
        outs.append((y.detach(), gx))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


def test_lora_converts_the_frozen_base_not_the_adapters():
    bench = get("llama2_70b_lora")
    tier = bench.tier("tiny")
    model = bench.family.build(tier.model)
    bench.family.init(model, torch.Generator().manual_seed(0))
    bench.task.adapt_model(model, tier, torch.Generator().manual_seed(2), "fp32")
    parallel.apply(model, fp8(), CPU, bench.family)
    names = float8.converted(model)
    # The adapted bases and the untargeted (equally frozen) linears; never an adapter.
    assert any(n.endswith(".base") for n in names) and not any("lora_" in n for n in names)
    modules = dict(model.named_modules())
    assert not any(modules[n].weight.requires_grad for n in names)
    tokens = torch.randint(0, tier.model.vocab_size, (1, 65), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)


def test_flux_converts_its_block_linears():
    bench = get("flux1")
    tier = bench.tier("tiny")
    model = bench.family.build(tier.model)
    parallel.apply(model, fp8(), CPU, bench.family)
    names = float8.converted(model)
    assert names and all(n.startswith("layers.") for n in names)


def test_the_log_states_precisions_the_official_rules_accept():
    rules = yaml.safe_load((official_rules_dir() / "training_6.1.0" / "common.yaml").read_text())
    accepted = {}
    for rule in rules:
        key = rule.get("KEY", {})
        if key.get("NAME", "").startswith("lowest_numerical_precision"):
            accepted[key["NAME"]] = set(re.findall(r"'([^']+)'", key["CHECK"]))
    assert len(accepted) == 3
    cases = {
        fp8(): ("fp8", "fp32", "fp32"),
        fp8(fsdp=2): ("fp8", "fp32", "fp8"),  # tensorwise: float8 all-gathers
        dataclasses.replace(fp8("rowwise", fsdp=2), high="bf16"): ("fp8", "bfloat16", "bfloat16"),
        fp8(tp=2): ("fp8", "fp32", "fp32"),
        parallel.Plan(precision="bf16", fsdp=2): ("bfloat16", "bfloat16", "bfloat16"),
    }
    for plan, want in cases.items():
        logged = dict(parallel_keys(plan, 1))
        got = tuple(logged[f"lowest_numerical_precision_in_{k}"] for k in ("linear", "attn", "comm"))
        assert got == want, plan
        for name, value in zip(("linear", "attn", "comm"), got, strict=True):
            assert value in accepted[f"lowest_numerical_precision_in_{name}"]


def test_a_gpu_without_float8_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(UserError, match=r"A100 \(compute capability 8.0\) has no float8 GEMMs.*bf16"):
        float8.check_device(torch.device("cuda", 0))
    float8.check_device(CPU)  # the CPU has `torch._scaled_mm`


def test_moe_experts_without_a_grouped_float8_gemm_are_refused():
    bench = get("gpt_oss_20b")
    tier = bench.tier("tiny")
    assert not float8.grouped_float8_works(CPU)
    with pytest.raises(UserError, match="_scaled_grouped_mm"):
        float8.check_model(tier.model, CPU)
    with torch.device("meta"):
        model = bench.family.build(tier.model)
    with pytest.raises(UserError, match="_scaled_grouped_mm"):
        float8.convert(model, "tensorwise", False, CPU)


def test_sdpa_priority_setting(monkeypatch):
    """TTT_SDPA_PRIORITY (train/sdpa.py): an order of backend names, the unnamed ones kept after them; a bad
    name is one line; on a CPU it changes nothing."""
    from torch.nn.attention import SDPBackend

    from timetotrain.train import sdpa

    assert sdpa.order(None) is None
    got = sdpa.order("cudnn,flash")
    assert got[:2] == (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION) and len(got) == 4
    with pytest.raises(UserError, match="TTT_SDPA_PRIORITY='fast'"):
        sdpa.order("fast")
    monkeypatch.setenv(sdpa.ENV, "cudnn")
    q = torch.randn(1, 2, 8, 4)
    with sdpa.priority("cpu"):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.shape == q.shape
