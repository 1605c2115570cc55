"""The encoded text-to-image dataset flux1 trains and evaluates on: per sample, the text encoder's hidden
states (T5), the pooled text vector (CLIP) and the VAE posterior's mean and log-variance, as MLCommons'
preprocessed CC12M / COCO data provides them (benchmarks spec §11.2), plus the empty prompt's encodings for
the classifier-free-guidance drop.

On disk (one folder per split, written by `ttt data prepare flux`, data/flux_prepare.py):

    <root>/<split>/manifest.json     {"samples": N, "fields": {name: {"shape": [...], "dtype": "..."}}, ...}
    <root>/<split>/keys.txt          the sample keys (tar member stems), one a line, in stored order
    <root>/<split>/t5.npy            [N, L, D_t5]      bfloat16
    <root>/<split>/clip.npy          [N, D_clip]       bfloat16
    <root>/<split>/vae_mean.npy      [N, C, H, W]      bfloat16
    <root>/<split>/vae_logvar.npy    [N, C, H, W]      bfloat16
    <root>/empty_encodings/t5_empty.npy, clip_empty.npy   [L, D_t5], [D_clip] (the encoders' empty prompt)

bfloat16 arrays are stored as their uint16 bit patterns (numpy has no bfloat16) and read back bit-exactly;
the manifest records the logical dtype. One memory-mapped file per field keeps reading a sample O(1)
without opening millions of files; MLCommons' per-sample arrays go in through `write_split` as they are
(no re-encoding). The exact on-disk layout of MLCommons' preprocessed download is not
pinned by the spec we follow, only its content and dtypes; this layout carries that content.

The latent a training step sees is sampled from the posterior (`sample_latent`): z = mean + exp(logvar / 2)
eps, then normalised (z - shift) * scale (FLUX.1 VAE: shift 0.1159, scale 0.3611).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from timetotrain import fileio
from timetotrain.data.mapped import MappedFiles
from timetotrain.errors import UserError

FIELDS = ("t5", "clip", "vae_mean", "vae_logvar")
EMPTY_DIR = "empty_encodings"
DTYPES = {
    "bfloat16": (np.uint16, torch.bfloat16),
    "float16": (np.float16, None),
    "float32": (np.float32, None),
}


def to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    """A tensor in the stored form of `dtype` (bfloat16 as its uint16 bits)."""
    if dtype == "bfloat16":
        return t.detach().to(torch.bfloat16).contiguous().view(torch.uint16).cpu().numpy()
    return t.detach().to(getattr(torch, dtype)).cpu().numpy()


def to_tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    """The stored array as a tensor of its logical dtype (bfloat16 reinterpreted from its bits)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


@dataclass(frozen=True)
class Shapes:
    """Per-sample shapes of the four fields, which a tier's model fixes."""

    t5: tuple[int, int]
    clip: tuple[int]
    latent: tuple[int, int, int]

    def of(self, field: str) -> tuple[int, ...]:
        return {"t5": self.t5, "clip": self.clip, "vae_mean": self.latent, "vae_logvar": self.latent}[field]


def check_sample(key: str, arrays: dict[str, torch.Tensor], shapes: Shapes) -> None:
    """One sample's encodings against the expected shapes; the error names the sample."""
    for f in FIELDS:
        got = tuple(arrays[f].shape)
        if got != shapes.of(f):
            raise UserError(
                f"sample {key!r}: {f} encoding has shape {list(got)}, expected {list(shapes.of(f))}: the "
                "encoders do not produce this tier's shapes (check --encoders and the image size)"
            )


def write_split(root: Path, split: str, keys: list[str], arrays: dict[str, np.ndarray], meta: dict) -> Path:
    """Write one split (arrays already in stored form, first dim = samples) and its manifest. The files
    appear together or not at all (fileio.Staged): an interrupted prepare leaves no half split."""
    d = Path(root) / split
    d.mkdir(parents=True, exist_ok=True)
    fields = {}
    with fileio.Staged() as staged:
        for field in FIELDS:
            a = arrays[field]
            if a.shape[0] != len(keys):
                raise ValueError(f"{field}: {a.shape[0]} rows for {len(keys)} keys")
            with staged.open(d / f"{field}.npy", "wb") as f:  # a file object: np.save adds no second .npy
                np.save(f, a)
            fields[field] = {"shape": list(a.shape[1:]), "dtype": meta["dtypes"][field]}
        with staged.open(d / "keys.txt", "w") as out:
            out.write("".join(k + "\n" for k in keys))
        manifest = {
            "samples": len(keys),
            "fields": fields,
            **{k: v for k, v in meta.items() if k != "dtypes"},
        }
        with staged.open(d / "manifest.json", "w") as out:
            out.write(json.dumps(manifest, indent=1) + "\n")
    return d


def write_empty(root: Path, t5: np.ndarray, clip: np.ndarray, dtype: str) -> None:
    d = Path(root) / EMPTY_DIR
    d.mkdir(parents=True, exist_ok=True)
    with fileio.Staged() as staged:
        for name, a in (("t5_empty.npy", t5), ("clip_empty.npy", clip)):
            with staged.open(d / name, "wb") as f:
                np.save(f, a)
        with staged.open(d / "dtype.txt", "w") as out:
            out.write(dtype + "\n")


class EncodedSplit:
    """One split, memory-mapped. `sample(i)` -> dict of tensors in their logical dtypes."""

    def __init__(self, root: Path, split: str, shapes: Shapes):
        d = Path(root) / split
        man = d / "manifest.json"
        if not man.is_file():
            raise UserError(
                f"--data {root}: no {split}/manifest.json: write it with `ttt data prepare flux --split {split}`"
            )
        self.dir, self.manifest = d, json.loads(man.read_text())
        self.n = int(self.manifest["samples"])
        self.keys = (d / "keys.txt").read_text().split()
        self.arrays: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, str] = {}
        self.mapped = MappedFiles()  # read during the timed run: checked before each read (no SIGBUS)
        for f in FIELDS:
            path = d / f"{f}.npy"
            if not path.is_file():
                raise UserError(f"--data {root}: {split}/{f}.npy is missing: re-run `ttt data prepare flux`")
            a = self.mapped.load(path)
            dtype = self.manifest["fields"][f]["dtype"]
            want = (self.n, *shapes.of(f))
            if a.shape != want or a.dtype != DTYPES[dtype][0]:
                first = self.keys[0] if self.keys else "?"
                raise UserError(
                    f"{path}: encodings of shape {list(a.shape)} ({a.dtype}), this tier needs {list(want)} "
                    f"({dtype}) (first sample {first!r}): prepare the data for this tier's encoders"
                )
            self.arrays[f], self.dtypes[f] = a, dtype
        if len(self.keys) != self.n:
            raise UserError(f"{d / 'keys.txt'}: {len(self.keys)} keys for {self.n} samples: re-run prepare")

    def files(self) -> list[Path]:
        return [self.dir / f"{f}.npy" for f in FIELDS] + [self.dir / "manifest.json"]

    def rows(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """Samples `idx` (numpy ints) of every field, as fp32 tensors `[len(idx), ...]`."""
        self.mapped.check_unchanged()
        return {f: to_tensor(self.arrays[f][idx], self.dtypes[f]).float() for f in FIELDS}


def read_empty(root: Path, shapes: Shapes) -> tuple[torch.Tensor, torch.Tensor]:
    d = Path(root) / EMPTY_DIR
    try:
        dtype = (d / "dtype.txt").read_text().strip()
        t5, clip = np.load(d / "t5_empty.npy"), np.load(d / "clip_empty.npy")
    except FileNotFoundError as e:
        raise UserError(
            f"--data {root}: {EMPTY_DIR}/ is incomplete ({Path(e.filename).name}): re-run prepare"
        ) from e
    if t5.shape != shapes.t5 or clip.shape != shapes.clip:
        raise UserError(
            f"{d}: empty-prompt encodings {list(t5.shape)}, {list(clip.shape)}; this tier needs "
            f"{list(shapes.t5)}, {list(shapes.clip)}"
        )
    return to_tensor(t5, dtype).float(), to_tensor(clip, dtype).float()


def sample_latent(
    mean: torch.Tensor, logvar: torch.Tensor, eps: torch.Tensor, shift: float, scale: float
) -> torch.Tensor:
    """A draw from the VAE posterior, normalised: ((mean + exp(logvar / 2) eps) - shift) * scale."""
    return (mean + torch.exp(0.5 * logvar) * eps - shift) * scale
