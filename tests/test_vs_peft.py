"""bench/vs_peft.py compares like with like: from the same weights, adapters and batch, its two steps (ours
through `train_step`, PEFT's as the HF Trainer runs it) compute the same loss and leave the same adapters,
so its throughput ratio times the same work. No timing is checked."""

import importlib.util
import sys

import pytest
import torch
from conftest import REPO, require

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def vs_peft():
    require("transformers")
    require("peft")
    # As `python bench/vs_peft.py` does, its folder on the path for the helpers it shares with vs_hf.py.
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("vs_peft", REPO / "bench" / "vs_peft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers, via PEFT
@pytest.mark.parametrize("fused", [True, False], ids=["fused_qkv", "separate_qkv"])
def test_same_loss_and_adapters_on_the_tiny_config(vs_peft, fused):
    from timetotrain.models.llama.hf import qkv_to_hf

    # The bench's dropout (0.1) draws different masks on the two sides; the first step's loss does not
    # depend on it (B starts at zero), its gradients do: off here.
    b = vs_peft.build("tiny", "cpu", compile=False, fused=fused, dropout=0.0)
    assert b["adapters_ours"] == b["adapters_peft"]
    batch = b["batch"]
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
    torch.testing.assert_close(b["ours"](batch), b["peft"](batch), atol=1e-5, rtol=0)
    # After one AdamW step each B moved by about lr in the direction of its gradient's sign: a gradient of
    # the wrong row order, or of another loss, shows as entries 2 lr = 8e-4 apart.
    cfg = b["cfg"]
    for mine, layer in zip(
        b["ours_model"].layers, b["peft_model"].get_base_model().model.layers, strict=True
    ):
        ref, qkv = layer.self_attn, mine.attn.qkv
        if fused:  # one adapter on qkv_proj; its B in HF's q|k|v row order
            pairs = [
                (qkv_to_hf(qkv.lora_B.weight, cfg), ref.qkv_proj.lora_B["default"].weight),
                (qkv.lora_A.weight, ref.qkv_proj.lora_A["default"].weight),
            ]
            first_b = ref.qkv_proj.lora_B["default"].weight
        else:  # one adapter per part, already in HF's row order
            pairs = [
                (
                    getattr(qkv, f"lora_{m}")[p].weight,
                    getattr(getattr(ref, f"{p}_proj"), f"lora_{m}")["default"].weight,
                )
                for p in "qkv"
                for m in "AB"
            ]
            first_b = ref.q_proj.lora_B["default"].weight
        pairs += [
            (mine.attn.proj.lora_B.weight, ref.o_proj.lora_B["default"].weight),
            (mine.attn.proj.lora_A.weight, ref.o_proj.lora_A["default"].weight),
        ]
        # Separate: PEFT's three q/k/v matmuls and our one fused matmul round differently, and Adam's first
        # step (about lr · g / (|g| + eps)) turns the difference in a near-zero gradient entry into up to
        # about 2e-6 (one entry of 2,048 here); 1e-5, the parity tests' AdamW tolerance, still catches a wrong
        # row order or loss (2 lr = 8e-4).
        tol = 1e-6 if fused else 1e-5
        for ours, theirs in pairs:
            torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)
        moved = first_b.abs() > 3e-4  # ~lr: far above the tolerance
        assert moved.float().mean() > 0.9
