"""safetensors files read and written by row ranges: a whole-file check of the layout before anything parses
it (a Hugging Face download, a ttt checkpoint's table shards: untrusted input), a writer that streams a
tensor's rows in chunks, and a reader of one row range of one tensor.

Why our own writer and reader and not the safetensors library's: `save_file` builds every tensor's bytes in
host memory before writing (a rank's share of dlrmv4's tables is tens of GB, on the GPU), and reading a row
range should read those rows' bytes, nothing more. The format is the library's (8-byte header length, JSON
header, raw little-endian data), so `safe_open` reads what this writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from timetotrain import fileio
from timetotrain.errors import UserError

_MAX_HEADER = 100 << 20  # the safetensors library's own limit on the JSON header

# Ours to write and read back; the library's names.
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
_TORCH = {name: dtype for dtype, name in DTYPES.items()}


def check_safetensors_layout(file: Path) -> tuple[dict, int]:
    """Before the safetensors library parses `file` (its errors are tracebacks, not one line): the 8-byte
    header length, the JSON header, and every tensor's byte range must fit the file, and the data must end
    where the file does. Reads the header only (no sha256 is known for a downloaded checkpoint; a `ttt base`
    folder's weights are hashed against its base.json first, in `base_model.check_init_base`). Returns the
    header ({name: {"dtype", "shape", "data_offsets"}, ...}) and the byte at which the data begins."""
    size = file.stat().st_size

    def bad(why: str) -> UserError:
        return UserError(
            f"{file}: not a whole safetensors file ({why}); re-download or re-save the checkpoint"
        )

    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(_MAX_HEADER, size - 8):
            raise bad(f"{size:,} bytes, header length {n:,}")
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
            starts = [int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise bad(f"unreadable header: {exc}") from None
    if any(a < 0 or b < a for a, b in zip(starts, ends, strict=True)) or 8 + n + max(ends, default=0) != size:
        raise bad(
            f"{size:,} bytes, the header describes {8 + n + max(ends, default=0):,}: truncated or garbled"
        )
    return header, 8 + n


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], chunk_rows: int) -> None:
    """`tensors` (name, tensor of a dtype in DTYPES, on any device) as one safetensors file at `path`,
    written atomically (fsynced, then renamed), `chunk_rows` rows at a time: host memory holds one chunk."""
    header, at = {}, 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        at += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library writes it
    with fileio.atomic_write(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, t in tensors:
            flat = t.detach().reshape(t.shape[0], -1) if t.dim() else t.detach().reshape(1, 1)
            for c in range(0, flat.shape[0], chunk_rows):
                part = flat[c : c + chunk_rows].to("cpu").contiguous()
                f.write(part.view(torch.uint8).numpy().data)


def tensor_entry(
    file: Path, layout: tuple[dict, int], name: str, shape: tuple[int, ...], fix: str
) -> tuple[torch.dtype, int]:
    """`name`'s dtype and first byte in `file` (whose `layout` `check_safetensors_layout` returned), after
    checking that it is there, floating point, of `shape`, and that its byte range holds exactly that."""
    header, data_start = layout
    entry = header.get(name) if name != "__metadata__" else None
    if not isinstance(entry, dict):
        raise UserError(f"{file}: no tensor {name}; {fix}")
    dtype = _TORCH.get(entry.get("dtype"))
    if dtype is None:
        raise UserError(f"{file}: tensor {name} is {entry.get('dtype')!r}, not a floating-point dtype; {fix}")
    if entry.get("shape") != list(shape):
        raise UserError(f"{file}: tensor {name} is {entry.get('shape')}, expected {list(shape)}; {fix}")
    begin, end = entry["data_offsets"]
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise UserError(
            f"{file}: tensor {name} holds {end - begin:,} bytes, not a {list(shape)} {dtype}; {fix}"
        )
    return dtype, data_start + begin


def read_rows(
    f, dtype: torch.dtype, start: int, shape: tuple[int, ...], first: int, end: int
) -> torch.Tensor:
    """Rows [first, end) of the tensor of `shape` and `dtype` whose data begins at byte `start` of the open
    file `f` (a `tensor_entry`), as a CPU tensor: only their bytes are read."""
    per_row = math.prod(shape[1:]) * dtype.itemsize
    buf = bytearray((end - first) * per_row)
    f.seek(start + first * per_row)
    if f.readinto(buf) != len(buf):
        raise UserError(f"{f.name}: ended inside a tensor; the checkpoint is damaged: save it again")
    return (
        torch.frombuffer(buf, dtype=dtype).view(end - first, *shape[1:])
        if buf
        else torch.empty(0, *shape[1:], dtype=dtype)
    )
