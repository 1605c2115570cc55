"""The MMDiT against diffusers' FluxTransformer2DModel (same weights, mapped through `diffusers_mapping`), and
its init, sizes and FLOPs."""

import pytest
import torch
from conftest import require

from timetotrain.models import flux
from timetotrain.models.flux import Flux, FluxConfig

pytestmark = pytest.mark.parity

# 2 double + 2 single blocks, head_dim 16 split (4, 6, 6) over the three RoPE axes as (16, 56, 56) splits 128.
CFG = FluxConfig(
    dim=32, n_heads=2, n_double=2, n_single=2, latent_channels=4, patch=2, latent_size=8, txt_dim=24,
    txt_len=8, vec_dim=12, axes_dim=(4, 6, 6),
)  # fmt: skip


def _diffusers_model(cfg: FluxConfig):
    diffusers = require("diffusers")
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=cfg.in_channels, num_layers=cfg.n_double, num_single_layers=cfg.n_single,
        attention_head_dim=cfg.head_dim, num_attention_heads=cfg.n_heads, joint_attention_dim=cfg.txt_dim,
        pooled_projection_dim=cfg.vec_dim, guidance_embeds=False, axes_dims_rope=cfg.axes_dim,
    ).float()  # fmt: skip
    with torch.no_grad():  # every tensor random, norm scales and zero-init parts included
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return ref


def _ours_from(ref, cfg: FluxConfig) -> Flux:
    sd = ref.state_dict()
    mapping = flux.diffusers_mapping(cfg)
    ours = Flux(cfg)
    assert set(mapping) == set(ours.state_dict()), "mapping must cover exactly our parameters"
    used = {n for src in mapping.values() for n in src.hf_names}
    assert used == set(sd), f"diffusers tensors not mapped: {set(sd) - used}"
    ours.load_state_dict({k: src.combine([sd[n] for n in src.hf_names]) for k, src in mapping.items()})
    return ours


def _ids(cfg: FluxConfig):
    r, c = torch.meshgrid(torch.arange(cfg.grid), torch.arange(cfg.grid), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(r), r, c], -1).reshape(-1, 3).float()
    return img_ids, torch.zeros(cfg.txt_len, 3)


def _inputs(cfg: FluxConfig, B: int = 4):
    g = torch.Generator().manual_seed(1)
    img = torch.randn(B, cfg.img_len, cfg.in_channels, generator=g)
    txt = torch.randn(B, cfg.txt_len, cfg.txt_dim, generator=g)
    vec = torch.randn(B, cfg.vec_dim, generator=g)
    t = torch.tensor([0.0, 0.125, 0.5, 0.97])[:B]  # several timesteps in one batch
    return img, txt, vec, t


def test_forward_matches_diffusers():
    ref = _diffusers_model(CFG)
    ours = _ours_from(ref, CFG)
    img, txt, vec, t = _inputs(CFG)
    img_ids, txt_ids = _ids(CFG)
    with torch.no_grad():
        want = ref(
            hidden_states=img, encoder_hidden_states=txt, pooled_projections=vec, timestep=t,
            img_ids=img_ids, txt_ids=txt_ids, return_dict=False,
        )[0]  # fmt: skip
        got = ours(img, txt, vec, t)
    assert want.abs().max() > 0.1  # a non-trivial output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gradients_match_diffusers():
    ref = _diffusers_model(CFG)
    ours = _ours_from(ref, CFG)
    img, txt, vec, t = _inputs(CFG)
    img_ids, txt_ids = _ids(CFG)
    target = torch.randn_like(img)
    ref_out = ref(
        hidden_states=img, encoder_hidden_states=txt, pooled_projections=vec, timestep=t, img_ids=img_ids,
        txt_ids=txt_ids, return_dict=False,
    )[0]  # fmt: skip
    torch.nn.functional.mse_loss(ref_out, target).backward()
    torch.nn.functional.mse_loss(ours(img, txt, vec, t), target).backward()
    ref_grads = dict(ref.named_parameters())
    mapping = flux.diffusers_mapping(CFG)
    for name, p in ours.named_parameters():
        src = mapping[name]
        want = src.combine([ref_grads[n].grad for n in src.hf_names])
        # A weight gradient is a sum over every token: two summation orders part by a few ulps of the
        # tensor's largest values, not of each element (one time_in.fc2 element of 1,024 by 1.1e-5 where
        # the tensor reaches 29.8, on an AMD EPYC).
        atol = max(1e-6, 8 * torch.finfo(torch.float32).eps * want.abs().max().item())
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=atol, msg=name)


def test_shorter_text_matches_diffusers():
    """A text length other than the config's (the RoPE rows of text are the identity)."""
    ref = _diffusers_model(CFG)
    ours = _ours_from(ref, CFG)
    img, txt, vec, t = _inputs(CFG)
    txt = txt[:, :5]
    img_ids, _ = _ids(CFG)
    with torch.no_grad():
        want = ref(
            hidden_states=img, encoder_hidden_states=txt, pooled_projections=vec, timestep=t,
            img_ids=img_ids, txt_ids=torch.zeros(5, 3), return_dict=False,
        )[0]  # fmt: skip
        torch.testing.assert_close(ours(img, txt, vec, t), want, rtol=1e-5, atol=1e-5)


def test_init_zero_modulation_predicts_zero():
    model = Flux(CFG)
    flux.init(model, torch.Generator().manual_seed(0))
    for block in model.layers:
        for s in [block.img, block.txt] if isinstance(block, flux.DoubleBlock) else [block]:
            assert s.mod.weight.abs().sum() == 0 and s.mod.bias.abs().sum() == 0
    assert model.final_out.weight.abs().sum() == 0
    # Xavier-uniform bound sqrt(6 / (fan_in + fan_out)) on the projections, zero biases.
    w = model.layers[0].img.qkv.weight
    assert w.abs().max() <= (6 / (CFG.dim + 3 * CFG.dim)) ** 0.5 and w.std() > 0
    assert model.layers[0].img.qkv.bias.abs().sum() == 0
    assert abs(model.time_in.fc1.weight.std().item() - 0.02) < 0.004
    img, txt, vec, t = _inputs(CFG)
    with torch.no_grad():
        assert model(img, txt, vec, t).abs().max() == 0


def test_init_is_seeded():
    a, b = Flux(CFG), Flux(CFG)
    flux.init(a, torch.Generator().manual_seed(3))
    flux.init(b, torch.Generator().manual_seed(3))
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


def test_meta_build_then_init():
    with torch.device("meta"):
        model = Flux(CFG)
    model.to_empty(device="cpu")
    flux.init(model, torch.Generator().manual_seed(0))
    cos, _ = flux.rope_tables(CFG, CFG.txt_len)
    assert torch.equal(model.rope_cos, cos)


@pytest.mark.parametrize("cfg", [CFG, FluxConfig()])
def test_param_count(cfg):
    with torch.device("meta"):
        model = Flux(cfg)
    assert flux.param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_reference_size():
    cfg = FluxConfig()
    assert cfg.seq_len == 512 and cfg.in_channels == 64 and cfg.head_dim == 128
    assert 11.8e9 < flux.param_count(cfg) < 12.0e9  # "about 11.9 B"
    assert flux.flops_per_sample(cfg) == pytest.approx(flux.flops_per_token(cfg) * 512)


def test_flops_match_a_counter():
    """Every matmul forward and backward as torch's FlopCounterMode counts them, plus the attention square,
    which the counter does not see inside CPU SDPA (4 T^2 d per layer forward, x3 with the backward), plus
    the input gradient of time_in.fc1, which autograd skips (the timestep features need none)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = Flux(CFG)
    img, txt, vec, t = _inputs(CFG)
    B, T, n = img.shape[0], CFG.seq_len, CFG.n_double + CFG.n_single
    for x in (img, txt, vec):
        x.requires_grad_(True)
    with FlopCounterMode(display=False) as counter:
        model(img, txt, vec, t).sum().backward()
    counted = counter.get_total_flops() + 3 * 4 * T * T * CFG.dim * n * B + 2 * B * CFG.time_dim * CFG.dim
    assert flux.flops_per_sample(CFG) * B == counted


def test_init_through_checkpoint_wrappers():
    """The sharded build initialises after activation checkpointing wrapped the blocks: same weights."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain, wrapped = Flux(CFG), Flux(CFG)
    for i, block in enumerate(wrapped.layers):
        wrapped.layers[i] = checkpoint_wrapper(block)
    flux.init(plain, torch.Generator().manual_seed(5))
    flux.init(wrapped, torch.Generator().manual_seed(5))
    got = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in wrapped.state_dict().items()}
    assert got.keys() == plain.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(got[k], v), k
