"""`ttt data prepare flux`: image/caption WebDataset tars -> the encoded layout of data/flux_encodings.py, with
the real frozen encoders (`--encoders FOLDER`) or the tiny tier's stand-ins (`--encoders standin`).

`select="tiny"` picks the tiny tier's split from the shared fixtures: samples whose `.json` names
`coco_split: val2017` are the validation set, every other sample (CC12M, COCO train2017) is training data.
Samples are encoded in stored order, in batches; each encoding's shape is checked against the tier's (the
error names the sample), undecodable images are skipped and counted (data/webdataset.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from timetotrain.data import flux_encodings as enc
from timetotrain.data.webdataset import Skips, read_pairs
from timetotrain.errors import UserError
from timetotrain.progress import LiveLine

DTYPE = "bfloat16"  # the dtype of MLCommons' preprocessed encodings


def _keep(pair, split: str, select: str) -> bool:
    if select == "all":
        return True
    is_val = pair.meta.get("coco_split") == "val2017"
    return is_val if split == "validation" else not is_val


def tars_of(src: str) -> list[Path]:
    """`--src`: tar files and folders of tars, comma-separated."""
    out: list[Path] = []
    for part in filter(None, (s.strip() for s in src.split(","))):
        p = Path(part)
        if p.is_dir():
            found = sorted(p.glob("*.tar"))
            if not found:
                raise UserError(f"--src {p}: the folder has no .tar shards")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise UserError(f"--src {p} does not exist: pass WebDataset .tar files or folders of them")
    if not out:
        raise UserError("--src is empty: pass WebDataset .tar files or folders of them")
    return out


def prepare(tars: list[Path], split: str, encoders, out: Path, select: str = "all", batch: int = 16) -> dict:
    shapes = encoders.shapes
    keys: list[str] = []
    cols: dict[str, list[np.ndarray]] = {f: [] for f in enc.FIELDS}
    skips = Skips()
    line = LiveLine()

    def flush(pairs):
        mean, logvar = encoders.images([p.image for p in pairs])
        t5, clip = encoders.texts([p.caption for p in pairs])
        for i, p in enumerate(pairs):
            arrays = {"t5": t5[i], "clip": clip[i], "vae_mean": mean[i], "vae_logvar": logvar[i]}
            enc.check_sample(p.key, arrays, shapes)
        for f, t in zip(enc.FIELDS, (t5, clip, mean, logvar), strict=True):
            cols[f].append(enc.to_numpy(t, DTYPE))
        keys.extend(p.key for p in pairs)
        line.update(f"flux {split}: {len(keys):,} samples encoded, {skips.count} skipped")

    pending = []
    for pair in read_pairs(tars, skips):
        if not _keep(pair, split, select):
            continue
        pending.append(pair)
        if len(pending) == batch:
            flush(pending)
            pending = []
    if pending:
        flush(pending)
    if keys:  # the count that was written, also where the last unforced update was skipped (a pipe)
        line.update(f"flux {split}: {len(keys):,} samples encoded, {skips.count} skipped", force=True)
    line.close()
    if not keys:
        names = ", ".join(str(t) for t in tars)
        raise UserError(
            f"--src {names}: no {split} samples found ({skips.report()}): pass shards that hold some"
        )
    arrays = {f: np.concatenate(cols[f]) for f in enc.FIELDS}
    meta = {
        "dtypes": dict.fromkeys(enc.FIELDS, DTYPE),
        "split": split,
        "select": select,
        "sources": [Path(t).name for t in tars],
        "skipped_undecodable": skips.undecodable,
        "captions_not_utf8": skips.bad_utf8,
        **encoders.identity(),
    }
    enc.write_split(out, split, keys, arrays, meta)
    t5_empty, clip_empty = encoders.texts([""])
    enc.write_empty(out, enc.to_numpy(t5_empty[0], DTYPE), enc.to_numpy(clip_empty[0], DTYPE), DTYPE)
    return {"samples": len(keys), "skips": skips}
