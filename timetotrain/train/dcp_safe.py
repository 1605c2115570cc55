"""Reading a torch.distributed.checkpoint (DCP) folder without running anything it holds.

A ttt checkpoint may come from a hub or a colleague, so its files are untrusted. Stock DCP would execute
code planted in two places: `FileSystemReader.read_metadata` is a bare `pickle.load` of `DIR/.metadata`, and
`DefaultLoadPlanner.load_bytes` reads every non-tensor entry (the optimizer's param groups) with
`torch.load(weights_only=False)`. Here:

- `.metadata` is unpickled by `_MetadataUnpickler`, which resolves only DCP's own metadata classes and the
  few torch and pathlib types they pickle with (`_ALLOWED`); any other global is refused before it is
  looked up, so no `__reduce__` of a planted object can name a callable;
- the unpickled metadata is then checked (`_check`): its storage entries name plain files of this folder
  (no path out of it, no symlink leading elsewhere) and no stream transforms (ttt writes none; a
  transform would run a decoder the file chooses);
- non-tensor entries load with `torch.load(weights_only=True)` (`SafeLoadPlanner`); tensors already do in
  `FileSystemReader.read_data` (tests/test_untrusted.py plants a hostile payload in both to prove it).

We keep DCP rather than moving to safetensors because DCP is what lets every FSDP2 / expert-parallel rank
write and read only its own shards and reshard on load; the unsafe part is only these two reads.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from timetotrain import fileio
from timetotrain.errors import UserError

METADATA = ".metadata"  # DCP's name for it (filesystem._metadata_fn)

_DCP_METADATA_CLASSES = {
    "Metadata",
    "StorageMeta",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
}
# What a DCP metadata pickle may name, as (module, name). Each is a plain data type or an enum/lookup that
# takes a value; none runs anything it is handed.
_ALLOWED = {
    *(("torch.distributed.checkpoint.metadata", n) for n in _DCP_METADATA_CLASSES),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # str -> torch.layout, from a fixed table
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: where it was saved
    ("pathlib", "PurePosixPath"),
}
# A tensor's dtype is pickled as the torch attribute (torch.float32): looked up here, not on the module.
_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise UserError(
            f"{self.path}: names {module}.{name}, which a torch distributed checkpoint's metadata never "
            "holds: refusing to unpickle it (the file was altered or is not a checkpoint); pass a folder "
            "that ttt's save_checkpoint wrote"
        )


def read_metadata(folder: str | Path) -> Metadata:
    """The checked `Metadata` of the DCP checkpoint in `folder`, or a one-line UserError naming the file."""
    folder = Path(folder)
    path = folder / METADATA
    try:
        data = fileio.read_bounded(path, fileio.LARGE_FILE, "checkpoint metadata")
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror}); the checkpoint is incomplete") from None
    try:
        meta = _MetadataUnpickler(io.BytesIO(data), path).load()
    except UserError:
        raise
    except Exception as e:  # truncated or garbled: pickle raises many kinds
        raise UserError(
            f"{path}: not a torch distributed checkpoint's metadata ({type(e).__name__}: {e}); "
            "the checkpoint is damaged: save it again"
        ) from None
    _check(folder, path, meta)
    return meta


def _check(folder: Path, path: Path, meta) -> None:
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise UserError(f"{path}: holds a {type(meta).__name__}, not a checkpoint's Metadata")
    storage = meta.storage_data
    if not isinstance(storage, dict):
        raise UserError(f"{path}: no storage table; the checkpoint is damaged: save it again")
    root = folder.resolve()
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or Path(rel).name != rel or rel in (".", ".."):
            raise UserError(
                f"{path}: storage entry {rel!r} is not a file name of this folder; refusing to read it"
            )
        target = (folder / rel).resolve()
        if target.parent != root:
            raise UserError(
                f"{path}: storage file {rel} resolves to {target}, outside {folder}; refusing to read it "
                "(copy the real file into the checkpoint folder)"
            )
        if getattr(info, "transform_descriptors", None):
            raise UserError(
                f"{path}: storage file {rel} asks for stream transforms {info.transform_descriptors}, "
                "which ttt never writes; refusing to run them"
            )
    if getattr(meta, "storage_meta", None) is None:
        meta.storage_meta = StorageMeta()  # as FileSystemReader.read_metadata does for old checkpoints


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata comes from `read_metadata` (restricted unpickler, checked)."""

    # No **kwargs: DCP then never falls back to the per-rank `__<rank>.metadata` files ttt does not write.
    def read_metadata(self, *args) -> Metadata:
        meta = read_metadata(Path(self.path))
        meta.storage_meta.load_id = self.load_id
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that reads non-tensor entries with `torch.load(weights_only=True)`: plain
    numbers, strings, tuples and dicts (all an optimizer's param groups hold) load; objects do not."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            reason = str(e).splitlines()[0] if str(e) else "refused"
            raise UserError(
                f"{read_item.dest_index.fqn} in the checkpoint is not plain data ({reason}); refusing to "
                "unpickle it"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
