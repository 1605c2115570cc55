"""deepseek_v3 family: parity with HF DeepseekV3ForCausalLM (MLA, YaRN, group-limited routing), MTP against
its formula, the auxiliary-loss-free bias update, the sequence aux loss, checkpoint layouts."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from timetotrain.errors import UserError
from timetotrain.models import deepseek_v3 as ds
from timetotrain.models.common.layers import YarnScaling
from timetotrain.models.common.moe.router import GroupLimitedRouter, sequence_aux_loss
from timetotrain.models.deepseek_v3.hf import hf_config_kwargs, hf_export, hf_mapping
from timetotrain.train.checkpoint import load_hf_checkpoint

pytestmark = pytest.mark.parity


def small_cfg(**overrides) -> ds.DeepSeekV3Config:
    # YaRN with an original context of 16 and a max of 64, exercised at 48 tokens (longer than the original).
    base = dict(
        dim=32, n_layers=3, n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8,
        v_head_dim=12, ffn_dim=40, n_experts=8, top_k=3, expert_ffn_dim=16, n_groups=4, topk_groups=2,
        first_dense=1, vocab_size=96, max_seq_len=64, n_shared_experts=1, mtp_layers=1, init_std=0.1,
        rope_scaling=YarnScaling(factor=4.0, original_max_position=16),
    )  # fmt: skip
    return ds.DeepSeekV3Config(**{**base, **overrides})


def hf_model(cfg, seed=0):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.DeepseekV3Config(**hf_config_kwargs(cfg))
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # HF starts the biases at 0 and the router at std 0.1: make both matter
        for layer in model.model.layers[cfg.first_dense :]:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


def ours_from(path, cfg):
    model = ds.DeepSeekV3(cfg).eval()
    report = load_hf_checkpoint(model, path, hf_mapping(cfg))
    return model, report


@pytest.mark.parametrize("q_lora", [24, None])
def test_logits_and_experts_match_hf(tmp_path, q_lora):
    cfg = small_cfg(q_lora_rank=q_lora, mtp_layers=0)  # HF has no MTP forward (its output holds no MTP layer)
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path)
    ours, report = ours_from(tmp_path, cfg)
    assert report.ignored == []  # everything HF saved was read
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))

    hf_experts, our_experts = [], []
    for layer in hf.model.layers[cfg.first_dense :]:
        layer.mlp.gate.register_forward_hook(lambda m, i, o: hf_experts.append(o[2].sort(-1).values))
    for block in ours.layers[cfg.first_dense :]:
        block.ffn.router.register_forward_hook(lambda m, i, o: our_experts.append(o[1].sort(-1).values))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(our_experts) == len(hf_experts) == cfg.n_layers - cfg.first_dense
    for a, b in zip(our_experts, hf_experts, strict=True):
        assert torch.equal(a, b)
    # The bias changed the selection somewhere: the test would see a bias that is not applied.
    plain = [ours.layers[i].ffn.router for i in range(cfg.first_dense, cfg.n_layers)]
    assert any(r.bias.abs().sum() > 0 for r in plain)


def test_yarn_softmax_scale_and_tables():
    s = YarnScaling(factor=40.0, original_max_position=4096)
    assert s.softmax_scale(192) == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert (0.1 * math.log(40) + 1) ** 2 == pytest.approx(1.874, abs=1e-3)
    cfg = ds.DEEPSEEK_V3
    assert cfg.softmax_scale() == pytest.approx(s.softmax_scale(192))


def test_mtp_loss_matches_its_formula():
    """MTP depth 1 at position i: h1 = norm1(Block(eh_proj(cat[enorm(embed(t[i+1])), hnorm(h0[i])]))) with h0
    the trunk's output after its final norm (megatron-core's order); loss = mean over i < T-1 of
    CE(head(h1[i]), t[i+2]) (the label of position i+1); training loss = LM + 0.1 * that + aux losses."""
    cfg = small_cfg(aux_loss_coeff=0.0)
    torch.manual_seed(0)
    model = ds.DeepSeekV3(cfg).train()
    g = torch.Generator().manual_seed(3)
    window = torch.randint(0, cfg.vocab_size, (2, 33), generator=g)
    tokens, labels = window[:, :-1], window[:, 1:]
    labels = labels.clone()
    labels[0, 5] = -100  # an ignored label shifts into MTP position 4 too

    with torch.no_grad():
        T = tokens.shape[1]
        x = model.embed(tokens)
        cos, sin = model.rope_cos[:T], model.rope_sin[:T]
        for block in model.layers:
            x = block(x, cos, sin)
        h0 = model.norm(x)
        lm = F.cross_entropy(model.head(h0).flatten(0, 1), labels.flatten())
        m = model.mtp[0]
        # by hand: position i sees token i+1 (for i = T-1 nothing: any token, its target is ignored)
        nxt = torch.cat((tokens[:, 1:], tokens[:, :1]), dim=1)
        h1 = m.norm(m.block(m.eh_proj(torch.cat((m.enorm(model.embed(nxt)), m.hnorm(h0)), -1)), cos, sin))
        logits = model.head(h1)[:, :-1]
        mtp = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        want = lm + 0.1 * mtp
        got = model(tokens, labels=labels)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # eval mode (the benchmark's metric): the LM loss alone
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens, labels=labels), lm, rtol=1e-6, atol=1e-6)


def test_aux_loss_is_added_in_training_and_matches_formula():
    cfg = small_cfg(mtp_layers=0, aux_loss_coeff=0.01)
    torch.manual_seed(0)
    model = ds.DeepSeekV3(cfg)
    window = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    tokens, labels = window[:, :-1], window[:, 1:]
    total = model.train()(tokens, labels=labels)
    aux = [r.aux_loss for r in model.routers()]
    assert len(aux) == cfg.n_layers - cfg.first_dense and all(a is not None for a in aux)
    lm = model.eval()(tokens, labels=labels)
    torch.testing.assert_close(total, lm + sum(aux))
    # the counts are the plain top-k of the unbiased scores (Megatron), whatever the bias selects
    router = model.routers()[0]
    x = torch.randn(2 * 16, cfg.dim)
    with torch.no_grad():
        router.bias.copy_(torch.linspace(-5, 5, cfg.n_experts))  # a bias that changes the selection
        scores = (x @ router.weight.T).sigmoid()
    _, chosen = router.train()(x, (2, 16))  # with grad: the aux loss exists only then
    assert not torch.equal(chosen.sort(-1).values, scores.topk(cfg.top_k, -1).indices.sort(-1).values)
    want = 0.01 * sequence_aux_loss(scores, scores.topk(cfg.top_k, -1).indices, (2, 16), cfg.top_k)
    torch.testing.assert_close(router.aux_loss, want)
    # sequence_aux_loss by the paper's formula, one sequence at a time, with explicit loops
    scores = torch.rand(2 * 5, 8, generator=torch.Generator().manual_seed(5))
    experts = torch.stack(
        [torch.randperm(8, generator=torch.Generator().manual_seed(i))[:3] for i in range(10)]
    )
    want = 0.0
    for b in range(2):
        s, e = scores[b * 5 : (b + 1) * 5], experts[b * 5 : (b + 1) * 5]
        for i in range(8):
            f = 8 / (3 * 5) * (e == i).sum().item()
            p = (s[:, i] / s.sum(-1)).mean().item()
            want += f * p / 2
    assert sequence_aux_loss(scores, experts, (2, 5), 3).item() == pytest.approx(want, rel=1e-6)


def test_bias_update_balances_a_skewed_load():
    """Tokens whose router scores strongly favour a few experts: 50 bias updates at rate 1e-3 (x10 here, the
    toy's scores spread more than a trained model's) bring the load's coefficient of variation down."""
    torch.manual_seed(0)
    router = GroupLimitedRouter(16, 16, 4, n_groups=4, topk_groups=2, scaling=2.5, bias_rate=1e-2).train()
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.weight[:3] += 0.6  # experts 0-2 favoured by every token with positive features
    x = torch.randn(512, 16).abs()

    def cv(load):
        return (load.std(unbiased=False) / load.mean()).item()

    cvs = []
    for _ in range(50):
        with torch.no_grad():
            router(x)
        cvs.append(cv(router.load))
        router.update_bias(router.load.clone())
    assert cvs[0] > 0.5, cvs[0]  # skewed to start with
    assert cvs[-1] < 0.5 * cvs[0], (cvs[0], cvs[-1])
    assert router.bias.grad is None and not router.bias.requires_grad


def test_bias_gets_no_gradient_and_selection_ignores_nothing():
    cfg = small_cfg()
    model = ds.DeepSeekV3(cfg).train()
    window = torch.randint(0, cfg.vocab_size, (2, 17))
    model(window[:, :-1], labels=window[:, 1:]).backward()
    for r in model.routers():
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
        assert not r.bias.requires_grad
    loads = [r.load.sum().item() for r in model.routers()]
    assert loads == [2 * 16 * cfg.top_k] * len(loads)  # every token's k selections, MTP block included
    model.update_router_bias()
    assert all(r.load.sum() == 0 for r in model.routers())


def test_export_round_trip_with_mtp(tmp_path):
    cfg = small_cfg()
    torch.manual_seed(0)
    model = ds.DeepSeekV3(cfg)
    with torch.no_grad():
        for r in model.routers():
            r.bias.normal_(0, 0.1)
    from safetensors.torch import save_file

    tensors, config = hf_export(model.state_dict(), cfg)
    assert (
        "model.layers.3.eh_proj.weight" in tensors
        and "model.layers.3.mlp.gate.e_score_correction_bias" in tensors
    )
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    back, report = ours_from(tmp_path, cfg)
    # the MTP layer's copies of the embedding and head are the main model's, not read again
    assert report.ignored == ["model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"]
    for name, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def test_fp8_checkpoint_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2), "model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(1, 1)},
        tmp_path / "model.safetensors",
    )  # fmt: skip
    with pytest.raises(UserError, match="FP8 block-quantized"):
        load_hf_checkpoint(ds.DeepSeekV3(small_cfg()), tmp_path, hf_mapping(small_cfg()))


def test_reference_parameter_counts():
    cfg = ds.DEEPSEEK_V3
    total, active = ds.param_count(cfg), ds.active_param_count(cfg)
    # DeepSeek-V3: 671 B main-model parameters + 14 B MTP module, 37 B activated (the paper's figures,
    # which count the 129,280-row vocabulary).
    mtp = total - ds.param_count(ds.DeepSeekV3Config(**{**cfg.__dict__, "mtp_layers": 0}))
    assert 670e9 < total - mtp < 672e9, total - mtp
    assert 11e9 < mtp < 15e9, mtp
    assert 36e9 < active - (mtp - 256 * 3 * 7168 * 2048 + 8 * 3 * 7168 * 2048) < 38.5e9


def test_flops_count_active_weights_and_mla_attention():
    """Matmul FLOPs from the built module: every 2-D/3-D weight a token multiplies with (routed experts at
    top_k / n_experts of their size, the head twice: trunk and MTP), and MLA attention at 6 H (qk + v)
    FLOPs per causal (query, key) pair in every layer, MTP block included."""
    cfg = small_cfg()
    model = ds.DeepSeekV3(cfg)
    matmul = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name == "embed.weight":
            continue  # norms, and the embedding gather
        share = cfg.top_k / cfg.n_experts if ".experts." in name else 1.0
        matmul += p.numel() * share
    matmul += model.head.weight.numel() * cfg.mtp_layers  # the shared head runs again for each MTP depth
    T = 48
    pairs = (cfg.n_layers + cfg.mtp_layers) * T / 2
    want = 6 * matmul + pairs * 6 * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    assert ds.flops_per_token(cfg, T, causal=True) == pytest.approx(want, rel=1e-12)
    active = sum(
        p.numel() * (cfg.top_k / cfg.n_experts if ".experts." in n else 1.0)
        for n, p in model.named_parameters()
    )
    assert ds.active_param_count(cfg) == pytest.approx(active, rel=1e-12)
    assert ds.param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_telemetry_reports_loads_and_biases():
    cfg = small_cfg()
    model = ds.DeepSeekV3(cfg).train()
    window = torch.randint(0, cfg.vocab_size, (2, 17))
    model(window[:, :-1], labels=window[:, 1:])
    model.update_router_bias()
    figures, text = ds.telemetry(model)
    n_moe = cfg.n_layers - cfg.first_dense + cfg.mtp_layers
    assert len(figures["ttt_tokens_per_expert"]) == n_moe
    assert [sum(r) for r in figures["ttt_tokens_per_expert"]] == [2 * 16 * cfg.top_k] * n_moe
    bias = torch.tensor(figures["ttt_router_bias"])
    assert bias.shape == (n_moe, cfg.n_experts) and bias.abs().max() == pytest.approx(1e-3)
    assert "bias spread" in text
