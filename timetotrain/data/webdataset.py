"""Raw image/caption pairs from WebDataset tars (`<key>.jpg`, `<key>.txt`, optional `<key>.json`), the layout
of CC12M (`pixparse/cc12m-wds`) and of our COCO sample, read with the standard library's tarfile.

`read_pairs(tars)` yields `Pair(key, image, caption, meta)` in stored order. A sample without a caption
(`.txt`) or without an image is a layout error: one `UserError` naming the tar and the key. An image that
does not decode (a corrupt or truncated JPEG, which crawled datasets contain) is skipped and counted in
`Skips`, whose `report()` names the keys; the caller prints it. A caption that is not valid UTF-8 is kept
with U+FFFD in place of the bad bytes, and counted and named the same way (`bad_utf8`).
"""

from __future__ import annotations

import io
import json
import tarfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from timetotrain.errors import UserError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")

MEMBER_LIMIT = 64 << 20  # one sample file (an image, a caption) of a shard


@dataclass
class Pair:
    key: str
    image: object  # PIL.Image.Image, RGB
    caption: str
    meta: dict


@dataclass
class Skips:
    """Samples left out (`undecodable`), and captions kept with replaced bytes (`bad_utf8`), by key."""

    undecodable: list[str] = field(default_factory=list)
    bad_utf8: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.undecodable)

    def report(self) -> str:
        parts = []
        if self.undecodable:
            parts.append(f"{self.count} sample(s) skipped, image does not decode: {_shown(self.undecodable)}")
        if self.bad_utf8:
            parts.append(
                f"{len(self.bad_utf8)} caption(s) not valid UTF-8, kept with U+FFFD for the bad bytes: "
                f"{_shown(self.bad_utf8)}"
            )
        return "; ".join(parts) or "no samples skipped"


def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")


def _not_utf8(name: str) -> bool:
    """tarfile decodes member names with surrogateescape: a byte that is not UTF-8 stays a lone surrogate."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _members(tar_path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) per sample, grouped by key in stored order."""
    try:
        tf = tarfile.open(tar_path)
    except (tarfile.TarError, OSError) as e:
        raise UserError(f"{tar_path}: not a readable tar ({e}): pass WebDataset .tar shards") from e
    with tf:
        key, parts = None, {}
        try:
            for m in tf:
                if not m.isfile():
                    continue
                stem, dot, ext = Path(m.name).name.partition(".")
                if not dot:
                    continue
                k = str(Path(m.name).parent / stem) if "/" in m.name else stem
                if k != key:
                    if key is not None:
                        yield key, parts
                    key, parts = k, {}
                if m.size > MEMBER_LIMIT:  # read whole into memory below: no image or caption is this large
                    raise UserError(
                        f"{tar_path}: member {m.name!r} holds {m.size:,} bytes, more than any image or caption "
                        f"of a sample ({MEMBER_LIMIT >> 20} MiB): pass WebDataset shards of images and captions"
                    )
                parts[ext.lower()] = tf.extractfile(m).read()
        except (tarfile.TarError, OSError, EOFError) as e:
            raise UserError(f"{tar_path}: the tar is truncated or corrupt after sample {key!r} ({e})") from e
        if key is not None:
            yield key, parts


def read_pairs(tars: list[Path], skips: Skips | None = None) -> Iterator[Pair]:
    skips = skips if skips is not None else Skips()
    for tar_path in tars:
        for key, parts in _members(Path(tar_path)):
            if not key.isascii() and _not_utf8(key):  # keys.txt and the summary line are UTF-8 text
                raise UserError(
                    f"{tar_path}: sample name {key.encode('utf-8', 'surrogateescape')!r} is not valid UTF-8: "
                    "rename it in the shard"
                )
            img_ext = next((e for e in IMAGE_EXTS if e in parts), None)
            if img_ext is None:
                raise UserError(
                    f"{tar_path}: sample {key!r} has no image (.jpg/.png/.webp): fix or remove the shard"
                )
            if "txt" not in parts:
                raise UserError(f"{tar_path}: sample {key!r} has no caption (.txt): fix or remove the shard")
            try:
                # PIL only warns between MAX_IMAGE_PIXELS and twice that, then decodes: both are refused,
                # before any pixel is decoded (the size is in the header), as hostile input.
                with warnings.catch_warnings():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    with Image.open(io.BytesIO(parts[img_ext])) as im:
                        image = im.convert("RGB")  # decodes fully: a truncated file fails here
            except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
                raise UserError(
                    f"{tar_path}: member {key}.{img_ext} is a decompression bomb ({str(e).split('.')[0]}): "
                    "remove it from the shard"
                ) from None
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
                skips.undecodable.append(key)
                continue
            try:
                meta = json.loads(parts["json"]) if "json" in parts else {}
            except (json.JSONDecodeError, UnicodeDecodeError):
                meta = {}
            try:
                caption = parts["txt"].decode("utf-8").strip()
            except UnicodeDecodeError:
                skips.bad_utf8.append(key)
                caption = parts["txt"].decode("utf-8", errors="replace").strip()
            yield Pair(key, image, caption, meta)
