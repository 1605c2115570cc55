"""qwen3_5_moe family: parity with HF Qwen3_5MoeForCausalLM (logits, selected experts, greedy decoding), the
chunked against the recurrent Gated DeltaNet, sampled log-probabilities against a full forward, checkpoint
layouts both ways, and the parameter counts."""

import json

import pytest
import torch
from safetensors.torch import save_file

from timetotrain.models import qwen3_5_moe as q
from timetotrain.models.common.sampling import sample_next
from timetotrain.models.qwen3_5_moe.deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule
from timetotrain.models.qwen3_5_moe.generate import generate
from timetotrain.models.qwen3_5_moe.hf import hf_config_kwargs, hf_export, hf_mapping
from timetotrain.models.qwen3_5_moe.model import block_activation_elements
from timetotrain.train.checkpoint import load_hf_checkpoint

pytestmark = pytest.mark.parity

# Two shapes: (a) grouped value heads (2 key heads for 4 value heads), GQA 4:2, the 3:1 layer pattern, 25% RoPE;
# (b) one value head per key head, no GQA, full attention every other layer, half the head rotated, top-3.
CONFIGS = {
    "a": dict(
        dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, lin_k_heads=2, lin_v_heads=4, lin_k_dim=8,
        lin_v_dim=12, n_experts=8, top_k=2, expert_ffn_dim=16, shared_ffn_dim=24, vocab_size=96, max_seq_len=160,
    ),
    "b": dict(
        dim=24, n_layers=4, n_heads=2, n_kv_heads=2, head_dim=12, lin_k_heads=3, lin_v_heads=3, lin_k_dim=8,
        lin_v_dim=8, n_experts=6, top_k=3, expert_ffn_dim=12, shared_ffn_dim=16, vocab_size=80, max_seq_len=160,
        full_attention_interval=2, partial_rotary=0.5, conv_kernel=3,
    ),
}  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny ops: on a loaded 2-core machine, two intra-op threads wait on each other far longer than they
    # compute. Per test, not per module: conftest's `_threads_restored` puts the session's count back after
    # every test, which had left all but the first test on two threads (60x the CPU under load).
    torch.set_num_threads(1)


def small_cfg(name="a", **overrides) -> q.Qwen35MoeConfig:
    return q.Qwen35MoeConfig(**{**CONFIGS[name], **overrides})


def hf_model(cfg, seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**hf_config_kwargs(cfg)))
    model = model.float().eval()
    with torch.no_grad():  # HF starts the norms at their neutral value and the weights small: make all matter
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(0.0, 0.2)
            elif p.dim() >= 2 and "conv1d" not in name:
                p.mul_(4.0)
    return model


def ours_from(path, cfg):
    model = q.Qwen35Moe(cfg).eval()
    return model, load_hf_checkpoint(model, path, hf_mapping(cfg))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(cfg, HF model, ours loaded from HF's `save_pretrained` folder, that folder)."""
    cfg = small_cfg(request.param)
    hf = hf_model(cfg)
    path = tmp_path_factory.mktemp(f"hf-{request.param}")
    hf.save_pretrained(path)
    ours, report = ours_from(path, cfg)
    assert report.ignored == []  # everything HF saved was read
    return cfg, hf, ours, path


def test_logits_and_experts_match_hf(pair):
    cfg, hf, ours, _ = pair
    # 150 tokens: three DeltaNet chunks of 64, the last one partial.
    tokens = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(1))
    hf_experts, our_experts = [], []
    for layer in hf.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, o: hf_experts.append(o[2].sort(-1).values))
    for block in ours.layers:
        block.ffn.router.register_forward_hook(lambda m, i, o: our_experts.append(o[1].sort(-1).values))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(our_experts) == len(hf_experts) == cfg.n_layers
    for a, b in zip(our_experts, hf_experts, strict=True):
        assert torch.equal(a, b)
    assert len(torch.cat(our_experts).unique()) == cfg.n_experts  # the routing is exercised, not degenerate


@pytest.mark.slow
def test_greedy_decode_equals_hf_generate(pair):
    cfg, hf, ours, _ = pair
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 2)]
    got, _ = generate(ours, prompts, max_new_tokens=24, temperature=0.0)
    for prompt, completion in zip(prompts, got, strict=True):
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert completion == out[0, len(prompt) :].tolist()
    # HF's own left-padded batch agrees too.
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    for i, p in enumerate(prompts):
        mask[i, P - len(p) :] = 1
    out = hf.generate(
        ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert [out[i, P:].tolist() for i in range(len(prompts))] == got
    assert len({tuple(c) for c in got}) == len(got)  # the prompts lead to different completions


def test_sampled_logprobs_equal_a_full_forward(pair):
    cfg, _, ours, _ = pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in (4, 9, 9, 1)]
    eos = 7
    got, logprobs = generate(
        ours, prompts, max_new_tokens=30, temperature=0.8, top_p=0.9, eos_id=eos,
        generator=torch.Generator().manual_seed(4),
    )  # fmt: skip
    for prompt, completion, lp in zip(prompts, got, logprobs, strict=True):
        assert len(completion) == len(lp) and 1 <= len(completion) <= 30
        assert eos not in completion[:-1] and (completion[-1] == eos or len(completion) == 30)
        with torch.no_grad():
            logits = ours(torch.tensor([prompt + completion]))[0, len(prompt) - 1 : -1]
        want = (logits / 0.8).log_softmax(-1).gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
    assert any(len(c) < 30 for c in got)  # some row stopped at EOS, so the row-dropping path ran
    # Every step run (`all_steps`, ranks in lockstep under FSDP or EP): the same draws, so the same completions.
    every, lp_every = generate(
        ours, prompts, max_new_tokens=30, temperature=0.8, top_p=0.9, eos_id=eos,
        generator=torch.Generator().manual_seed(4), all_steps=True,
    )  # fmt: skip
    assert every == got
    for a, b in zip(lp_every, logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_batched_rows_do_not_depend_on_each_other(pair):
    """Left padding adds nothing: a row decodes the same alone, in a batch, and with every step run (`all_steps`)."""
    cfg, _, ours, _ = pair
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 8)]
    batched, lp_b = generate(ours, prompts, max_new_tokens=12, temperature=0.0, eos_id=3)
    every, lp_e = generate(ours, prompts, max_new_tokens=12, temperature=0.0, eos_id=3, all_steps=True)
    assert every == batched
    for i, p in enumerate(prompts):
        alone, lp_a = generate(ours, [p], max_new_tokens=12, temperature=0.0, eos_id=3)
        assert alone[0] == batched[i]
        torch.testing.assert_close(lp_a[0], lp_b[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lp_e[i], lp_b[i], rtol=1e-5, atol=1e-5)


def test_chunked_equals_recurrent_delta_rule():
    g = torch.Generator().manual_seed(6)
    B, H, T, dk, dv = 2, 3, 45, 8, 6

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    q = torch.nn.functional.normalize(rnd(B, H, T, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(rnd(B, H, T, dk), dim=-1)
    v = rnd(B, H, T, dv)
    beta = rnd(B, H, T).sigmoid()
    decay = -rnd(B, H, T).exp() * 2  # some strong decays (down to e^-20 per token): no overflow
    state = rnd(B, H, dk, dv)
    want, want_state = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    for chunk in (8, 16, 64):  # 45 tokens: several chunks with a partial last one, and one padded chunk
        got, got_state = chunk_gated_delta_rule(q, k, v, decay, beta, state, chunk=chunk)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    # Continuing from the state equals one pass: split at 20.
    a, s = chunk_gated_delta_rule(
        q[:, :, :20], k[:, :, :20], v[:, :, :20], decay[:, :, :20], beta[:, :, :20], state, 8
    )
    b, s = recurrent_gated_delta_rule(
        q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], decay[:, :, 20:], beta[:, :, 20:], s
    )
    torch.testing.assert_close(torch.cat((a, b), dim=2), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, want_state, rtol=1e-5, atol=1e-5)


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).log_softmax(-1).repeat(400, 1)
    probs = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, 0.03
    tokens, lp = sample_next(logits, 1.0, 0.8, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}  # 0.64 < 0.8 <= 0.64 + 0.24
    torch.testing.assert_close(lp, probs.log()[tokens])  # the untruncated distribution's log-probabilities
    tokens, _ = sample_next(logits, 1.0, 0.5, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0}  # the first token is always kept
    tokens, _ = sample_next(logits, 1.0, 1.0, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_checkpoint_layouts_and_export_round_trip(pair, tmp_path):
    """The hub layout (prefix `model.language_model.`, fused experts) loads to the same model; `hf_export`
    writes what HF `from_pretrained` and our loader read back."""
    transformers = pytest.importorskip("transformers")
    cfg, hf, ours, _ = pair
    hub = {}
    for name, t in hf.state_dict().items():
        hub[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in hub)  # HF's in-memory layout: fused experts
    hub["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)  # a vision tower we do not read
    (tmp_path / "hub").mkdir()
    save_file({k: v.contiguous() for k, v in hub.items()}, tmp_path / "hub" / "model.safetensors")
    other, report = ours_from(tmp_path / "hub", cfg)
    assert report.ignored == ["model.visual.blocks.0.attn.qkv.weight"]
    for (n, a), (_, b) in zip(ours.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), n

    state, config = hf_export({k: v.detach() for k, v in ours.state_dict().items()}, cfg)
    (tmp_path / "out").mkdir()
    save_file(state, tmp_path / "out" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    back, report = ours_from(tmp_path / "out", cfg)
    assert report.ignored == []
    reloaded = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), ours(tokens), rtol=0, atol=0)
        torch.testing.assert_close(reloaded(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_trains_in_fp32_and_bf16():
    """The chunked path has gradients everywhere (incl. the decay parameters and conv taps) and runs under
    bf16 autocast."""
    cfg = small_cfg("a")
    torch.manual_seed(0)
    model = q.Qwen35Moe(cfg).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(8))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if "experts" not in name:  # an expert no token chose has a zero gradient
            assert p.grad.abs().sum() > 0, name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(tokens[:, :-1], labels=tokens[:, 1:])
    assert torch.isfinite(bf16) and abs(bf16.item() - loss.item()) < 0.05 * loss.item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_counts_equal_the_built_model(name):
    cfg = small_cfg(name)
    model = q.Qwen35Moe(cfg)
    assert q.param_count(cfg) == sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.layers]
    assert q.FAMILY.block_params(cfg) == max(blocks)
    per_expert = 3 * cfg.dim * cfg.expert_ffn_dim
    assert (
        q.param_count(cfg) - q.active_param_count(cfg)
        == cfg.n_layers * (cfg.n_experts - cfg.top_k) * per_expert
    )


def test_reference_sizes():
    """Qwen3.5-397B-A17B: 397B parameters with the vision tower (about 0.4B), 17B active."""
    cfg = q.QWEN35_397B
    assert 395e9 < q.param_count(cfg) < 397e9
    assert 17.0e9 < q.active_param_count(cfg) < 17.6e9
    assert [cfg.is_full_attention(i) for i in range(8)] == [False, False, False, True] * 2
    assert cfg.rope_dim == 64 and cfg.conv_dim == 2 * 16 * 128 + 64 * 128
    # Training FLOPs: more than 6 x the active matmul weights (all but the embedding lookup), and the DeltaNet
    # layers do not grow with the context.
    f4k, f8k = q.flops_per_token(cfg, 4096), q.flops_per_token(cfg, 8192)
    assert f4k > 6 * (q.active_param_count(cfg) - cfg.vocab_size * cfg.dim)
    full_attention = cfg.n_full_layers() * 6 * 2 * cfg.n_heads * cfg.head_dim * 2048  # per 4096 more keys / 2
    assert f8k - f4k == pytest.approx(full_attention)


def _saved_bytes(fn, module) -> int:
    """Bytes of the distinct storages autograd saves while `fn()` runs, the module's parameters left out."""
    states = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    kept: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in states:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()  # held until counted, so no storage is freed and its address reused
    del out
    return sum(kept.values())


@pytest.mark.parametrize("shape", [dict(), dict(dim=64, lin_v_heads=8, lin_k_dim=16, lin_v_dim=16)])
def test_activation_count_is_near_what_autograd_saves_in_bf16(shape):
    """`ttt plan`'s per-block count (bf16 elements, fp32 ones twice) against the bytes a block really keeps under
    CPU bf16 autocast: not below by more than 5%, not above by more than 25% (the fp32 DeltaNet internals, the
    norms and the MoE are counted at their largest)."""
    cfg = small_cfg("a", **shape)
    model = q.Qwen35Moe(cfg)
    B, T = 2, 128
    x = torch.randn(B, T, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    for layer in (0, cfg.full_attention_interval - 1):
        block = model.layers[layer]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            measured = _saved_bytes(lambda b=block: b(x, cos, sin), block) / (B * T) / 2
        counted = block_activation_elements(cfg, block.full_attention)
        assert 0.95 * measured <= counted <= 1.25 * measured, (layer, counted, measured)


def test_generate_refuses_what_it_cannot_do_and_keeps_the_mode():
    cfg = small_cfg("a")
    model = q.Qwen35Moe(cfg).train()
    for prompts, kwargs in (
        ([], {}),
        ([[1], []], {}),
        ([[1]], {"max_new_tokens": 0}),
        ([[1]], {"temperature": -1.0}),
        ([[1]], {"top_p": 0.0}),
    ):
        with pytest.raises(ValueError):
            generate(model, prompts, **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1] * 150], max_new_tokens=20, temperature=0.0)  # 170 columns > 160
    assert model.training  # an error leaves the mode as it was
    completions, _ = generate(model, [[1, 2]], max_new_tokens=3, temperature=0.0)
    assert model.training and len(completions[0]) == 3  # back in training mode, dropout-free decoding done


@pytest.mark.slow
def test_chunk_scan_under_fake_tensors_keeps_what_the_loop_keeps(monkeypatch):
    """`ttt plan --simulate` (fake tensors) runs the DeltaNet chunk scan batched (`fakes.shapes_only`): the same
    outputs' shapes, and what autograd keeps after the forward equal to the op-by-op loop's (within 0.1%:
    one state more). Its backward holds less than the loop's, whose per-chunk gradient buffers of every
    input live together (seen: 5.15 against 6.10 MB here, the rule alone), as docs/scale.md says."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from timetotrain import fakes

    def run(batched: bool):
        monkeypatch.setattr(fakes, "shapes_only", lambda: batched)
        with FakeTensorMode():
            q, k, v = (torch.randn(1, 2, 1024, 16, requires_grad=True) for _ in range(3))
            g, beta = (torch.randn(1, 2, 1024, requires_grad=True) for _ in range(2))
            mt = MemTracker()
            mt.track_external(q, k, v, g, beta)
            with mt:
                out, final = chunk_gated_delta_rule(q, k, v, g, beta)
                kept = mt.get_tracker_snapshot()[torch.device("cpu")]["Total"]
                (out.sum() + final.sum()).backward()
            peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        return out.shape, final.shape, kept, peak

    shapes, final, kept, peak = run(True)
    loop_shapes, loop_final, loop_kept, loop_peak = run(False)
    assert (shapes, final) == (loop_shapes, loop_final)
    assert abs(kept - loop_kept) <= 1e-3 * loop_kept
    assert kept <= peak <= loop_peak
