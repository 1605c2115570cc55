"""Text-to-image training by rectified flow on encoded data (flux1; docs/benchmarks/flux1.md).

A training sample: its VAE posterior drawn and normalised into the clean latent x0 (data/flux_encodings.py),
t ~ U(0, 1), eps ~ N(0, I) in the latent's shape; the model sees x_t = (1 - t) x0 + t eps (patchified) with t
and the text encodings, and predicts the velocity eps - x0; the loss is the MSE over every latent element
and the batch, in fp32. With probability `cfg_drop` per sample both text encodings are replaced by the empty
prompt's (classifier-free-guidance dropout).

All the randomness of a step (latent draw, t, eps, drops) is made by `batch(step)` on the prefetch thread,
from a generator seeded by (run seed, rank, step): each data-parallel rank draws its own numbers, as the
reference seeds them apart, and a step's batch is the same whatever ran before it.

Evaluation: validation item i has the fixed t = (i mod 8) / 8 (so the 8 values are exactly balanced when the
item count is a multiple of 8), unless the validation split stores each sample's timestep (MLCommons' COCO
encodings do, as an index 0..7, imported by data/flux_mlcommons.py): then item i is evaluated at its
stored index / 8 (the import records whether those equal i mod 8). Noise comes from a generator seeded by
(run seed, i's chunk): the same numbers at every eval point of a run and for the same seed on any number of
ranks. The metric is the mean over items of each item's MSE. `FluxData.eval_repeats` > 1 (tiny) evaluates
each image at that many consecutive items, i.e. at all 8 timesteps with 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from timetotrain.data import flux_encoders, flux_prepare
from timetotrain.data import flux_encodings as enc
from timetotrain.errors import UserError
from timetotrain.spec.task import Batch, DataRecipe, Metric, RunData, Share, Task, evaluate_ratio

EVAL_TIMESTEPS = 8
_EVAL_TAG = 0xE7A1  # separates the eval generators' seeds from the training steps'


@dataclass(frozen=True)
class FluxData:
    """Where and how a tier's encoded data is read. `train_samples` is what the log reports (the reference
    logs its CC12M subset's size); `shift`/`scale` normalise the VAE latents."""

    train_samples: int = 1_099_776
    shift: float = 0.1159
    scale: float = 0.3611
    cfg_drop: float = 0.1
    eval_repeats: int = 1
    eval_batch: int = 64
    train_split: str = "train"
    val_split: str = "validation"
    # The encoders (and their tokenizer) the encodings must come from, by the names the split's manifest
    # records (`encoders`, `tokenizer.name`); None: any (the reference's real encoders or MLCommons' files).
    encoders: str | None = None
    tokenizer: str | None = None


# ------------------------------------------------------------------------------------------------ objective


def patchify(z: torch.Tensor, p: int) -> torch.Tensor:
    """`[B, C, H, W]` -> `[B, (H/p)(W/p), C p p]`, patches in row-major order, channels (c, ph, pw)."""
    B, C, H, W = z.shape
    return z.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), -1)


def noisy(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps, `t` `[B]` broadcast over the sample's other dims."""
    tb = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return torch.lerp(x0, eps, tb)


def velocity(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The rectified-flow target, d x_t / d t = eps - x0."""
    return eps - x0


def per_sample_mse(model, batch: Batch) -> torch.Tensor:
    """`[B]`: each sample's mean squared error of the predicted velocity, in fp32."""
    x0, eps, t = batch["x0"], batch["eps"], batch["t"]
    pred = model(noisy(x0, eps, t), batch["txt"], batch["vec"], t)
    return (pred.float() - velocity(x0, eps).float()).square().flatten(1).mean(1)


def flow_loss(model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
    """MSE over all latent elements and the batch (equal-sized samples: the mean of per-sample means)."""
    x0, eps, t = batch["x0"], batch["eps"], batch["t"]
    pred = model(noisy(x0, eps, t), batch["txt"], batch["vec"], t)
    return F.mse_loss(pred.float(), velocity(x0, eps).float(), reduction=reduction)


def eval_timesteps(items: torch.Tensor) -> torch.Tensor:
    """The fixed timestep of validation items (global indices): (i mod 8) / 8."""
    return (items % EVAL_TIMESTEPS).float() / EVAL_TIMESTEPS


def apply_cfg_drop(txt, vec, drop: torch.Tensor, empty_txt, empty_vec):
    """Replace the text encodings of the samples where `drop` (bool `[B]`) by the empty prompt's."""
    d = drop.view(-1, 1, 1)
    return torch.where(d, empty_txt.to(txt.dtype), txt), torch.where(d[:, 0], empty_vec.to(vec.dtype), vec)


def seed_of(*parts: int) -> int:
    """A 63-bit generator seed mixed from integers (numpy SeedSequence: nearby inputs give unrelated seeds)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


# ------------------------------------------------------------------------------------------------ run data


def shapes_of(cfg) -> enc.Shapes:
    return enc.Shapes(
        t5=(cfg.txt_len, cfg.txt_dim),
        clip=(cfg.vec_dim,),
        latent=(cfg.latent_channels, cfg.latent_size, cfg.latent_size),
    )


class Resolved:
    def __init__(self, root: Path, train: enc.EncodedSplit, val: enc.EncodedSplit, empty):
        self.root, self.train, self.val, self.empty = root, train, val, empty

    def files(self) -> list[Path]:
        return self.train.files() + self.val.files()


class _FlowData(RunData):
    def __init__(self, tier, resolved: Resolved, seed: int, share: Share, device):
        self.cfg, self.data, self.tier = tier.model, tier.data, tier
        self.train, self.val = resolved.train, resolved.val
        self.empty_txt, self.empty_vec = resolved.empty
        self.seed, self.share, self.device = seed, share, device
        self.rank, self.world, self.local = share.rank, share.world, share.local
        self.n_eval = tier.eval_samples

    def _encode(self, rows: dict, gen: torch.Generator, t: torch.Tensor) -> Batch:
        """Latent draw, noise, patchify; `t` given. Draw order: latent eps, then noise."""
        d = self.data
        mean = rows["vae_mean"]
        z_eps = torch.randn(mean.shape, generator=gen)
        x0 = enc.sample_latent(mean, rows["vae_logvar"], z_eps, d.shift, d.scale)
        eps = torch.randn(mean.shape, generator=gen)
        p = self.cfg.patch
        return {
            "x0": patchify(x0, p),
            "eps": patchify(eps, p),
            "t": t,
            "txt": rows["t5"],
            "vec": rows["clip"],
        }

    def batch(self, step: int) -> Batch:
        # The stored order, split across ranks, re-looped when exhausted (no shuffling, as the reference).
        start = step * self.tier.global_batch_size + self.share.offset
        idx = np.arange(start, start + self.local) % self.train.n
        rows = self.train.rows(idx)
        gen = torch.Generator().manual_seed(seed_of(self.seed, self.rank, step))
        b = self._encode(rows, gen, t=None)
        b["t"] = torch.rand(self.local, generator=gen)
        drop = torch.rand(self.local, generator=gen) < self.data.cfg_drop
        b["txt"], b["vec"] = apply_cfg_drop(b["txt"], b["vec"], drop, self.empty_txt, self.empty_vec)
        return b

    def loss(self, model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        return flow_loss(model, batch, reduction)

    def eval_chunk(self, c: int) -> Batch:
        """Validation items [c * eval_batch, ...) with their fixed timesteps and seeded noise."""
        n = self.data.eval_batch
        items = torch.arange(c * n, min((c + 1) * n, self.n_eval))
        idx = (items // self.data.eval_repeats).numpy()
        rows = self.val.rows(idx)
        gen = torch.Generator().manual_seed(seed_of(self.seed, _EVAL_TAG, c))
        # MLCommons' COCO encodings carry each sample's timestep: those are the eval's (resolve checks
        # eval_repeats is 1 then); data without them gets (i mod 8) / 8.
        t = eval_timesteps(items) if self.val.timesteps is None else self.val.stored_timesteps(idx)
        return self._encode(rows, gen, t)

    def evaluate(self, model, autocast=None) -> float:
        # Chunks go round-robin over the ranks. Every rank runs the same number of forwards, since under
        # FSDP each forward all-gathers with every rank: a rank out of chunks repeats chunk 0 and counts
        # nothing from it.
        n_chunks = -(-self.n_eval // self.data.eval_batch)
        chunks = list(self.share.strided(n_chunks, padded=True))

        def sums(model, c):
            real = c < n_chunks
            b = {
                k: v.to(self.device, non_blocking=True) for k, v in self.eval_chunk(c if real else 0).items()
            }
            mse = per_sample_mse(model, b)
            return (mse.double().sum(), mse.numel()) if real else (mse.double().sum() * 0, 0)

        return evaluate_ratio(model, chunks, sums, self.device, self.world, autocast)


class _RandomFlow(RunData):
    def __init__(self, cfg, local_batch: int, generator, device):
        self.cfg, self.n, self.gen, self.device = cfg, local_batch, generator, device

    def batch(self, step: int) -> Batch:
        c, n, g, dev = self.cfg, self.n, self.gen, self.device
        shape = (n, c.img_len, c.in_channels)
        return {
            "x0": torch.randn(shape, generator=g, device=dev),
            "eps": torch.randn(shape, generator=g, device=dev),
            "t": torch.rand(n, generator=g, device=dev),
            "txt": torch.randn(n, c.txt_len, c.txt_dim, generator=g, device=dev),
            "vec": torch.randn(n, c.vec_dim, generator=g, device=dev),
        }

    def loss(self, model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        return flow_loss(model, batch, reduction)


# ------------------------------------------------------------------------------------------------ task


def _check_encoders(tier, split: enc.EncodedSplit) -> None:
    want_enc, want_tok = tier.data.encoders, tier.data.tokenizer
    got_enc = split.manifest.get("encoders")
    tok = split.manifest.get("tokenizer")
    got_tok = tok.get("name") if isinstance(tok, dict) else None
    for what, want, got in (("encoders", want_enc, got_enc), ("tokenizer", want_tok, got_tok)):
        if want is not None and got != want:
            raise UserError(
                f"{split.dir / 'manifest.json'}: encoded with {what} {got!r}, tier {tier.name} needs {want!r}: "
                f"prepare it again (`ttt data prepare flux --encoders {want_enc or 'FOLDER'} ...`) into a new --out"
            )


class RectifiedFlow(Task):
    metric = Metric("validation MSE of the predicted velocity (mean over samples)", higher_is_better=False)

    def data_name(self, tier) -> str | None:
        return "flux-standin-tiny" if tier.name == "tiny" else None

    def data_recipe(self, tier, source: Path) -> DataRecipe:
        """The tiny tier encodes the CC12M and COCO fixture tars under `source` (cc12m/, coco_mini/) with the
        stand-in encoders and `source`'s Llama 2 tokenizer, as `ttt data prepare flux --encoders standin
        --select tiny` does; the reference tier's encodings come from MLCommons."""
        if tier.name != "tiny":
            raise UserError(
                f"flux1 {tier.name} reads the MLCommons CC12M/COCO encodings, which no recipe here makes: "
                "`ttt data download --for flux1 --tier reference`, then `ttt data prepare flux --src "
                "<its cc12m_preprocessed or "
                "coco_preprocessed>` (or `--encoders FOLDER` on image tars), then --data flux1=DIR"
            )
        source = Path(source)
        tokenizer = source / "tokenizers" / "llama2" / "tokenizer.model"
        tar_dirs = [source / "cc12m", source / "coco_mini"]
        for p in (tokenizer, *tar_dirs):
            if not p.exists():
                raise UserError(f"--data {source}: no {p.relative_to(source)} in it (the flux1 tiny sources)")
        tars = flux_prepare.tars_of(",".join(str(d) for d in tar_dirs))

        def make(out: Path) -> None:
            encoders = flux_encoders.StandInEncoders(shapes_of(tier.model), tokenizer)
            for split in ("train", "validation"):
                flux_prepare.prepare(tars, split, encoders, Path(out), select="tiny")

        return DataRecipe(
            self.data_name(tier), "CC12M and COCO fixtures through the stand-in encoders",
            sources=(tokenizer, *tars), call=make,
        )  # fmt: skip

    def resolve(self, tier, data_dir: Path, verify: bool = True, init_checkpoint=None) -> Resolved:
        root = Path(data_dir)
        if not root.is_dir():
            raise UserError(f"--data {root} is not a folder: prepare it with `ttt data prepare flux`")
        shapes = shapes_of(tier.model)
        train = enc.EncodedSplit(root, tier.data.train_split, shapes, verify=verify)
        val = enc.EncodedSplit(root, tier.data.val_split, shapes, verify=verify)
        for split in (train, val):
            _check_encoders(tier, split)
        need = -(-tier.eval_samples // tier.data.eval_repeats)
        if val.n < need:
            raise UserError(
                f"--data {root}: {val.n} validation samples, the tier evaluates {tier.eval_samples} items "
                f"({need} samples x {tier.data.eval_repeats}): prepare the whole validation set"
            )
        if val.timesteps is not None and tier.data.eval_repeats != 1:
            raise UserError(
                f"--data {root}: the {tier.data.val_split} split fixes one eval timestep per sample (imported "
                f"from MLCommons), but tier {tier.name} evaluates each sample at {tier.data.eval_repeats}: use "
                "data prepared from tars for this tier"
            )
        return Resolved(root, train, val, enc.read_empty(root, shapes, verify=verify))

    def open(self, tier, resolved, seed: int, share: Share, device: torch.device) -> RunData:
        return _FlowData(tier, resolved, seed, share, device)

    def synthetic(self, tier, local_batch: int, generator, device) -> RunData:
        return _RandomFlow(tier.model, local_batch, generator, device)

    def flops_per_sample(self, family, tier) -> float:
        cfg = tier.model
        return family.flops_per_token(cfg, cfg.seq_len) * cfg.seq_len

    def sample_items(self, tier) -> tuple[str, int]:
        return "images", 1

    def plan_note(self, tier) -> str:
        return (
            "frozen encoders (T5-XXL, CLIP-L, the VAE): not in memory, training reads their precomputed "
            "encodings (ttt data prepare flux); the parameters above are the MMDiT's, all trained."
        )

    def baseline_loss(self, tier) -> float:
        # Predicting 0 costs E|eps - x0|^2 = 1 + E[x0^2] per element; about 2 for unit-variance latents.
        return 2.0

    def hyperparameters(self, bench, tier, accum: int) -> list[tuple[str, object]]:
        return [
            ("global_batch_size", tier.global_batch_size),
            ("gradient_accumulation_steps", accum),
            ("evaluation_frequency", tier.eval_every_samples),
            ("train_samples", tier.data.train_samples),
            ("eval_samples", tier.eval_samples),
            ("opt_base_learning_rate", tier.lr),
            ("opt_learning_rate_warmup_steps", tier.warmup_steps),
            *bench.optimizer.log_keys(),
        ]
