"""The frozen encoders that turn image/caption pairs into flux1's encodings (data/flux_encodings.py).

`RealEncoders` (the benchmark's own, docs/benchmarks/flux1.md): T5 v1.1 XXL (`transformers.T5EncoderModel`, 256 tokens, last
hidden state), CLIP ViT-L/14 text (`transformers.CLIPTextModel`, 77 tokens, pooled output) and the FLUX.1 VAE
(`diffusers.AutoencoderKL`, posterior mean and log-variance of the image scaled to [-1, 1]), loaded from a
folder with `t5/`, `clip/` and `vae/` subfolders as `save_pretrained` writes them (tokenizers in `t5/` and
`clip/`). Nothing is downloaded.

`StandInEncoders` (the tiny tier): deterministic, weight-free stand-ins with the same output kinds, because
the real encoders (~5 B parameters for T5-XXL alone) could not run on the 2-core machine the tier is for,
and their weights are not reachable from it:
- image: resize to 4 x the latent size (bicubic), scale to [-1, 1], fold each 4 x 4 pixel block into 48
  values (space-to-depth) and project them with a fixed seeded orthonormal 48 -> C matrix: a latent that is
  a linear, invertible-in-expectation summary of the picture, so its structure (and its captions' relation
  to it) is real; log-variance a constant (posterior std 0.05), so the posterior draw is exercised;
- text: the caption's real Llama 2 SentencePiece ids (the tokenizer the project ships; T5 is also a
  SentencePiece model), truncated or padded to the tier's text length, looked up in a frozen seeded
  N(0, 1) table (padding: zero vectors); the pooled vector is the mean of another seeded table's rows over
  the caption's tokens (CLIP pools too). The empty prompt gives all-zero encodings.
Same seed, same inputs, same encodings on any machine (CPU fp32 arithmetic only).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from timetotrain import trees
from timetotrain.data import sentencepiece_tok
from timetotrain.data.flux_encodings import Shapes
from timetotrain.errors import UserError

STANDIN_LOGVAR = 2 * math.log(0.05)
STANDIN_SEED = 20_240_601
_FOLD = 4  # stand-in image pixels per latent position along each side


def _pixels(images, size: int) -> torch.Tensor:
    """PIL RGB images -> `[B, 3, size, size]` in [-1, 1] (bicubic resize)."""
    arrs = [np.asarray(im.resize((size, size), Image.BICUBIC), dtype=np.float32) for im in images]
    return torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2) / 127.5 - 1.0


class StandInEncoders:
    """The tiny tier's deterministic stand-ins (module docstring)."""

    name = "standin"

    def __init__(self, shapes: Shapes, tokenizer_model: Path | str, seed: int = STANDIN_SEED):
        self.shapes = shapes
        self.tok = sentencepiece_tok.load(tokenizer_model)
        vocab = self.tok.processor.get_piece_size()
        g = torch.Generator().manual_seed(seed)
        c = shapes.latent[0]
        q, _ = torch.linalg.qr(torch.randn(3 * _FOLD * _FOLD, c, generator=g))
        self.proj = q.T.contiguous()  # [C, 48], orthonormal rows
        self.t5_table = torch.randn(vocab, shapes.t5[1], generator=g)
        self.clip_table = torch.randn(vocab, shapes.clip[0], generator=g)

    def identity(self) -> dict:
        return {"encoders": self.name, "seed": STANDIN_SEED, "tokenizer": self.tok.identity()}

    def images(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        c, h, w = self.shapes.latent
        px = _pixels(images, h * _FOLD)
        folded = F.pixel_unshuffle(px, _FOLD)  # [B, 48, h, w]
        mean = torch.einsum("ck,bkhw->bchw", self.proj, folded)
        return mean, torch.full_like(mean, STANDIN_LOGVAR)

    def texts(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.shapes.t5[0]
        t5 = torch.zeros(len(captions), L, self.shapes.t5[1])
        clip = torch.zeros(len(captions), self.shapes.clip[0])
        for i, ids in enumerate(self.tok.encode_batch(captions)):
            ids = torch.tensor(ids[:L], dtype=torch.long)
            if len(ids):
                t5[i, : len(ids)] = self.t5_table[ids]
                clip[i] = self.clip_table[ids].mean(0)
        return t5, clip


def check_encoder_files(folder: Path) -> None:
    """Before anything is loaded: every file of the encoder folder lies inside it (no symlink out), and
    each model has safetensors weights (transformers and diffusers would otherwise unpickle a .bin)."""
    for p in sorted(folder.rglob("*")):
        trees.check_inside(p, folder, "copy the encoder files into --encoders")
    for sub in ("t5", "clip", "vae"):
        if not list((folder / sub).glob("*.safetensors")):
            raise UserError(
                f"--encoders {folder}: {sub}/ has no *.safetensors weights; ttt loads no pickled weights "
                "(.bin/.pt): save the model with save_pretrained(..., safe_serialization=True)"
            )


class RealEncoders:
    """T5 / CLIP text encoders and the VAE from local `save_pretrained` folders (module docstring)."""

    name = "real"

    def __init__(self, folder: Path | str, shapes: Shapes, device: str = "cpu"):
        try:
            import transformers  # optional (flux-encoders extra): only --encoders DIR
            from diffusers.utils import logging as diffusers_logging

            # diffusers probes an installed torchao (ttt's fp8 extra) and warns about its own version
            # mismatch on stderr; a data command's stderr is its progress and its one-line errors.
            diffusers_logging.set_verbosity_error()
            logging.getLogger("torchao").setLevel(logging.ERROR)
            from diffusers import AutoencoderKL
        except ImportError as e:
            raise UserError(
                f"--encoders {folder} needs transformers and diffusers ({e}): pip install 'timetotrain[flux-encoders]'"
            ) from e
        folder = Path(folder)
        for sub in ("t5", "clip", "vae"):
            if not (folder / sub / "config.json").is_file():
                raise UserError(
                    f"--encoders {folder}: no {sub}/config.json: the folder needs t5/, clip/ and vae/ as "
                    "save_pretrained writes them (T5EncoderModel, CLIPTextModel, diffusers AutoencoderKL)"
                )
        check_encoder_files(folder)
        self.folder, self.shapes, self.device = folder, shapes, device
        # Weights from safetensors only (a pickled .bin is never read), nothing fetched, no code run.
        load = {"use_safetensors": True, "local_files_only": True}
        self.t5_tok = transformers.AutoTokenizer.from_pretrained(folder / "t5", local_files_only=True)
        self.t5 = transformers.T5EncoderModel.from_pretrained(folder / "t5", **load).to(device).eval()
        self.clip_tok = transformers.AutoTokenizer.from_pretrained(folder / "clip", local_files_only=True)
        self.clip = transformers.CLIPTextModel.from_pretrained(folder / "clip", **load).to(device).eval()
        self.vae = AutoencoderKL.from_pretrained(folder / "vae", **load).to(device).eval()

    def identity(self) -> dict:
        return {"encoders": self.name, "folder": str(self.folder)}

    @torch.no_grad()
    def images(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        c, h, w = self.shapes.latent
        scale = 2 ** (len(self.vae.config.block_out_channels) - 1)  # the VAE's downsampling
        px = _pixels(images, h * scale).to(self.device)
        dist = self.vae.encode(px).latent_dist
        return dist.mean.float().cpu(), dist.logvar.float().cpu()

    @torch.no_grad()
    def texts(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.shapes.t5[0]
        t = self.t5_tok(captions, max_length=L, padding="max_length", truncation=True, return_tensors="pt")
        t5 = self.t5(input_ids=t.input_ids.to(self.device)).last_hidden_state
        max_clip = self.clip.config.max_position_embeddings
        c = self.clip_tok(
            captions, max_length=max_clip, padding="max_length", truncation=True, return_tensors="pt"
        )
        clip = self.clip(input_ids=c.input_ids.to(self.device)).pooler_output
        return t5.float().cpu(), clip.float().cpu()
