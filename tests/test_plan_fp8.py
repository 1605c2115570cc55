"""`ttt plan --precision fp8` (train/memory.py, `Fp8`): the float8 linears' copies against bf16, counted from
the config here independently of the meta-model count; activations unchanged because torchao saves each
float8 linear's high-precision input (checked against the bytes a real `Float8Linear` saves on CPU);
refusals in one line."""

import pytest
import torch
from conftest import strict_loads

from timetotrain.cli import main
from timetotrain.spec.registry import get
from timetotrain.train.memory import GiB, estimate, fp8_model, suggested_flags

BENCH = get("llama31_8b")
REF = BENCH.tier("reference")


def _block_linear_params(cfg) -> int:
    """qkv, proj, fc1 (gate and up), fc2 of one Llama block, from the config."""
    qkv = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * (cfg.dim // cfg.n_heads)
    return qkv + cfg.dim * cfg.dim + 2 * cfg.ffn_dim * cfg.dim + cfg.ffn_dim * cfg.dim


def test_fp8_copies_against_bf16():
    cfg = REF.model
    fp8 = fp8_model(BENCH, REF)
    per_block = _block_linear_params(cfg)
    assert (fp8.linear_params, fp8.blocks) == (cfg.n_layers * per_block, cfg.n_layers)
    n = BENCH.family.param_count(cfg)

    def row(kind, f8, gpus=8):
        return estimate(BENCH, REF, n, gpus, 80, kind, False, 1, True, fp8=f8)

    dp, dp8 = row("dp", None), row("dp", fp8)
    # One device / DDP: no autocast copy of the float8 linears; one block's float8 weights in flight.
    assert dp.compute_copies - dp8.compute_copies == pytest.approx(2 * fp8.linear_params - per_block)
    # FSDP2 tensorwise: the two unsharded blocks' linears gathered in float8 (1 B) instead of bf16 (2 B).
    fsdp, fsdp8 = row("fsdp", None), row("fsdp", fp8)
    assert fsdp.compute_copies - fsdp8.compute_copies == pytest.approx(2 * per_block)
    rowwise = fp8_model(BENCH, REF.__class__(**{**vars(REF), "fp8_recipe": "rowwise"}))
    assert row("fsdp", rowwise).compute_copies == pytest.approx(fsdp.compute_copies)  # bf16 gathers
    for a, b in ((dp, dp8), (fsdp, fsdp8)):
        assert (a.states, a.activations) == (b.states, b.activations)  # fp32 masters; bf16 activations
    assert "--precision fp8" in suggested_flags(fsdp8, True, fp8)
    assert suggested_flags(fsdp8, True, rowwise).endswith("--set fp8_recipe=rowwise")


def test_torchao_saves_the_high_precision_input():
    """The fact the activation count rests on: a float8 linear keeps its bf16 input (and its weight, a
    parameter) for the backward, as a bf16 linear does, not float8 copies."""
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        cfg = (
            Float8LinearConfig(emulate=True)
            if recipe == "tensorwise"
            else Float8LinearConfig.from_recipe_name(recipe)
        )
        lin = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False)), config=cfg)
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lin(x)
        w = lin[0].weight
        others = [t for t in saved if t.data_ptr() != w.data_ptr()]
        assert [(t.dtype, t.shape) for t in others] == [(torch.bfloat16, x.shape)], recipe


def test_plan_fp8_cli(capsys):
    assert main(["plan", "llama31_8b", "--gpus", "8", "--gpu-mem", "80", "--precision", "fp8", "--json",
                 "--set", "fp8_recipe=rowwise"]) == 0  # fmt: skip
    doc = strict_loads(capsys.readouterr().out)
    assert (doc["precision"], doc["fp8_recipe"]) == ("fp8", "rowwise")
    assert "--precision fp8" in doc["suggestion"]["run_flags"] and doc["fp8_linear_parameters"] > 6e9
    assert doc["rows"][0]["compute_copies_gib"] * GiB > 0
    for argv, says in (
        (["dlrm_dcnv2", "--precision", "fp8"], "--precision fp8: dlrm_dcnv2 has no block linears"),
        (["llama31_8b", "--set", "fp8_recipe=rowwise"], "applies to --precision fp8 only"),
        (["llama31_8b", "--precision", "fp8", "--set", "fp8_recipe=mxfp8"], "MXFP8 runs in one process"),
    ):
        assert main(["plan", *argv, "--gpus", "8", "--gpu-mem", "80"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
