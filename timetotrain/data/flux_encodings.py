"""The encoded text-to-image dataset flux1 trains and evaluates on: per sample, the text encoder's hidden
states (T5), the pooled text vector (CLIP) and the VAE posterior's mean and log-variance, as MLCommons'
preprocessed CC12M / COCO data provides them (docs/benchmarks/flux1.md), plus the empty prompt's encodings for
the classifier-free-guidance drop.

On disk (one folder per split, written by `ttt data prepare flux`: data/flux_prepare.py encodes
image/caption tars, data/flux_mlcommons.py imports MLCommons' preprocessed download):

    <root>/<split>/manifest.json     {"samples": N, "fields": {name: {"shape": [...], "dtype": "..."}}, ...}
    <root>/<split>/keys.txt          the sample keys (tar member stems / `__key__`), one a line, stored order
    <root>/<split>/t5.npy            [N, L, D_t5]      bfloat16
    <root>/<split>/clip.npy          [N, D_clip]       bfloat16
    <root>/<split>/vae_mean.npy      [N, C, H, W]      bfloat16
    <root>/<split>/vae_logvar.npy    [N, C, H, W]      bfloat16
    <root>/<split>/timestep.npy      [N] int32, only when the source fixes each sample's eval timestep
                                     (MLCommons' COCO validation set): t = timestep / manifest
                                     ["timesteps"]["divisor"] (8)
    <root>/empty_encodings/t5_empty.npy, clip_empty.npy   [L, D_t5], [D_clip] (the encoders' empty prompt;
                                     MLCommons' files, [1, L, D_t5] and [1, D_clip], are accepted too),
                                     dtype.txt (their dtype; without it, the arrays' own float dtype)

bfloat16 arrays are stored as their uint16 bit patterns (numpy has no bfloat16) and read back bit-exactly;
the manifest records the logical dtype. One memory-mapped file per field keeps reading a sample O(1)
without opening millions of files, and is what the training loop reads whatever the source was.

MLCommons' preprocessed download is a different layout (a Hugging Face `datasets` folder of Arrow files, one
row per sample, each encoding an `np.save` blob of its bfloat16 bits); data/flux_mlcommons.py describes it and
imports it into this one bit for bit, keys and stored timesteps included.

The latent a training step sees is sampled from the posterior (`sample_latent`): z = mean + exp(logvar / 2)
eps, then normalised (z - shift) * scale (FLUX.1 VAE: shift 0.1159, scale 0.3611).
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from timetotrain import fileio
from timetotrain.data import npy
from timetotrain.data.finite import check_finite
from timetotrain.data.manifest import manifest_problem, sha256_file, verify_manifest
from timetotrain.data.mapped import MappedFiles
from timetotrain.errors import UserError

FIELDS = ("t5", "clip", "vae_mean", "vae_logvar")
EMPTY_DIR = "empty_encodings"
TIMESTEP_FILE = "timestep.npy"
TIMESTEP_DIVISOR = 8  # stored eval timesteps are 0..7, t = stored / 8 (the reference's 8 balanced values)
_REPREPARE = "re-run `ttt data prepare flux` into a new --out"
DTYPES = {
    "bfloat16": (np.uint16, torch.bfloat16),
    "float16": (np.float16, None),
    "float32": (np.float32, None),
    "float64": (np.float64, None),
}


def to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    """A tensor in the stored form of `dtype` (bfloat16 as its uint16 bits)."""
    if dtype == "bfloat16":
        return t.detach().to(torch.bfloat16).contiguous().view(torch.uint16).cpu().numpy()
    return t.detach().to(getattr(torch, dtype)).cpu().numpy()


def to_tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    """The stored array as a tensor of its logical dtype (bfloat16 reinterpreted from its bits). A read-only
    array (a slice of the mapped file) is copied: torch does not take one without a warning that the user
    then sees on every run, and every caller copies it into float32 anyway."""
    a = np.ascontiguousarray(a)
    t = torch.from_numpy(a if a.flags.writeable else a.copy())
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


def _write_manifest(
    staged: fileio.Staged, d: Path, n: int, fields: dict, meta: dict, files: dict | None = None
) -> None:
    """`files`: name -> {bytes, sha256} of the split's other files (hashed here from their staged
    temporaries when not given), which a run's preflight checks as C4's manifest is checked."""
    if files is None:
        files = {}
        for name in (*(f"{f}.npy" for f in FIELDS), "keys.txt", TIMESTEP_FILE):
            tmp = staged.current(d / name)
            if tmp.is_file() and tmp != d / name:  # written in this set (an old timestep.npy is not ours)
                files[name] = {"bytes": tmp.stat().st_size, "sha256": sha256_file(tmp)}
    manifest = {
        "samples": n,
        "fields": fields,
        **{k: v for k, v in meta.items() if k != "dtypes"},
        "files": files,
    }
    with staged.open(d / "manifest.json", "w") as out:
        out.write(json.dumps(manifest, indent=1) + "\n")


class _Hashing:
    """A write-only file that hashes what it writes: a multi-terabyte import is hashed in the one pass
    that writes it."""

    def __init__(self, f):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.h.update(data)
        self.n += memoryview(data).nbytes
        return self.f.write(data)

    def close(self) -> None:
        self.f.close()

    def entry(self) -> dict:
        return {"bytes": self.n, "sha256": self.h.hexdigest()}


def _manifest_of(d: Path, empty: bool = False):
    """The split's manifest (`empty`: the empty encodings' checksums alone), checked for what the reader
    indexes; a one-line UserError otherwise."""
    path = d / "manifest.json"
    try:
        doc = json.loads(fileio.read_bounded(path, fileio.SMALL_FILE, "manifest").decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path} is unreadable ({type(e).__name__}: {str(e)[:100]}): {_REPREPARE}") from None

    def problem() -> str:
        if not isinstance(doc, dict):
            return f"a JSON {type(doc).__name__}, not an object"
        if empty:
            return manifest_problem(doc, tokenized=False)
        n = doc.get("samples")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return f"`samples` is {n!r}, not a sample count"
        fields = doc.get("fields")
        if not isinstance(fields, dict):
            return "no `fields` object"
        for f in FIELDS:
            if not isinstance(fields.get(f), dict) or fields[f].get("dtype") not in DTYPES:
                return f"`fields.{f}.dtype` is not one of {', '.join(DTYPES)}"
        ts = doc.get("timesteps")
        if ts:
            div = ts.get("divisor") if isinstance(ts, dict) else None
            file = ts.get("file") if isinstance(ts, dict) else None
            if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                return "`timesteps.file` is not a file name in the split's folder"
            if not isinstance(div, int) or isinstance(div, bool) or div < 1:
                return f"`timesteps.divisor` is {div!r}, not a positive integer"
        if "files" in doc:
            return manifest_problem(doc, tokenized=False)
        return ""

    why = problem()
    if why:
        raise UserError(f"{path} is not a valid manifest: {why}; {_REPREPARE}")
    return doc


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
                npy.save(f, a)
            fields[field] = {"shape": list(a.shape[1:]), "dtype": meta["dtypes"][field]}
        with staged.open(d / "keys.txt", "w") as out:
            out.write("".join(k + "\n" for k in keys))
        _write_manifest(staged, d, len(keys), fields, meta)
    return d


class SplitStream:
    """One split written sample by sample, for sources larger than memory (MLCommons' 1.1 M CC12M samples
    are about 2.5 TB): each field's .npy gets its header for `n` samples first, then every sample's stored
    bytes in order, sequentially (no sparse preallocation, no page-cache-sized mapping). `finish` adds the
    keys' count check, the stored timesteps and the manifest; all files appear together (fileio.Staged), and
    none if the `with` block is left by an error or a signal.

        with SplitStream(root, split, n, shapes) as out:
            for key, arrays in samples:
                out.add(key, arrays)      # arrays in stored form (uint16 bits), C order, checked shapes
            out.finish(meta, timesteps)
    """

    def __init__(self, root: Path, split: str, n: int, shapes: Shapes, dtype: str = "bfloat16"):
        self.dir, self.n, self.shapes, self.dtype = Path(root) / split, n, shapes, dtype
        self.count = 0
        self._staged = fileio.Staged()
        self._out: dict = {}
        self._done = False

    def __enter__(self) -> SplitStream:
        self.dir.mkdir(parents=True, exist_ok=True)
        descr = np.lib.format.dtype_to_descr(np.dtype(DTYPES[self.dtype][0]))
        try:
            for f in FIELDS:
                fh = self._out[f] = _Hashing(self._staged.open(self.dir / f"{f}.npy", "wb"))
                header = {"descr": descr, "fortran_order": False, "shape": (self.n, *self.shapes.of(f))}
                buf = io.BytesIO()
                np.lib.format.write_array_header_1_0(buf, header)
                fh.write(buf.getvalue())
            self._out["keys"] = _Hashing(self._staged.open(self.dir / "keys.txt", "wb"))
        except BaseException:
            self._close()
            self._staged.discard()
            raise
        return self

    def add(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        """One sample, its arrays already checked by the caller (shape, stored dtype, C-contiguous)."""
        for f in FIELDS:
            self._out[f].write(arrays[f].data)
        self._out["keys"].write((key + "\n").encode())
        self.count += 1

    def finish(self, meta: dict, timesteps: np.ndarray | None = None) -> None:
        if self.count != self.n:
            raise UserError(
                f"{self.dir}: {self.count} samples written for {self.n} counted: did the source change?"
            )
        fields = {f: {"shape": list(self.shapes.of(f)), "dtype": self.dtype} for f in FIELDS}
        meta = dict(meta)
        files = {(f"{k}.npy" if k != "keys" else "keys.txt"): fh.entry() for k, fh in self._out.items()}
        if timesteps is not None:
            ts = np.ascontiguousarray(timesteps, dtype=np.int32)
            with self._staged.open(self.dir / TIMESTEP_FILE, "wb") as f:
                npy.save(f, ts)
            tmp = self._staged.current(self.dir / TIMESTEP_FILE)
            files[TIMESTEP_FILE] = {"bytes": tmp.stat().st_size, "sha256": sha256_file(tmp)}
            meta["timesteps"] = {
                "file": TIMESTEP_FILE,
                "divisor": TIMESTEP_DIVISOR,
                "counts": np.bincount(ts, minlength=TIMESTEP_DIVISOR).tolist(),
                # whether the stored values are what our sampler would give without them, (i mod 8):
                "equal_to_index_mod_divisor": bool(np.array_equal(ts, np.arange(len(ts)) % TIMESTEP_DIVISOR)),
            }
        self._close()
        _write_manifest(self._staged, self.dir, self.n, fields, meta, files)
        self._done = True

    def _close(self) -> None:
        for fh in self._out.values():
            fh.close()
        self._out = {}

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close()
        if exc_type is None and self._done:
            self._staged.commit()
        else:
            self._staged.discard()


def write_empty(root: Path, t5: np.ndarray, clip: np.ndarray, dtype: str) -> None:
    d = Path(root) / EMPTY_DIR
    d.mkdir(parents=True, exist_ok=True)
    with fileio.Staged() as staged:
        for name, a in (("t5_empty.npy", t5), ("clip_empty.npy", clip)):
            with staged.open(d / name, "wb") as f:
                npy.save(f, a)
        with staged.open(d / "dtype.txt", "w") as out:
            out.write(dtype + "\n")
        files = {}
        for name in ("t5_empty.npy", "clip_empty.npy", "dtype.txt"):
            tmp = staged.current(d / name)
            files[name] = {"bytes": tmp.stat().st_size, "sha256": sha256_file(tmp)}
        staged.write_text(d / "manifest.json", json.dumps({"files": files}, indent=1) + "\n")


class EncodedSplit:
    """One split, memory-mapped. `rows(idx)` -> dict of fp32 tensors; `timesteps` the source's fixed eval
    timesteps (int array, t = timesteps / `timestep_divisor`) or None."""

    def __init__(self, root: Path, split: str, shapes: Shapes, verify: bool = False):
        d = Path(root) / split
        man = d / "manifest.json"
        if not man.is_file():
            raise UserError(
                f"--data {root}: no {split}/manifest.json: write it with `ttt data prepare flux --split {split}`"
            )
        self.dir, self.manifest = d, _manifest_of(d)
        if "files" not in self.manifest:
            warnings.warn(
                f"{man} lists no checksums (prepared by an older version): {split} not verified", stacklevel=2
            )
        elif verify:  # sizes, then sha256s, before anything is mapped: the same one-line errors as C4's
            verify_manifest(d, self.manifest)
        self.n = self.manifest["samples"]
        if not (d / "keys.txt").is_file():
            raise UserError(f"--data {root}: {split}/keys.txt is missing: {_REPREPARE}")
        self.keys = fileio.read_bounded(d / "keys.txt", fileio.LARGE_FILE, "key list").decode().split()
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
            check_finite(path, a, _REPREPARE, lambda c, dt=dtype: to_tensor(c, dt).float().numpy())
            self.arrays[f], self.dtypes[f] = a, dtype
        if len(self.keys) != self.n:
            raise UserError(f"{d / 'keys.txt'}: {len(self.keys)} keys for {self.n} samples: re-run prepare")
        self.timesteps: np.ndarray | None = None
        self.timestep_divisor = TIMESTEP_DIVISOR
        ts = self.manifest.get("timesteps")
        if ts:
            path = d / ts["file"]
            try:
                a = np.load(path, allow_pickle=False) if path.is_file() else None  # [N] int32: read whole
            except (ValueError, OSError, EOFError) as e:  # an object (pickled) array is refused
                raise UserError(f"{path}: not a numeric .npy array ({e}): re-run prepare") from None
            if a is None or a.shape != (self.n,) or a.dtype.kind not in "iu":
                got = "missing" if a is None else f"{list(a.shape)} {a.dtype}"
                raise UserError(f"{path}: {got}, the manifest promises [{self.n}] int32: re-run prepare")
            self.timesteps, self.timestep_divisor = a, ts["divisor"]

    def files(self) -> list[Path]:
        extra = [self.dir / self.manifest["timesteps"]["file"]] if self.timesteps is not None else []
        return [self.dir / f"{f}.npy" for f in FIELDS] + extra + [self.dir / "manifest.json"]

    def rows(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """Samples `idx` (numpy ints) of every field, as fp32 tensors `[len(idx), ...]`."""
        self.mapped.check_unchanged()
        return {f: to_tensor(self.arrays[f][idx], self.dtypes[f]).float() for f in FIELDS}

    def stored_timesteps(self, idx: np.ndarray) -> torch.Tensor:
        """The source's fixed timesteps of samples `idx`, as fp32 t in [0, 1)."""
        return torch.from_numpy(self.timesteps[idx].astype(np.float32)) / self.timestep_divisor


def _unbatched(a: np.ndarray, want: tuple[int, ...]) -> np.ndarray:
    """MLCommons' empty encodings carry a leading batch dim of 1 (the reference indexes [0]); ours do not."""
    return a[0] if a.ndim == len(want) + 1 and a.shape[0] == 1 else a


def read_empty_arrays(d: Path, shapes: Shapes) -> tuple[np.ndarray, np.ndarray, str]:
    """The empty-prompt encodings in folder `d`, batch dim dropped, in their stored form, and their dtype:
    dtype.txt's, or without it the arrays' own float dtype (MLCommons' files: a real float array each)."""
    try:
        t5, clip = (
            npy.load_small(d / "t5_empty.npy", "empty-prompt encoding"),
            npy.load_small(d / "clip_empty.npy", "empty-prompt encoding"),
        )
    except FileNotFoundError as e:
        raise UserError(
            f"{d}: no {Path(e.filename).name} in it: the empty-prompt encodings are incomplete"
        ) from e
    except ValueError as e:
        raise UserError(f"{d}: the empty-prompt encodings are not .npy arrays ({e})") from e
    t5, clip = _unbatched(t5, shapes.t5), _unbatched(clip, shapes.clip)
    if t5.shape != shapes.t5 or clip.shape != shapes.clip:
        raise UserError(
            f"{d}: empty-prompt encodings {list(t5.shape)}, {list(clip.shape)}; this tier needs "
            f"{list(shapes.t5)}, {list(shapes.clip)} (or with a leading batch dim of 1)"
        )
    if (d / "dtype.txt").is_file():
        dtype = fileio.read_bounded(d / "dtype.txt", fileio.SMALL_FILE, "dtype file").decode().strip()
    else:
        dtype = str(np.result_type(t5, clip))
        if t5.dtype.kind != "f" or clip.dtype.kind != "f" or dtype not in DTYPES:
            raise UserError(
                f"{d}: empty-prompt encodings of dtype {t5.dtype}, {clip.dtype} and no dtype.txt: expected a "
                f"real float array each ({', '.join(k for k in DTYPES if k != 'bfloat16')})"
            )
        t5, clip = t5.astype(dtype), clip.astype(dtype)
    store = DTYPES.get(dtype, (None,))[0]
    if t5.dtype != store or clip.dtype != store:
        raise UserError(
            f"{d}: dtype.txt says {dtype}, the arrays are {t5.dtype}, {clip.dtype}: re-run prepare"
        )
    return t5, clip, dtype


def read_empty(root: Path, shapes: Shapes, verify: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    d = Path(root) / EMPTY_DIR
    if not d.is_dir():
        raise UserError(f"--data {root}: no {EMPTY_DIR}/: re-run `ttt data prepare flux`")
    if verify and (d / "manifest.json").is_file():  # (folders written before checksums have none)
        verify_manifest(d, _manifest_of(d, empty=True))
    t5, clip, dtype = read_empty_arrays(d, shapes)
    out = to_tensor(t5, dtype).float(), to_tensor(clip, dtype).float()
    for name, t in zip(("t5_empty.npy", "clip_empty.npy"), out, strict=True):
        check_finite(d / name, t.numpy()[None], _REPREPARE)
    return out


def sample_latent(
    mean: torch.Tensor, logvar: torch.Tensor, eps: torch.Tensor, shift: float, scale: float
) -> torch.Tensor:
    """A draw from the VAE posterior, normalised: ((mean + exp(logvar / 2) eps) - shift) * scale."""
    return (mean + torch.exp(0.5 * logvar) * eps - shift) * scale
