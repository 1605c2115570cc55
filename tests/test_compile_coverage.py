"""`--compile` coverage per model family (issue 26; bench/compile_coverage.py, docs/precision.md).

The graph-break counts are pinned from `torch._dynamo.explain` of every kind of block at the tiny configs,
so that a change which breaks a compiled block into pieces fails here. Each expected break is explained;
everything else compiles to one graph per block. And compiled blocks compute what eager ones do: loss and
every gradient at 1e-5 in fp32 (`aot_eager`: Dynamo and AOTAutograd trace the same code paths inductor
would get, without its C++ compile time).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "compile_coverage.py"


def coverage_module():
    spec = importlib.util.spec_from_file_location("compile_coverage", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compile_coverage", mod)
    spec.loader.exec_module(mod)
    return mod


cc = coverage_module()

# The data-dependent read of the expert loop: `counts.tolist()` (fakes.host_sizes) gives the split sizes.
# It is the one break in a fp32 MoE block, counted once per frame on the stack it breaks (Block.forward,
# MoE.forward, GroupedExperts.forward, _experts_loop: 4 breaks, 5 graphs). Compiled fp32 takes the loop
# because torch 2.13's `_grouped_mm` meta kernel (what Dynamo traces with) takes bf16 only, although this
# CPU build's kernel runs fp32 (experts.grouped_mm_compiles asks both); under bf16 the grouped GEMM with
# device-side offsets traces, with no host sync.
LOOP_SPLIT = "Data dependent operator at fakes.py"
ONE = (1, 0, [])  # one graph, no break
LOOP = (5, 4, [LOOP_SPLIT])

EXPECTED = {
    ("llama31_8b", "bf16"): {"Block/Attention/FeedForward": ONE},
    ("gpt_oss_20b", "bf16"): {"Block/Attention/MoE/window 128": ONE, "Block/Attention/MoE": ONE},
    ("deepseekv3_671b", "bf16"): {"Block/LatentAttention/FeedForward": ONE, "Block/LatentAttention/MoE": ONE},
    ("qwen35_397b_grpo", "bf16"): {
        "HybridBlock/GatedDeltaNet/MoE": ONE,
        "HybridBlock/GatedAttention/MoE": ONE,
    },
    ("flux1", "bf16"): {"DoubleBlock": ONE, "SingleBlock": ONE},
    # One kind: the windowed one differs only in its attention mask, which does not break a graph (bf16 above).
    ("gpt_oss_20b", "fp32"): {"Block/Attention/MoE": LOOP},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.slow
@pytest.mark.parametrize(("bench", "precision"), list(EXPECTED), ids=[f"{b}-{p}" for b, p in EXPECTED])
def test_graph_breaks_per_block_kind(bench, precision):
    want = EXPECTED[bench, precision]
    got = cc.coverage(bench, DTYPES[precision], kinds=None if precision == "bf16" else set(want))
    assert set(got["blocks"]) == set(want)
    for kind, (graphs, breaks, reasons) in want.items():
        r = got["blocks"][kind]
        assert (r["graphs"], r["breaks"]) == (graphs, breaks), (kind, r)
        assert len(r["reasons"]) == len(reasons), (kind, r["reasons"])
        for want, have in zip(reasons, r["reasons"], strict=True):
            assert have.startswith(want), (kind, have)


def test_what_stays_eager_is_named():
    assert cc.coverage("llama31_8b", kinds=set())["eager_outside"] == ["embed", "norm", "head"]


# The same comparison over all five families (MLA, the router's aux loss under compile, the MoE loop path,
# DeltaNet, flux) passed when run by hand on 2026-12-01 (loss bitwise, gradients within 9e-8); deepseekv3_671b
# alone costs 10-25 s, so CI runs llama's compiled RoPE/SwiGLU branches, which every decoder family uses.
@pytest.mark.slow
@pytest.mark.parametrize("bench", ["llama31_8b"])
def test_compiled_blocks_equal_eager_fp32(bench):
    """The compiled branches of RoPE and SwiGLU (common/fused.py, no `out=` into strided halves)."""
    torch._dynamo.reset()
    model, loss = cc.setup(bench, torch.device("cpu"), batch=1)
    ref = copy.deepcopy(model)
    eager = loss(ref)
    eager.backward()
    for block in model.layers:
        block.compile(backend="aot_eager")
    compiled = loss(model)
    compiled.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    grads = 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            grads += 1
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert grads > 0 and any(q.grad.abs().sum() > 0 for q in ref.parameters() if q.grad is not None)
