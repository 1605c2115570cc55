"""Our flux1 training step vs diffusers' `FluxTransformer2DModel`, side by side in one process.

    python bench/vs_diffusers.py [--reps 5] [--steps 3] [--configs tiny]

Same config (the flux1 tiny tier's model: 2 double + 4 single blocks, d 128, 64 image + 32 text tokens,
batch 16), same weights (ours mapped into diffusers' names, `models/flux/hf.py::diffusers_mapping`), same batch, the
same rectified-flow loss (x_t = (1 - t) x0 + t eps, MSE against eps - x0 in fp32), AdamW (one group, decay on
every parameter) and clipping. Ours runs `train_step` exactly as `ttt run` and `ttt synth` do; diffusers runs
its model's forward with the position ids and the 1000-scaled timestep its pipeline passes. The step loops
alternate within each repetition so drift in machine load hits both; medians and their ratio are printed, in
image tokens per second, with the MFU against a matmul peak measured in the same run. Ours is also timed with
its blocks compiled (`--compile` of `ttt run` / `ttt synth`) unless --no-compile.

Both run in one process, so they share the allocator: set `MALLOC_TRIM_THRESHOLD_` / `MALLOC_MMAP_THRESHOLD_`
in the environment to see how much of a difference is the cost of page faults on large fresh allocations.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from side_by_side import add_common_args, figures, peak_for, timed

from timetotrain.models.flux import Flux, diffusers_mapping, flops_per_sample, init
from timetotrain.suite.flux1 import ADAMW, TINY
from timetotrain.tasks.rectified_flow import flow_loss, noisy, velocity
from timetotrain.train.optim import build_optimizer
from timetotrain.train.step import train_step

CONFIGS = {"tiny": (TINY.model, 16)}


def to_diffusers(ours: Flux, cfg):
    """A diffusers model holding our weights (the mapping run backwards: concatenations split)."""
    import diffusers

    ref = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=cfg.in_channels, num_layers=cfg.n_double, num_single_layers=cfg.n_single,
        attention_head_dim=cfg.head_dim, num_attention_heads=cfg.n_heads, joint_attention_dim=cfg.txt_dim,
        pooled_projection_dim=cfg.vec_dim, guidance_embeds=False, axes_dims_rope=cfg.axes_dim,
    )  # fmt: skip
    theirs = ref.state_dict()
    sd = ours.state_dict()
    out = {}
    for name, src in diffusers_mapping(cfg).items():
        t = sd[name]
        if len(src.hf_names) == 1 and name.startswith("final_mod"):
            a, b = t.chunk(2)
            out[src.hf_names[0]] = torch.cat([b, a])
        elif len(src.hf_names) == 1:
            out[src.hf_names[0]] = t
        else:
            sizes = [theirs[n].shape[0] for n in src.hf_names]
            out.update(zip(src.hf_names, t.split(sizes), strict=True))
    ref.load_state_dict(out)
    return ref


def make_step(model, peer: bool, cfg, autocast=None):
    opt = build_optimizer(model, ADAMW, 1e-4)  # flux1's AdamW: one group, decay on every parameter
    params = list(model.parameters())
    if not peer:
        return lambda batch: train_step(model, opt, batch, 1, flow_loss, 1.0, params, autocast)
    r, c = torch.meshgrid(torch.arange(cfg.grid), torch.arange(cfg.grid), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(r), r, c], -1).reshape(-1, 3).float()
    txt_ids = torch.zeros(cfg.txt_len, 3)

    def step(b):
        x0, eps, t = b["x0"], b["eps"], b["t"]
        with torch.autocast(x0.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            pred = model(
                hidden_states=noisy(x0, eps, t), encoder_hidden_states=b["txt"], pooled_projections=b["vec"],
                timestep=t, img_ids=img_ids.to(x0.device), txt_ids=txt_ids.to(x0.device), return_dict=False,
            )[0]  # fmt: skip
        F.mse_loss(pred.float(), velocity(x0, eps).float()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def bench(name: str, reps: int, steps: int, peak: float, device, autocast=None, compile=True) -> dict:
    cfg, batch = CONFIGS[name]
    ours = Flux(cfg)
    init(ours, torch.Generator().manual_seed(0))
    with torch.no_grad():  # non-zero modulation and output, so no branch is skipped as dead
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    peer = to_diffusers(ours, cfg).to(device)
    compiled = Flux(cfg)
    compiled.load_state_dict(ours.state_dict())
    ours, compiled = ours.to(device), compiled.to(device)
    ours.reset_rope()
    compiled.reset_rope()
    for block in compiled.layers:
        block.compile()
    g = torch.Generator().manual_seed(1)
    b = {
        "x0": torch.randn(batch, cfg.img_len, cfg.in_channels, generator=g),
        "eps": torch.randn(batch, cfg.img_len, cfg.in_channels, generator=g),
        "t": torch.rand(batch, generator=g),
        "txt": torch.randn(batch, cfg.txt_len, cfg.txt_dim, generator=g),
        "vec": torch.randn(batch, cfg.vec_dim, generator=g),
    }
    b = {k: v.to(device) for k, v in b.items()}
    step_ours = make_step(ours, False, cfg, autocast)
    step_comp = make_step(compiled, False, cfg, autocast) if compile else step_ours
    step_peer = make_step(peer, True, cfg, autocast)
    for s in (
        step_ours,
        step_comp,
        step_comp,
        step_peer,
    ):  # warm-up: allocator, threads, kernels, compilation
        s(b)
    tok = batch * cfg.img_len * steps
    o, c, p = [], [], []
    for _ in range(reps):
        o.append(tok / timed(step_ours, b, steps, device))
        c.append(tok / timed(step_comp, b, steps, device))
        p.append(tok / timed(step_peer, b, steps, device))
    flops_per_image_token = flops_per_sample(cfg) / cfg.img_len
    return {
        "config": name,
        "params": sum(x.numel() for x in ours.parameters()),
        "batch": batch,
        **figures(statistics.median(o), statistics.median(c), statistics.median(p), "diffusers",
                  flops_per_image_token, peak),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "tiny")
    ap.add_argument("--configs", default="tiny")
    args = ap.parse_args()
    import diffusers

    device = torch.device(args.device)
    peak, source = peak_for(device)
    print(
        f"torch {torch.__version__}, diffusers {diffusers.__version__}, {torch.get_num_threads()} threads, "
        f"{device}, peak {peak / 1e12:.3f} TFLOP/s ({source})"
    )
    print(
        f"{'config':<7}{'params':>10}{'batch':>6}{'ours img tok/s':>16}{'compiled':>10}{'diffusers':>11}"
        f"{'ratio':>7}{'compiled':>9}{'our MFU':>9}"
    )
    for name in args.configs.split(","):
        r = bench(name, args.reps, args.steps, peak, device, torch.bfloat16 if args.bf16 else None,
                  compile=not args.no_compile)  # fmt: skip
        print(
            f"{r['config']:<7}{r['params']:>10,}{r['batch']:>6}{r['ours_tokens_per_s']:>16,.0f}"
            f"{r['compiled_tokens_per_s']:>10,.0f}{r['diffusers_tokens_per_s']:>11,.0f}{r['ratio']:>7.2f}"
            f"{r['compiled_ratio']:>9.2f}{100 * r['ours_mfu']:>8.1f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
