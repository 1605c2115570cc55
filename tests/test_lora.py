"""LoRA (models/common/lora.py) and the Llama 2 checkpoint layouts (models/llama/hf.py) of `llama2_70b_lora`.

- Parity with PEFT in both layouts: the benchmark's fused one (an HF Llama whose attention has one `qkv_proj`,
  rows q|k|v, as MLCommons' `Llama2-70b-fused-qkv-mlperf`; PEFT LoRA on `qkv_proj` and `o_proj`) and stock
  `LlamaForCausalLM` (PEFT on q_proj, k_proj, v_proj, o_proj; ours on the q, k, v parts of our fused qkv),
  against our Llama loaded from the same weights with our LoRA: loss, every adapter gradient, and the
  adapters after 5 AdamW steps with the reference hyperparameters.
- Adapters on the q, k, v parts of the fused qkv: names, rows, merging.
- The trainable count of the 70B shape; a frozen base; dropout on the adapter input in train mode only;
  autocast with a bf16 base, activation checkpointing, compile and a 1-process FSDP2 smoke.
- Loading both HF layouts (stock q/k/v_proj and fused qkv_proj) gives the same model; neither -> one line.
"""

import copy
from dataclasses import replace

import pytest
import torch
from conftest import random_hf_llama, require, small_llama
from torch import nn

from timetotrain.errors import UserError
from timetotrain.models.common.lora import (
    LoRALinear,
    apply_lora,
    init_lora,
    lora_modules,
    lora_param_count,
    lora_parameters,
    lora_state_dict,
    merge_lora,
)
from timetotrain.models.llama import LLAMA2_70B, Llama, param_count
from timetotrain.models.llama.hf import (
    from_hf_state_dict,
    hf_mapping,
    qkv_from_hf,
    qkv_permutation,
    qkv_to_hf,
    to_hf_state_dict,
)
from timetotrain.spec.benchmark import Optimizer
from timetotrain.train.checkpoint import HF_SINGLE, load_hf_checkpoint
from timetotrain.train.optim import build_optimizer
from timetotrain.train.step import train_step

pytestmark = pytest.mark.parity

CFG = small_llama(rope_theta=10_000.0, rope_scaling=None)  # Llama 2: plain RoPE
RANK, ALPHA = 16, 32.0
# The reference's optimizer: HF `adamw_torch`, weight decay on the LoRA weights, clip 0.3 by global norm.
LR, BETAS, EPS, WD, CLIP = 4e-4, (0.9, 0.999), 1e-8, 1e-4, 0.3
Q_ROWS, KV_ROWS = CFG.n_heads * CFG.head_dim, CFG.n_kv_heads * CFG.head_dim


def _tokens(seed: int, shape=(2, 33)) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[:, :-1], labels=tokens[:, 1:])


def _meta_llama() -> Llama:
    with torch.device("meta"):
        model = Llama(CFG)
    return model.to_empty(device="cpu")


def _tiny(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(CFG)


def _randomise_b(model: nn.Module, seed: int, std: float = 0.05) -> None:
    """Non-zero B everywhere, so the adapters change the output and A gets gradients."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.shape[1] == RANK:  # lora_B [out, rank]
                p.copy_(torch.randn(p.shape, generator=g) * std)


# --- the HF side -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers():
    return require("transformers")


@pytest.fixture(scope="module")
def hf_model(transformers):
    """Stock HF Llama (separate q/k/v_proj), fp32, eager attention, random weights of logit scale ~1."""
    return random_hf_llama(CFG)


def _fused_state_dict(hf_sd: dict) -> dict:
    """The MLCommons layout, built here independently of llama_hf: q, k, v rows concatenated."""
    out = {}
    for name, t in hf_sd.items():
        if ".self_attn.q_proj." in name:
            k, v = (hf_sd[name.replace("q_proj", p)] for p in ("k_proj", "v_proj"))
            out[name.replace("q_proj", "qkv_proj")] = torch.cat((t, k, v))
        elif ".self_attn.k_proj." not in name and ".self_attn.v_proj." not in name:
            out[name] = t
    return out


def _fused_hf_model(transformers, stock):
    """`stock` with each attention's q/k/v_proj replaced by one `qkv_proj` (rows q|k|v) whose output is
    split back into q, k, v; the rest is HF's own code (RoPE, eager attention, o_proj). This is what the
    MLCommons modeling code does, and what PEFT wraps in the reference."""
    from transformers.models.llama import modeling_llama as ml

    class FusedQKVAttention(ml.LlamaAttention):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            del self.q_proj, self.k_proj, self.v_proj
            self.qkv_proj = nn.Linear(config.hidden_size, Q_ROWS + 2 * KV_ROWS, bias=False)

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q, k, v = self.qkv_proj(hidden_states).split([Q_ROWS, KV_ROWS, KV_ROWS], dim=-1)
            q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
            q, k = ml.apply_rotary_pos_emb(q, k, *position_embeddings)
            kwargs = {n: a for n, a in kwargs.items() if n not in ("cache", "use_cache", "position_ids")}
            out, weights = ml.eager_attention_forward(
                self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
            )
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights

    fused = copy.deepcopy(stock)
    for i, layer in enumerate(fused.model.layers):
        layer.self_attn = FusedQKVAttention(fused.config, i)
    missing, unexpected = fused.load_state_dict(_fused_state_dict(stock.state_dict()), strict=True)
    assert not missing and not unexpected
    return fused.eval()


@pytest.fixture(scope="module")
def checkpoints(hf_model, tmp_path_factory):
    """{"separate": stock save_pretrained folder, "fused": a single-file fused-qkv_proj checkpoint}."""
    safetensors = require("safetensors.torch")
    root = tmp_path_factory.mktemp("lora_hf")
    hf_model.save_pretrained(root / "separate", safe_serialization=True)
    (root / "fused").mkdir()
    safetensors.save_file(_fused_state_dict(hf_model.state_dict()), root / "fused" / HF_SINGLE)
    return {"separate": root / "separate", "fused": root / "fused"}


# --- layouts and loading ---------------------------------------------------------------------------------


def test_qkv_permutation():
    perm = qkv_permutation(CFG)
    assert sorted(perm.tolist()) == list(range(Q_ROWS + 2 * KV_ROWS))
    # Spelled out for KV group 0 (query heads 0 and 1, then key head 0, then value head 0), head_dim 16.
    hd = CFG.head_dim
    expected0 = [
        *range(0, 2 * hd),
        *range(Q_ROWS, Q_ROWS + hd),
        *range(Q_ROWS + KV_ROWS, Q_ROWS + KV_ROWS + hd),
    ]
    assert perm[: 4 * hd].tolist() == expected0
    x = torch.randn(Q_ROWS + 2 * KV_ROWS, 3, 5)  # any trailing shape: weights, LoRA B, gradients
    assert torch.equal(qkv_to_hf(qkv_from_hf(x, CFG), CFG), x)
    assert torch.equal(qkv_from_hf(x, CFG), x[perm])


def test_both_layouts_load_the_same_model(hf_model, checkpoints):
    """Stock layout: logits equal HF's (1e-6). Fused layout, auto-detected or named: bit-identical weights."""
    tokens = _tokens(1, (2, 64))
    separate = _meta_llama()
    report = load_hf_checkpoint(separate, checkpoints["separate"], hf_mapping(CFG))
    assert report.ignored == []
    with torch.no_grad():
        logits, theirs = separate(tokens), hf_model(input_ids=tokens).logits
    assert logits.abs().max() > 0.5
    torch.testing.assert_close(logits, theirs, atol=1e-6, rtol=0)

    for mapping in (hf_mapping(CFG), hf_mapping(CFG, fused_qkv=True)):
        fused = _meta_llama()
        report = load_hf_checkpoint(fused, checkpoints["fused"], mapping)
        assert report.ignored == []
        assert all(torch.equal(a, b) for a, b in zip(fused.parameters(), separate.parameters(), strict=True))
        with torch.no_grad():
            assert torch.equal(fused(tokens), logits)

    # The whole-dict conversions agree with the streamed mapping in both directions.
    hf_sd = hf_model.state_dict()
    fused_sd = _fused_state_dict(hf_sd)
    ours = separate.state_dict()
    assert all(torch.equal(from_hf_state_dict(fused_sd, CFG)[n], t) for n, t in ours.items())
    back = to_hf_state_dict(ours, CFG, fused_qkv=True)
    assert back.keys() == fused_sd.keys() and all(torch.equal(back[n], fused_sd[n]) for n in back)


def test_layout_errors_name_the_layer(hf_model, checkpoints, tmp_path):
    safetensors = require("safetensors.torch")
    with pytest.raises(UserError, match=r"tensor model\.layers\.0\.self_attn\.q_proj\.weight .* missing"):
        load_hf_checkpoint(_meta_llama(), checkpoints["fused"], hf_mapping(CFG, fused_qkv=False))
    with pytest.raises(UserError, match=r"tensor model\.layers\.0\.self_attn\.qkv_proj\.weight .* missing"):
        load_hf_checkpoint(_meta_llama(), checkpoints["separate"], hf_mapping(CFG, fused_qkv=True))

    one_kv = replace(CFG, n_kv_heads=1)  # fewer rows than the checkpoint's qkv_proj: refused, not sliced
    with pytest.raises(
        UserError, match=r"cannot build layers\.0\.attn\.qkv\.weight from .*qkv_proj.*expected 96"
    ):
        with torch.device("meta"):
            small = Llama(one_kv)
        load_hf_checkpoint(small.to_empty(device="cpu"), checkpoints["fused"], hf_mapping(one_kv))

    neither = {
        n: t for n, t in hf_model.state_dict().items() if n != "model.layers.1.self_attn.k_proj.weight"
    }
    safetensors.save_file(neither, tmp_path / HF_SINGLE)
    with pytest.raises(UserError) as err:
        load_hf_checkpoint(_meta_llama(), tmp_path, hf_mapping(CFG))
    message = str(err.value)
    assert "\n" not in message
    needed = "tensor model.layers.1.self_attn.k_proj.weight (needed for layers.1.attn.qkv.weight) is missing"
    assert needed in message
    assert "and so is model.layers.1.self_attn.qkv_proj.weight" in message
    assert "model.layers.1.self_attn.q_proj.weight, model.layers.1.self_attn.k_proj.weight" in message


# --- LoRA itself -----------------------------------------------------------------------------------------


def test_trainable_count_of_70b_shape():
    assert lora_param_count(LLAMA2_70B, 16) == 44_564_480  # 80 x [16 (8192 + 10240) + 16 (8192 + 8192)]
    assert param_count(LLAMA2_70B) == 68_976_648_192  # the published Llama 2 70B size
    # The formula counts what apply_lora builds, for the default and for all four targets.
    for targets in (("attn.qkv", "attn.proj"), ("attn.qkv", "attn.proj", "ffn.fc1", "ffn.fc2")):
        model = apply_lora(_tiny(), targets, rank=4)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == lora_param_count(
            CFG, 4, targets
        )


def test_frozen_base_names_init_and_dropout():
    base = _tiny()
    model = apply_lora(copy.deepcopy(base), rank=RANK, alpha=ALPHA, dropout=0.1)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        f"layers.{i}.attn.{t}.lora_{m}.weight" for i in range(2) for t in ("qkv", "proj") for m in "AB"
    )
    qkv = model.layers[0].attn.qkv
    assert isinstance(qkv, LoRALinear) and qkv.scale == 2.0 and qkv.weight is qkv.base.weight
    assert "layers.0.attn.qkv.base.weight" in dict(model.named_parameters())
    assert qkv.lora_A.weight.shape == (RANK, CFG.dim) and qkv.lora_B.weight.shape == (
        Q_ROWS + 2 * KV_ROWS,
        RANK,
    )
    # PEFT's init: A uniform within 1/sqrt(in) (Kaiming-uniform, a = sqrt(5)), B zero: the base's output.
    bound = 1 / CFG.dim**0.5
    a = qkv.lora_A.weight.detach()
    assert (
        a.abs().max() <= bound
        and a.abs().max() > 0.9 * bound
        and a.std() == pytest.approx(bound / 3**0.5, rel=0.1)
    )
    assert not qkv.lora_B.weight.any()
    tokens = _tokens(2)
    with torch.no_grad():
        assert torch.equal(model(tokens), base(tokens))  # B = 0, dropout active: exactly the base

    _randomise_b(model, 3)
    loss = _loss(model, tokens)
    loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) if p.requires_grad else p.grad is None, name

    seen = []
    qkv.dropout.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    with torch.no_grad():
        first, second = model(tokens), model(tokens)
        model.eval()
        third, fourth = model(tokens), model(tokens)
    assert not torch.equal(first, second)  # a fresh mask each call in train mode
    assert torch.equal(third, fourth)
    x, y = seen[0]
    dropped = (y == 0) & (x != 0)
    assert dropped.float().mean().item() == pytest.approx(0.1, abs=0.02)
    torch.testing.assert_close(y[~dropped], x[~dropped] / 0.9)  # inverted dropout scaling
    assert torch.equal(seen[2][0], seen[2][1])  # eval: off

    no_dropout = apply_lora(copy.deepcopy(base), rank=RANK, alpha=ALPHA, dropout=0.0)
    no_dropout.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(no_dropout.eval()(tokens), third)

    with pytest.raises(ValueError, match=r"layers\.0\.attn\.qkv already has a LoRA adapter"):
        apply_lora(model)
    with pytest.raises(ValueError, match=r"layers\.0\.attn_norm is RMSNorm, not an nn\.Linear"):
        apply_lora(copy.deepcopy(base), targets=("attn_norm",))


def test_state_dict_merge_and_generator():
    g = torch.Generator().manual_seed(7)
    model = apply_lora(_tiny(), dropout=0.0, generator=g)
    again = apply_lora(_tiny(), dropout=0.0, generator=torch.Generator().manual_seed(7))
    adapters = lora_state_dict(model)
    assert list(adapters) == [
        f"layers.{i}.attn.{t}.lora_{m}.weight" for i in range(2) for t in ("qkv", "proj") for m in "AB"
    ]
    assert all(torch.equal(t, lora_state_dict(again)[n]) for n, t in adapters.items())
    assert [p.data_ptr() for p in lora_parameters(model)] == [t.data_ptr() for t in adapters.values()]
    # Applied on the meta device, materialised, then initialised: the same adapters for the same generator.
    with torch.device("meta"):
        on_meta = apply_lora(Llama(CFG), dropout=0.0)
    on_meta.to_empty(device="cpu")
    init_lora(on_meta, torch.Generator().manual_seed(7))
    assert all(torch.equal(t, lora_state_dict(on_meta)[n]) for n, t in adapters.items())

    _randomise_b(model, 4)
    tokens = _tokens(5)
    with torch.no_grad():
        adapted = model(tokens)
        merged = merge_lora(model)(tokens)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert sorted(model.state_dict()) == sorted(_tiny().state_dict())
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)


def test_adapters_on_qkv_parts():
    """Targets attn.q and attn.v (k left out): one adapter per part inside the fused qkv, each updating
    exactly its part's rows (checked in HF's q|k|v order through `qkv_to_hf`), merged = adapted, and the
    same adapters when applied on the meta device and initialised from the same generator."""
    targets = ("attn.q", "attn.v", "attn.proj")
    base = _tiny()
    model = apply_lora(
        copy.deepcopy(base), targets, rank=4, dropout=0.0, generator=torch.Generator().manual_seed(3)
    )
    names = ["qkv.lora_A.q", "qkv.lora_B.q", "qkv.lora_A.v", "qkv.lora_B.v", "proj.lora_A", "proj.lora_B"]
    adapters = lora_state_dict(model)
    assert list(adapters) == [f"layers.{i}.attn.{n}.weight" for i in range(2) for n in names]
    assert sum(p.numel() for p in lora_parameters(model)) == lora_param_count(CFG, 4, targets)
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == sorted(adapters)
    qkv = model.layers[0].attn.qkv
    assert qkv.lora_B["q"].weight.shape == (Q_ROWS, 4) and qkv.lora_B["v"].weight.shape == (KV_ROWS, 4)
    with torch.no_grad():
        assert torch.equal(model(_tokens(4)), base(_tokens(4)))  # B = 0: exactly the base

    with torch.device("meta"):
        on_meta = apply_lora(Llama(CFG), targets, rank=4, dropout=0.0)
    on_meta.to_empty(device="cpu")
    init_lora(on_meta, torch.Generator().manual_seed(3))
    assert all(torch.equal(t, lora_state_dict(on_meta)[n]) for n, t in adapters.items())

    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for part, rows in (("q", slice(0, Q_ROWS)), ("v", slice(Q_ROWS + KV_ROWS, None))):
            qkv.lora_B["q"].weight.zero_()
            qkv.lora_B["v"].weight.zero_()
            qkv.lora_B[part].weight.copy_(torch.randn(qkv.lora_B[part].weight.shape, generator=g))
            expected = torch.zeros(Q_ROWS + 2 * KV_ROWS, CFG.dim)
            expected[rows] = 32 / 4 * (qkv.lora_B[part].weight @ qkv.lora_A[part].weight)  # alpha / rank
            torch.testing.assert_close(qkv_to_hf(qkv.delta_weight(), CFG), expected, atol=1e-6, rtol=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    tokens = _tokens(7)
    with torch.no_grad():
        adapted = model(tokens)
        merged = merge_lora(model)(tokens)
    assert sorted(model.state_dict()) == sorted(base.state_dict())
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)

    with pytest.raises(ValueError, match="attn.q/k/v are parts of attn.qkv"):
        apply_lora(copy.deepcopy(base), ("attn.qkv", "attn.q"))


@pytest.mark.slow
def test_autocast_bf16_base_checkpointing_and_compile():
    """Same RNG seed -> same dropout masks: activation checkpointing replays them and gives the eager
    gradients; a compiled block (aot_eager: traced as inductor would be, without a C++ build) too; a bf16
    base under bf16 autocast trains fp32 adapters and stays close to fp32."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    reference = apply_lora(_tiny(), dropout=0.1, generator=torch.Generator().manual_seed(1))
    _randomise_b(reference, 2)
    tokens = _tokens(6)

    def grads(model, seed=11):
        torch.manual_seed(seed)
        loss = _loss(model, tokens)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    loss0, g0 = grads(reference)

    checkpointed = copy.deepcopy(reference)
    checkpointed.zero_grad(set_to_none=True)
    for i, block in enumerate(checkpointed.layers):
        checkpointed.layers[i] = checkpoint_wrapper(block)
    loss1, g1 = grads(checkpointed)
    assert torch.equal(loss1, loss0)
    assert g1.keys() != g0.keys()  # wrapper levels in the names ...
    assert list(lora_state_dict(checkpointed)) == list(lora_state_dict(reference))  # ... but not here
    for (n, a), b in zip(g0.items(), g1.values(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-7, rtol=0, msg=n)

    # The wrapper traces as one graph (the block's own fused RoPE op has graph breaks of its own); a block
    # compiled with it gives the eager loss and gradients (dropout 0: compiled RNG draws differ from eager's).
    qkv = reference.layers[0].attn.qkv
    explained = torch._dynamo.explain(qkv)(torch.randn(2, 8, CFG.dim))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    eager = copy.deepcopy(reference)
    for _, module in lora_modules(eager):
        module.dropout = nn.Identity()
    eager.zero_grad(set_to_none=True)
    compiled = copy.deepcopy(eager)
    compiled.layers[0].compile(backend="aot_eager")
    loss_e, g_e = grads(eager)
    loss_c, g_c = grads(compiled)
    torch.testing.assert_close(loss_c, loss_e, atol=1e-6, rtol=0)
    for (n, a), b in zip(g_e.items(), g_c.values(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=n)
    torch._dynamo.reset()

    half = apply_lora(
        _tiny(), dropout=0.1, base_dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)
    )
    half.load_state_dict(
        {n: t.to(torch.bfloat16) if t.dim() >= 2 else t for n, t in reference.state_dict().items()}
    )
    dtypes = {n: p.dtype for n, p in half.named_parameters()}
    assert dtypes["layers.0.attn.qkv.base.weight"] == dtypes["embed.weight"] == torch.bfloat16
    assert dtypes["layers.0.attn.qkv.lora_A.weight"] == dtypes["layers.0.attn_norm.weight"] == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss3, g3 = grads(half)
    assert abs(loss3.item() - loss0.item()) < 0.02 * loss0.item()
    assert all(g.dtype == torch.float32 for g in g3.values())
    assert all(p.grad is None for p in half.parameters() if not p.requires_grad)
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten() for g in g3.values()]), torch.cat([g.flatten() for g in g0.values()]), dim=0
    )
    assert cos > 0.99


def test_fsdp2_one_process(tmp_path):
    """fully_shard per block over LoRA blocks (1 gloo rank): same gradients as unsharded, none kept for the
    frozen base, and the optimizer steps the sharded adapters; a bf16 base with bf16 param_dtype runs."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    reference = apply_lora(_tiny(), dropout=0.0, generator=torch.Generator().manual_seed(1))
    _randomise_b(reference, 2)
    tokens = _tokens(8)
    _loss(reference, tokens).backward()
    g0 = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for base_dtype, mp in (
            (None, MixedPrecisionPolicy()),
            (torch.bfloat16, MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
        ):
            model = apply_lora(_tiny(), dropout=0.0, base_dtype=base_dtype)
            model.load_state_dict(reference.state_dict())
            for block in model.layers:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            opt = build_optimizer(model, Optimizer("adamw", BETAS, EPS, WD, CLIP), LR, fused=False)
            loss = _loss(model, tokens)
            loss.backward()
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            assert grads.keys() == g0.keys() and all(isinstance(g, DTensor) for g in grads.values())
            if base_dtype is None:
                for n, g in grads.items():
                    torch.testing.assert_close(g.full_tensor(), g0[n], atol=1e-6, rtol=0, msg=n)
            before = lora_state_dict(model)["layers.0.attn.qkv.lora_A.weight"].full_tensor().clone()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
            opt.step()
            after = lora_state_dict(model)["layers.0.attn.qkv.lora_A.weight"].full_tensor()
            assert not torch.equal(before, after)
    finally:
        dist.destroy_process_group()


# --- parity with PEFT ------------------------------------------------------------------------------------

# Per layout: the HF modules PEFT targets, and the LoRA targets of ours that train the same adapters.
LAYOUTS = {
    "fused_qkv": (["qkv_proj", "o_proj"], ("attn.qkv", "attn.proj")),
    "separate_qkv": (["q_proj", "k_proj", "v_proj", "o_proj"], ("attn.q", "attn.k", "attn.v", "attn.proj")),
}


def _adapter_pairs(theirs, ours, layout: str) -> list:
    """(name, our adapter weight, PEFT's, PEFT's -> ours) for every adapter weight. Gives PEFT's B random
    values (so the adapters change the output and A gets gradients) and copies PEFT's A and B into ours."""
    hf_targets, _ = LAYOUTS[layout]
    g = torch.Generator().manual_seed(10)

    def same(t):
        return t

    def rows_to_ours(t):  # only the fused qkv's B has one row per qkv output: HF's q|k|v -> our grouped order
        return qkv_from_hf(t, CFG)

    pairs = []
    with torch.no_grad():
        for i, block in enumerate(ours.layers):
            attn = theirs.base_model.model.model.layers[i].self_attn
            for hf_name in hf_targets:
                module = getattr(attn, hf_name)
                a_theirs, b_theirs = module.lora_A["default"].weight, module.lora_B["default"].weight
                assert a_theirs.abs().max() <= 1 / a_theirs.shape[1] ** 0.5  # PEFT's init, as ours
                assert not b_theirs.any()
                b_theirs.copy_(torch.randn(b_theirs.shape, generator=g) * 0.05)
                to_b = same
                if hf_name == "o_proj":
                    name, mine = f"layers.{i}.attn.proj", block.attn.proj
                    a_ours, b_ours = mine.lora_A, mine.lora_B
                elif hf_name == "qkv_proj":
                    name, mine, to_b = f"layers.{i}.attn.qkv", block.attn.qkv, rows_to_ours
                    a_ours, b_ours = mine.lora_A, mine.lora_B
                else:  # q_proj, k_proj, v_proj: one adapter per part of our fused qkv, B in HF's row order
                    part, mine = hf_name[0], block.attn.qkv
                    name = f"layers.{i}.attn.qkv.{part}"
                    a_ours, b_ours = mine.lora_A[part], mine.lora_B[part]
                a_ours.weight.copy_(a_theirs)
                b_ours.weight.copy_(to_b(b_theirs))
                pairs += [(name + ".lora_A", a_ours.weight, a_theirs, same)]
                pairs += [(name + ".lora_B", b_ours.weight, b_theirs, to_b)]
    return pairs


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # transformers, via PEFT
@pytest.mark.parametrize("layout", LAYOUTS)
def test_peft_parity(transformers, hf_model, checkpoints, layout):
    """PEFT on an HF Llama in each layout against ours loaded from that layout's checkpoint: the fused one
    (one `qkv_proj`, the reference's model and targets: one adapter on qkv_proj, one on o_proj) and the
    stock one (separate q/k/v_proj; PEFT on q_proj, k_proj, v_proj and o_proj, ours on the q, k and v parts
    of our fused qkv). Loss, every adapter gradient at 1e-6, and the adapters after 5 AdamW steps (lr 4e-4,
    betas (0.9, 0.999), eps 1e-8, weight decay 1e-4 on the adapters, clip 0.3 by global norm over them) at
    1e-5, all in fp32, dropout off, the same adapter init (PEFT's A copied into ours, B zero, then the same
    random B on both)."""
    peft = require("peft")
    hf_targets, our_targets = LAYOUTS[layout]
    tokens = _tokens(9, (2, 64))
    if layout == "fused_qkv":
        hf = _fused_hf_model(transformers, hf_model)
        with torch.no_grad():  # the fused HF model is the stock one, computed from one projection
            torch.testing.assert_close(
                hf(input_ids=tokens).logits, hf_model(input_ids=tokens).logits, atol=1e-6, rtol=0
            )
        source = checkpoints["fused"]
    else:
        hf, source = copy.deepcopy(hf_model), checkpoints["separate"]
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=hf_targets, bias="none"
    )
    theirs = peft.get_peft_model(hf, config).train()

    ours = _meta_llama()
    load_hf_checkpoint(ours, source, hf_mapping(CFG))
    apply_lora(ours, our_targets, rank=RANK, alpha=ALPHA, dropout=0.0)
    ours.train()
    pairs = _adapter_pairs(theirs, ours, layout)
    ref_params = [p for p in theirs.parameters() if p.requires_grad]
    assert len(ref_params) == len(pairs) == len(lora_parameters(ours))
    assert sum(p.numel() for p in ref_params) == lora_param_count(CFG, RANK, our_targets)

    def their_loss(t):
        return theirs(input_ids=t, labels=t).loss  # HF shifts the labels itself

    loss_ours, loss_theirs = _loss(ours, tokens), their_loss(tokens)
    assert torch.isfinite(loss_ours)
    torch.testing.assert_close(loss_ours, loss_theirs, atol=1e-6, rtol=0)
    loss_ours.backward()
    loss_theirs.backward()
    for name, mine, ref, to_ours in pairs:
        assert mine.grad.abs().max() > 1e-4, name  # 100x the tolerance (the q adapters get the least)
        torch.testing.assert_close(mine.grad, to_ours(ref.grad), atol=1e-6, rtol=0, msg=name)
    ours.zero_grad(set_to_none=True)
    theirs.zero_grad(set_to_none=True)

    start = [mine.detach().clone() for _, mine, _, _ in pairs]
    # Ours through the harness's own step (build_optimizer + train_step); theirs as HF Trainer does it.
    opt_ours = build_optimizer(ours, Optimizer("adamw", BETAS, EPS, WD, CLIP), LR)
    opt_theirs = torch.optim.AdamW(ref_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    norms = []
    for step in range(5):
        batch = _tokens(100 + step, (2, 64))
        params = lora_parameters(ours)
        train_step(ours, opt_ours, {"tokens": batch}, 1, lambda m, mb: _loss(m, mb["tokens"]), CLIP, params)
        their_loss(batch).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref_params, CLIP).item())
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)
    assert min(norms) > CLIP  # the clip took effect in every step
    for name, mine, ref, to_ours in pairs:
        torch.testing.assert_close(mine, to_ours(ref.detach()), atol=1e-5, rtol=0, msg=name)
    # Each adapter moved ~5 lr (Adam's unit steps), 100x the tolerance.
    assert min((mine - s).abs().max().item() for (_, mine, _, _), s in zip(pairs, start, strict=True)) > 1e-3
