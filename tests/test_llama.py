import math

import pytest
import torch
import torch.nn.functional as F
from conftest import require

from timetotrain.models.common import layers as L
from timetotrain.models.common.layers import rope_inv_freq
from timetotrain.models.llama import (
    LLAMA31_8B,
    Llama,
    LlamaConfig,
    RopeScaling,
    flops_per_token,
    init_weights,
    param_count,
)
from timetotrain.models.llama.hf import from_hf_state_dict, hf_config_kwargs, to_hf_state_dict

pytestmark = pytest.mark.parity

# original_max_position 16 against a 64-token test sequence puts most RoPE wavelengths in the stretched or
# blended bands, so a wrong scaling formula shows up in the logits.
TINY = LlamaConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=160,
    vocab_size=256,
    max_seq_len=64,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=16),
    init_std=0.1,
)

LLAMA31_8B_PARAMS = 8_030_261_248


def _tiny_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(TINY)
    # Non-unit norm weights so that a swapped or dropped norm in the HF mapping changes the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _hf_model(transformers, cfg: LlamaConfig, attn: str = "eager"):
    hf_cfg = transformers.LlamaConfig(**hf_config_kwargs(cfg))
    hf_cfg._attn_implementation = attn
    return transformers.LlamaForCausalLM(hf_cfg).float()


def test_llama31_scaling_changes_frequencies():
    plain = rope_inv_freq(TINY.head_dim, TINY.rope_theta)
    scaled = rope_inv_freq(TINY.head_dim, TINY.rope_theta, TINY.rope_scaling)
    assert not torch.allclose(plain, scaled)
    # Highest frequency (wavelength 2*pi, between 16/4 and 16) is blended; the lowest is divided by the factor.
    assert plain[0] / 8 < scaled[0] < plain[0]
    assert scaled[-1] == pytest.approx(plain[-1].item() / 8.0, rel=1e-6)
    # The real config: wavelengths above 8192 stretched by 8, those below 2048 untouched.
    plain8b = rope_inv_freq(128, 500_000.0)
    scaled8b = rope_inv_freq(128, 500_000.0, LLAMA31_8B.rope_scaling)
    wavelen = 2 * math.pi / plain8b
    assert torch.equal(scaled8b[wavelen < 2048], plain8b[wavelen < 2048])
    assert torch.allclose(scaled8b[wavelen > 8192], plain8b[wavelen > 8192] / 8, rtol=1e-6)


def test_hf_parity_logits_loss_grads():
    transformers = require("transformers")
    model = _tiny_model()
    hf = _hf_model(transformers, TINY)
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), TINY), strict=True)
    assert torch.equal(
        hf.model.rotary_emb.inv_freq, rope_inv_freq(TINY.head_dim, TINY.rope_theta, TINY.rope_scaling)
    )

    tokens = torch.randint(
        0, TINY.vocab_size, (2, TINY.max_seq_len), generator=torch.Generator().manual_seed(1)
    )
    logits = model(tokens)
    out = hf(input_ids=tokens, labels=tokens)
    assert logits.shape == out.logits.shape == (2, TINY.max_seq_len, TINY.vocab_size)
    assert logits.abs().max() > 1.0  # weights large enough that the comparison is not trivially tight
    assert (logits - out.logits).abs().max().item() <= 1e-5

    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss.item() - out.loss.item()) <= 5e-6
    loss.backward()
    out.loss.backward()
    ours = to_hf_state_dict({n: p.grad for n, p in model.named_parameters()}, TINY)
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "lm_head.weight",
    ):
        scale = theirs[name].abs().max().item()
        assert (ours[name] - theirs[name]).abs().max().item() <= 1e-5 * max(scale, 1.0), name


def test_hf_state_dict_round_trip():
    model = _tiny_model()
    sd = model.state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, TINY), TINY)
    assert back.keys() == sd.keys()
    for name in sd:
        assert torch.equal(back[name], sd[name]), name


def test_gqa_expand_path_matches(monkeypatch):
    model = _tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fused = model(tokens)
        monkeypatch.setattr(L, "_SDPA_HAS_GQA", False)
        expanded = model(tokens)
    torch.testing.assert_close(fused, expanded, rtol=0, atol=1e-6)


def test_causal_and_shorter_sequences():
    model = _tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    changed = tokens.clone()
    changed[0, 30:] = (changed[0, 30:] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :30], b[:, :30], rtol=0, atol=0)
    assert not torch.allclose(a[:, 30:], b[:, 30:])
    with pytest.raises(ValueError):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_llama31_8b_param_count_on_meta():
    with torch.device("meta"):
        model = Llama(LLAMA31_8B)
    n = sum(p.numel() for p in model.parameters())
    assert n == param_count(LLAMA31_8B) == LLAMA31_8B_PARAMS
    assert round(n / 1e9, 2) == 8.03
    assert LLAMA31_8B.head_dim == 128
    assert model.layers[0].attn.qkv.weight.shape == ((32 + 2 * 8) * 128, 4096)
    assert model.layers[0].ffn.fc1.weight.shape == (2 * 14336, 4096)
    assert model.rope_cos.shape == (8192, 64)
    assert isinstance(model.layers, torch.nn.ModuleList)
    assert not any("rope" in k for k in model.state_dict())


def test_flops_per_token():
    cfg = LLAMA31_8B
    matmul = LLAMA31_8B_PARAMS - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    attention = 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(cfg, 8192) == 6 * matmul + attention
    assert flops_per_token(cfg, 8192, causal=True) == 6 * matmul + attention // 2
    assert flops_per_token(cfg, 8192) == pytest.approx(5.79e10, rel=1e-3)


def _init_cfg() -> LlamaConfig:
    return LlamaConfig(
        dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=1024, max_seq_len=128
    )


def test_megatron_init_statistics():
    cfg = _init_cfg()
    model = Llama(cfg)
    init_weights(model, generator=torch.Generator().manual_seed(0))
    std, residual_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
    expected = {"embed.weight": std, "head.weight": std}
    for i in range(cfg.n_layers):
        expected |= {
            f"layers.{i}.attn.qkv.weight": std,
            f"layers.{i}.ffn.fc1.weight": std,
            f"layers.{i}.attn.proj.weight": residual_std,
            f"layers.{i}.ffn.fc2.weight": residual_std,
        }
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        assert p.std().item() == pytest.approx(expected[name], rel=0.03), name
        assert abs(p.mean().item()) < 0.1 * expected[name], name
    assert len(expected) == sum(not n.endswith("norm.weight") for n, _ in model.named_parameters())


def test_init_after_meta_to_empty_matches_eager_init():
    cfg = _init_cfg()
    eager = Llama(cfg)
    init_weights(eager, generator=torch.Generator().manual_seed(5))
    with torch.device("meta"):
        meta = Llama(cfg)
    meta.to_empty(device="cpu")
    init_weights(meta, generator=torch.Generator().manual_seed(5))
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(meta.rope_cos, eager.rope_cos) and torch.equal(meta.rope_sin, eager.rope_sin)
