"""flux1: text-to-image, a FLUX.1-schnell-shaped MMDiT trained from scratch by rectified flow (MLPerf
Training 6.0; docs/benchmarks/flux1.md).

The model is models/flux/, the objective and evaluation tasks/rectified_flow.py, the data the encoded layout
of data/flux_encodings.py that `ttt data prepare flux` writes from image/caption tars (data/flux_prepare.py),
with the real frozen encoders or, for the tiny tier, documented stand-ins (data/flux_encoders.py).
docs/benchmarks/flux1.md has the details.
"""

from __future__ import annotations

from timetotrain.models.flux import FAMILY, FluxConfig
from timetotrain.spec.benchmark import Benchmark, EndLRRule, Optimizer, RcpHparams, Tier
from timetotrain.tasks.rectified_flow import FluxData, RectifiedFlow

# GBS -> base LR and warmup steps of the 6.0 RCPs (rcps_flux1.json).
RCP_HPARAMS = {
    512: RcpHparams(2e-4, 1600),
    1024: RcpHparams(2.5e-4, 800),
    2048: RcpHparams(2.5e-4, 0),
    4096: RcpHparams(4e-4, 100),
}

# torch AdamW, one parameter group: weight decay 0.1 on every parameter, biases and norm scales included.
ADAMW = Optimizer(name="adamw", betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0, decay_mask="all")

REFERENCE = Tier(
    name="reference",
    model=FluxConfig(),
    data=FluxData(train_samples=1_099_776),
    global_batch_size=512,
    micro_batch_size=16,
    lr=2e-4,
    end_lr=2e-4,  # constant after warmup
    warmup_steps=1600,
    max_steps=30_000,
    eval_every_samples=262_144,
    eval_samples=29_696,
    target=0.586,
    runs=10,
    division="closed",
    description="MLPerf Training 6.0 closed configuration",
)

# Tiny: 2 double + 4 single blocks at width 128 (4 heads of 32, RoPE axes 8/12/12 in the reference's
# proportions), 64 image tokens (a 16 x 16 x 16 latent in 2 x 2 patches) and 32 text tokens of 64 channels,
# on the stand-in encodings of the shared CC12M (32) and COCO train2017 (50) pairs; evaluated on the 51 COCO
# val2017 images, each at all 8 timesteps (408 items, exactly balanced). The latent normalisation is the
# stand-in's own (shift 0, scale measured once over the training latents to give unit variance), in the
# place of the FLUX.1 VAE's 0.1159 / 0.3611.
TINY_MODEL = FluxConfig(
    dim=128, n_heads=4, n_double=2, n_single=4, latent_channels=16, patch=2, latent_size=16, txt_dim=64,
    txt_len=32, vec_dim=64, axes_dim=(8, 12, 12),
)  # fmt: skip

TINY = Tier(
    name="tiny",
    model=TINY_MODEL,
    data=FluxData(
        train_samples=82, shift=0.0, scale=1.9, eval_repeats=8, encoders="standin", tokenizer="llama2"
    ),
    global_batch_size=16,
    micro_batch_size=16,
    lr=1e-3,
    end_lr=1e-3,
    warmup_steps=10,
    max_steps=600,
    eval_every_samples=160,
    eval_samples=408,
    target=1.0,
    runs=10,
    division="open",
    description="2 CPU cores, about a minute; stand-in encoders over the CC12M and COCO fixtures",
)

BENCHMARK = Benchmark(
    name="flux1",
    area="text-to-image",
    task=RectifiedFlow(),
    family=FAMILY,
    tiers={"reference": REFERENCE, "tiny": TINY},
    optimizer=ADAMW,
    schedule="warmup_constant",
    closed_rules=("training_6.0.0/closed_common.yaml", "training_6.0.0/closed_flux1.yaml"),
    rcp_hparams=RCP_HPARAMS,
    end_lr_rule=EndLRRule(1.0),  # no decay: the end LR is the base LR
)
