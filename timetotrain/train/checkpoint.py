"""Checkpoints in and out.

- `load_hf_checkpoint`: Hugging Face safetensors weights (one file or index + shards) into our model, streamed
  shard by shard. A model family supplies the name mapping: for each of our parameters, a `Source` naming
  the HF tensors it is built from and how to combine them (fusing QKV, stacking experts, ...).
- `save_checkpoint` / `load_checkpoint`: our own training state (model, optimizer, step) with
  torch.distributed.checkpoint, so each rank of an FSDP2 run writes and reads only its own shards. A folder
  is read through `dcp_safe` (its pickled metadata and non-tensor entries are untrusted input). Embedding
  tables (plain-tensor weights, whole or model-parallel shards) are written beside it, each rank its rows,
  read by row ranges in any rank count (`table_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from timetotrain import fileio, trees
from timetotrain.errors import UserError
from timetotrain.models.family import Source
from timetotrain.progress import LiveLine
from timetotrain.train import dcp_safe, table_checkpoint
from timetotrain.train.expert_parallel import expert_dtensors
from timetotrain.train.optim import parts
from timetotrain.train.safetensors_file import check_safetensors_layout
from timetotrain.train.shards import copy_full, full_shape, is_part
from timetotrain.train.tensor_parallel import stacked_layouts, unstack_rows

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
META = "ttt_checkpoint.json"  # step + extra, written last, so its presence marks a complete checkpoint

# Wrappers (activation checkpointing, torch.compile) insert these levels into parameter names.
_WRAPPER_LEVELS = {"_checkpoint_wrapped_module", "_orig_mod"}


@dataclass
class LoadReport:
    """What `load_hf_checkpoint` did."""

    loaded: list[str] = field(default_factory=list)  # our parameter names, in load order
    ignored: list[str] = field(default_factory=list)  # HF tensors in the checkpoint that nothing needs
    peak_held_bytes: int = 0  # the most bytes of HF tensors held at once while loading


def _clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_LEVELS)


# A Hugging Face hub cache links a snapshot's files to ../../blobs: such a folder is refused too.
_COPY_IN = (
    "a checkpoint is read only from files inside its folder (copy them in, e.g. `huggingface-cli download "
    "--local-dir DIR`, which writes real files)"
)


def _weight_map(path: Path) -> tuple[dict[str, str], Path]:
    """HF tensor name -> shard file name, and the file that says so (the index or the single file)."""
    index = path / HF_INDEX
    if index.is_file():
        trees.check_inside(index, path, _COPY_IN)
        try:
            weight_map = dict(
                json.loads(fileio.read_bounded(index, fileio.SMALL_FILE, "index").decode())["weight_map"]
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{index}: not a safetensors index ({exc}); re-download the checkpoint") from None
        for shard in sorted(set(weight_map.values())):
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise UserError(
                    f"{index}: shard {shard!r} is not a file name of this folder; re-download the checkpoint"
                )
            trees.check_inside(path / shard, path, _COPY_IN)
        return weight_map, index
    single = path / HF_SINGLE
    if single.is_file():
        trees.check_inside(single, path, _COPY_IN)
        check_safetensors_layout(single)
        with safe_open(single, framework="pt") as f:  # reads the header only
            return dict.fromkeys(f.keys(), HF_SINGLE), single
    raise UserError(
        f"{path}: neither {HF_SINGLE} nor {HF_INDEX} found; pass the folder of a Hugging Face safetensors checkpoint"
    )


def load_hf_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    mapping: Mapping[str, Source],
    *,
    truncate_rows: Mapping[str, int] | None = None,
    names: Mapping[str, str | None] | None = None,
) -> LoadReport:
    """Copy a Hugging Face safetensors checkpoint into `model` (plain CPU/GPU tensors, e.g. after a meta build
    and `to_empty`, or FSDP2-sharded DTensors), reading one shard at a time and holding only the HF tensors
    of parameters not yet complete. `truncate_rows[name] = n` keeps the first n rows of our tensor `name`.
    Extra HF tensors are ignored (listed in the report). Where a `Source` has alternative layouts
    (`Source.otherwise`), each parameter is read from the first one the checkpoint holds in full. Calls
    `model.reset_rope()` afterwards when the model has it.

    A sharded parameter (an FSDP2 shard, or an expert-parallel slice) gets only this rank's part of the
    full tensor its `Source` builds (one parameter's full tensor at a time, on the CPU;
    `shards.local_shard`), so no rank ever holds the whole model.
    `names` renames our parameters (names without wrapper levels) to the names `mapping` uses, None for a
    parameter the checkpoint does not hold (e.g. LoRA adapters, which the caller initialises):
    `lora.base_names`. Unlisted names stay as they are.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint folder; pass the folder holding the *.safetensors files")
    truncate_rows = dict(truncate_rows or {})
    params = _named_params(model, names)
    for what, names in (
        ("model parameters without a source in the mapping", params.keys() - mapping.keys()),
        ("mapping names that are not model parameters", mapping.keys() - params.keys()),
        ("truncate_rows names that are not model parameters", truncate_rows.keys() - params.keys()),
    ):
        if names:
            raise UserError(f"{path}: {what}: {sorted(names)[:4]}; the mapping does not fit this model")
    on_meta = [n for n, p in params.items() if p.is_meta]
    if on_meta:
        raise UserError(f"{path}: {on_meta[0]} is on the meta device; call model.to_empty(device=...) first")

    weight_map, listing = _weight_map(path)
    quantized = next((name for name in weight_map if name.endswith("weight_scale_inv")), None)
    if quantized is not None:
        raise UserError(
            f"{path}: FP8 block-quantized checkpoint ({quantized}); convert it to BF16 first (the benchmark "
            "starts from a BF16 checkpoint)"
        )
    # The layout each parameter is read from: the first of its alternatives the checkpoint holds in full.
    mapping = {ours: _layout(listing, ours, src, weight_map) for ours, src in mapping.items()}
    consumers: dict[str, list[str]] = {}  # HF name -> our names built from it
    for ours, src in mapping.items():
        for hf in src.hf_names:
            consumers.setdefault(hf, []).append(ours)
    shards = sorted({weight_map[hf] for hf in consumers})
    for shard in shards:
        if not (path / shard).is_file():
            raise UserError(
                f"{path / shard}: shard listed in {listing.name} is missing; re-download the checkpoint"
            )

    report = LoadReport(ignored=sorted(weight_map.keys() - consumers.keys()))
    held: dict[str, torch.Tensor] = {}
    uses_left = {hf: len(ours) for hf, ours in consumers.items()}
    held_bytes = 0
    live = _progress_line(len(shards))
    for k, shard in enumerate(shards):
        at = f"loading {path.name}: shard {k + 1}/{len(shards)} ({shard})"
        if live is not None:
            live.update(at, force=k == 0 and len(shards) > 1)
        wanted = {hf for hf in consumers if weight_map[hf] == shard}
        check_safetensors_layout(path / shard)
        with safe_open(path / shard, framework="pt", device="cpu") as f:
            absent = sorted(wanted - set(f.keys()))
            if absent:
                raise UserError(
                    f"{path / shard}: tensor {absent[0]} listed in {listing.name} is not in this shard"
                )
            for j, hf in enumerate(sorted(wanted)):
                if live is not None:  # a big shard (or a one-file checkpoint) is minutes of reading too
                    live.update(f"{at}, tensor {j + 1}/{len(wanted)}")
                held[hf] = f.get_tensor(hf)
                held_bytes += held[hf].nbytes
                report.peak_held_bytes = max(report.peak_held_bytes, held_bytes)
                for ours in consumers[hf]:
                    src = mapping[ours]
                    if not all(name in held for name in src.hf_names):
                        continue  # another input is in a later shard (or later in this one)
                    inputs = [held[n] for n in src.hf_names]
                    _assign(path, ours, params[ours], src, inputs, truncate_rows.get(ours))
                    report.loaded.append(ours)
                    for name in src.hf_names:  # free inputs no other parameter still needs
                        uses_left[name] -= 1
                        if not uses_left[name]:
                            held_bytes -= held.pop(name).nbytes
    if live is not None:
        # The closing line only where progress was shown: a quick one-file load stays silent.
        live.update(f"loading {path.name}: {len(shards)}/{len(shards)} shards", force=live.shown)
        live.close()
    reset_rope = getattr(model, "reset_rope", None)
    if callable(reset_rope):
        reset_rope()  # RoPE tables are non-persistent buffers: after to_empty they hold garbage
    return report


# A load that has taken this long prints its progress; a quicker one-file load prints nothing.
QUIET_S = 10.0


def _progress_line(n_shards: int):
    """A progress line on stderr, on the first rank only: from the start for a checkpoint of several
    shards (a 405B checkpoint is 191 shards and minutes of reading), after QUIET_S seconds for one file."""
    if _distributed() and dist.get_rank() != 0:
        return None
    return LiveLine(quiet_s=0.0 if n_shards > 1 else QUIET_S)


def check_hf_files(path: Path) -> None:
    """Preflight of a Hugging Face checkpoint (before `init_start`): every shard its index lists is
    present and whole (`check_safetensors_layout`), so a missing or truncated one is a one-line error naming
    it rather than a failure minutes into loading."""
    weight_map, listing = _weight_map(path)
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise UserError(
                f"{path / shard}: shard listed in {listing.name} is missing; re-download the checkpoint"
            )
        check_safetensors_layout(path / shard)


def _named_params(model: nn.Module, names: Mapping[str, str | None] | None) -> dict[str, torch.Tensor]:
    """Parameters by the name a checkpoint of the model knows them by (see `load_hf_checkpoint`'s `names`)."""
    out = {}
    for n, p in [*model.named_parameters(), *_persistent_buffers(model)]:
        name = _clean_name(n)
        if names is not None:
            name = names.get(name, name)
        if name is not None:
            out[name] = p
    return out


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong to the weights (e.g. a router's balancing bias), not derived tables."""
    out = []
    for mod_name, mod in model.named_modules():
        for n, b in mod.named_buffers(recurse=False):
            if b is not None and n not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{n}" if mod_name else n, b))
    return out


def _layout(listing: Path, ours: str, src: Source, weight_map: Mapping[str, str]) -> Source:
    """The first layout of `src` whose tensors are all in the checkpoint, else a one-line UserError naming
    the first missing tensor of each layout."""
    layouts = src.layouts()
    missing = []
    for layout in layouts:
        absent = [hf for hf in layout.hf_names if hf not in weight_map]
        if not absent:
            return layout
        missing.append(absent[0])
    if len(layouts) == 1:
        raise UserError(
            f"{listing}: tensor {missing[0]} (needed for {ours}) is missing; is this the right model?"
        )
    others = ", ".join(missing[1:])
    wanted = " or ".join("[" + ", ".join(layout.hf_names) + "]" for layout in layouts)
    raise UserError(
        f"{listing}: tensor {missing[0]} (needed for {ours}) is missing, and so is {others} of its other "
        f"layout; the checkpoint must hold either {wanted}: is this the right model?"
    )


def _assign(path: Path, ours: str, param: torch.Tensor, src: Source, inputs: list, rows: int | None) -> None:
    for name, t in zip(src.hf_names, inputs, strict=True):
        # Every value, once, at load (preflight scanned a bounded part): the copy below would cast an
        # integer tensor and carry a NaN into every step.
        if param.is_floating_point() and not t.is_floating_point():
            raise UserError(f"{path}: tensor {name} is {t.dtype}, not floating point: {ours} cannot load it")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UserError(f"{path}: tensor {name} (for {ours}) holds NaN or inf: the checkpoint is broken")
    try:
        value = src.combine(inputs)
    except RuntimeError as exc:  # e.g. a view that does not fit: the checkpoint is for another config
        shapes = [list(t.shape) for t in inputs]
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"{path}: cannot build {ours} from {', '.join(src.hf_names)} (shapes {shapes}): {reason}; "
            "the model config does not match the checkpoint"
        ) from None
    if rows is not None:
        if rows > value.shape[0]:
            raise UserError(
                f"{path}: truncate_rows[{ours}]={rows} but the checkpoint has {value.shape[0]} rows"
            )
        value = value[:rows]
    if tuple(value.shape) != full_shape(param):  # a sharded parameter's full shape
        raise UserError(
            f"{path}: {ours} expects shape {list(full_shape(param))} but {', '.join(src.hf_names)} give "
            f"{list(value.shape)}; the model config does not match the checkpoint"
        )
    with torch.no_grad():
        if is_part(param):  # an FSDP2 shard or an expert slice
            copy_full(param, value)  # this rank's rows only; casts to the shard's dtype and device
        else:
            param.data.copy_(value)  # casts to the parameter's dtype and device


# --- our own checkpoints (torch.distributed.checkpoint) ---------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _no_single_process_warning():
    # DCP warns on every call without a process group, though single-process use is intended here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    # Sharded (DTensor) entries under FSDP2: each rank saves and loads its own shards, nothing is gathered.
    # Expert slices (expert parallelism) enter as DTensor views of their full stacks for the same reason.
    experts = {_clean_name(n): t for n, t in expert_dtensors(model).items()}
    if optimizer is None:
        model_sd = get_model_state_dict(model)
        return {"model": {n: experts.get(_clean_name(n), t) for n, t in model_sd.items()}}
    if experts:
        raise UserError(
            "checkpoints with optimizer state are not supported under expert parallelism; "
            "save the model alone"
        )
    model_sd, optim_sd = get_state_dict(model, parts(optimizer))
    return {"model": model_sd, "optim": optim_sd}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SCAN_VALUES = 1 << 16  # per tensor, in preflight: the full scan is `_assign`'s, at load


def scan_hf_weights(path: Path, wanted: set[str]) -> None:
    """Preflight of the tensors a load will read (`wanted`: HF names): a floating-point dtype (an integer
    tensor would be cast into the weights silently) and no NaN or inf in a bounded scan, the first
    `SCAN_VALUES` values of each (a checkpoint saved after training diverged is non-finite throughout;
    a single bad value is found at load, where every value is checked)."""
    weight_map, _ = _weight_map(path)
    for shard in sorted({weight_map[n] for n in wanted if n in weight_map}):
        with safe_open(path / shard, framework="pt") as f:
            for name in sorted(wanted & set(f.keys())):
                sl = f.get_slice(name)
                shape, dtype = sl.get_shape(), sl.get_dtype()
                if not dtype.startswith(("F", "BF")):
                    raise UserError(
                        f"{path / shard}: tensor {name} is {dtype}, not floating point: not a checkpoint of "
                        "weights this model can load"
                    )
                per_row = max(1, int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)
                head = sl[: max(1, SCAN_VALUES // per_row)] if shape else sl[:]
                if not bool(torch.isfinite(head).all()):
                    raise UserError(
                        f"{path / shard}: tensor {name} holds NaN or inf (found by a bounded scan of its first "
                        f"{head.numel():,} values): the checkpoint is broken; save or download it again"
                    )


# HF config.json keys that fix tensor layouts a load cannot see from shapes alone (how the rows of one QKV
# matrix split into heads), against our configs' names for them.
_HF_SHAPE_KEYS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                  "num_key_value_heads": "n_kv_heads"}  # fmt: skip


def check_hf_config(path: Path, cfg=None) -> None:
    """The folder's `config.json`, when it has one: a JSON object, and where it states one of
    `_HF_SHAPE_KEYS` that the model's `cfg` has too, the same number (the weights are read into `cfg`'s
    shapes: a checkpoint of another head split would load with every shape matching)."""
    file = path / "config.json"
    if not file.is_file():
        return
    try:
        doc = json.loads(fileio.read_bounded(file, fileio.SMALL_FILE, "config").decode())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{file} is not valid JSON ({e}): restore the checkpoint's config.json") from None
    if not isinstance(doc, dict):
        raise UserError(
            f"{file} is a JSON {type(doc).__name__}, not an object: restore the checkpoint's config.json"
        )
    for key, ours in _HF_SHAPE_KEYS.items():
        if key in doc and cfg is not None and hasattr(cfg, ours) and doc[key] != getattr(cfg, ours):
            raise UserError(
                f"{file}: {key} is {doc[key]!r}, this model has {ours}={getattr(cfg, ours)}: the checkpoint is of "
                "another model configuration"
            )


def check_init_source(path: str | os.PathLike, family, cfg=None) -> str:
    """Preflight of `--init-checkpoint`: "ours" (a `save_checkpoint` folder) or "hf" (safetensors), or a
    one-line UserError naming the folder and the fix. With the model's `cfg`, the HF tensors it will read
    are scanned too (`scan_hf_weights`)."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(
            f"--init-checkpoint {p} is not a folder: pass a Hugging Face or ttt checkpoint folder"
        )
    if (p / META).is_file():
        dcp_safe.read_metadata(p)  # a damaged or planted .metadata is refused here, before any log line
        table_checkpoint.parse(p / META, _read_meta(p))  # and so is a damaged record of its tables
        return "ours"
    if (p / HF_INDEX).is_file() or (p / HF_SINGLE).is_file():
        if family.hf_mapping is None:
            raise UserError(
                f"--init-checkpoint {p}: the {family.name} family has no Hugging Face name mapping"
            )
        check_hf_files(p)
        check_hf_config(p, cfg)
        if cfg is not None:
            wanted = {
                n for src in family.hf_mapping(cfg).values() for lay in src.layouts() for n in lay.hf_names
            }
            scan_hf_weights(p, wanted)
        return "hf"
    raise UserError(
        f"--init-checkpoint {p} holds neither {HF_INDEX} / {HF_SINGLE} (Hugging Face) nor {META} (ttt)"
    )


def init_from(
    path: str | os.PathLike,
    model: nn.Module,
    family,
    cfg,
    truncate_rows=None,
    names=None,
    kind: str | None = None,
) -> None:
    """Replace the initialised weights of the bare `model` with a checkpoint's: before parallelism, or into
    FSDP2 shards (each rank reads what it holds). `names`: as `load_hf_checkpoint`'s, for a model that has
    more parameters than the checkpoint (LoRA adapters added before sharding). `kind`: what the preflight's
    `check_init_source` found there ("hf" or "ours"), so a run checks its checkpoint once; None: checked
    here."""
    if (kind or check_init_source(path, family, cfg)) == "hf":
        load_hf_checkpoint(model, path, family.hf_mapping(cfg), truncate_rows=truncate_rows, names=names)
    else:
        load_checkpoint(path, model, None, names=names)
        if hasattr(model, "reset_rope"):
            model.reset_rope()


def save_checkpoint(
    dirpath: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict | None = None,
) -> None:
    """Save model + optimizer state, `step` and JSON-able `extra` to folder `dirpath`; call on every rank.

    Written to `<dirpath>.partial` and renamed once every rank has finished, so `dirpath` is either absent,
    the previous checkpoint, or complete. An existing `dirpath` is replaced.
    """
    final = Path(dirpath)
    partial = final.with_name(final.name + ".partial")
    meta = {"step": int(step), "extra": extra or {}}
    json.dumps(meta)  # fails here, before any writing
    tables = _tables(model)
    meta = json.dumps(
        {**meta, "stacked": _stacked(model), table_checkpoint.KEY: table_checkpoint.record(tables, optimizer)}
    )
    rank = dist.get_rank() if _distributed() else 0
    main = rank == 0
    if main and partial.exists():
        shutil.rmtree(partial)  # left by a save that crashed
    _barrier()
    with table_checkpoint.frozen(tables):
        state = _state(model, optimizer)
    _drop_tables(state, tables)
    with _no_single_process_warning():
        dcp.save(state, checkpoint_id=partial, no_dist=not _distributed())
    table_checkpoint.save(partial, tables, optimizer, rank)
    _barrier()  # every rank's shards are on disk before the rename
    if main:
        fileio.write_text(partial / META, meta)
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(final.parent)
    _barrier()  # nobody reads `dirpath` before it exists


def load_checkpoint(
    dirpath: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    names: Mapping[str, str | None] | None = None,
) -> tuple[int, dict]:
    """Load a `save_checkpoint` folder into `model` (and `optimizer`) in place, on every rank; any sharding
    (FSDP2 or none, any world size) may differ from the saving run's. Returns (step, extra).
    `names` (model only): as `load_hf_checkpoint`'s; parameters it maps to None keep their values."""
    final = Path(dirpath)
    if not (final / META).is_file():
        partial = final.with_name(final.name + ".partial")
        hint = f" ({partial.name} exists: that save was interrupted)" if partial.exists() else ""
        raise UserError(
            f"{final}: not a complete checkpoint (no {META}){hint}; pass a folder save_checkpoint wrote"
        )
    meta = _read_meta(final)
    saved = _saved_stacking(final, meta)
    tables = _tables(model)
    table_record = table_checkpoint.parse(final / META, meta)
    table_checkpoint.check_fits(final, table_record, tables, optimizer)
    with table_checkpoint.frozen(tables):
        state = _state(model, optimizer)
    # Tables are read apart, after the rest; their weights go back in for the strict load (copied onto
    # themselves). A checkpoint from before tables were written apart holds them as DCP entries.
    live = _drop_tables(state, tables) if table_record is not None else {}
    ours = {}  # checkpoint name -> our state-dict key, when `names` renames
    if names is not None:
        if optimizer is not None:
            raise ValueError("load_checkpoint: names is for loading a model alone (optimizer=None)")
        renamed = {}
        for key, t in state["model"].items():
            name = names.get(_clean_name(key), _clean_name(key))
            if name is not None:
                renamed[name], ours[name] = t, key
        state["model"] = renamed
    _check_fits(final, state)
    restack = _restacking(final, state["model"], ours, saved, stacked_layouts(model), optimizer is not None)
    with _no_single_process_warning():
        try:
            dcp.load(
                state,
                storage_reader=dcp_safe.SafeReader(final),
                planner=dcp_safe.SafeLoadPlanner(),
                no_dist=not _distributed(),
            )
        except CheckpointException as e:  # DCP wraps every rank's exception in one of these
            raise _checkpoint_error(final, [exc for exc, _ in e.failures.values()]) from None
        except UserError:
            raise
        except _SHARD_ERRORS as e:
            raise _checkpoint_error(final, [e]) from None
    with torch.no_grad():
        for key, layout in restack.items():
            t = state["model"][key]
            t.copy_(unstack_rows(t.clone(), *layout))
    if optimizer is None:
        # Expert-slice views were read in place (they share the slices' storage): hand back the plain slices.
        model_sd = {ours.get(n, n): _local(t) for n, t in state["model"].items()}
        # Not strict when renamed: the parameters mapped to None are not in the checkpoint.
        set_model_state_dict(model, {**model_sd, **live}, options=StateDictOptions(strict=names is None))
    else:
        with table_checkpoint.frozen(tables):  # their optimizer state is read with them
            set_state_dict(
                model,
                parts(optimizer),
                model_state_dict={**state["model"], **live},
                optim_state_dict=state["optim"],
            )
    if table_record is not None:
        table_checkpoint.load(final, table_record, tables, optimizer)
    return meta["step"], meta["extra"]


def _read_meta(final: Path) -> dict:
    """The checkpoint's META (untrusted): a JSON object with an int step and an object of extras."""
    try:
        meta = json.loads(
            fileio.read_bounded(final / META, fileio.SMALL_FILE, "checkpoint metadata").decode()
        )
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(
            f"{final / META}: not readable JSON ({e}); the checkpoint is damaged: save it again"
        ) from None
    if (
        not isinstance(meta, dict)
        or type(meta.get("step")) is not int
        or not isinstance(meta.get("extra"), dict)
    ):
        raise UserError(f"{final / META}: not a ttt checkpoint's record (step, extra); save it again")
    return meta


def _tables(model: nn.Module) -> dict[str, nn.Module]:
    """The embedding table modules whose weights `table_checkpoint` writes, by checkpoint name."""
    return {_clean_name(n): m for n, m in model.named_modules() if table_checkpoint.is_table(m)}


def _drop_tables(state: dict, tables: dict[str, nn.Module]) -> dict:
    """Take the tables' weights (and their optimizer state) out of the DCP state; returns the weights' entries."""
    names = {f"{n}.weight" for n in tables}
    live = {k: state["model"].pop(k) for k in list(state["model"]) if _clean_name(k) in names}
    if "optim" in state:
        for k in [k for k in state["optim"]["state"] if _clean_name(k) in names]:
            del state["optim"]["state"][k]
    return live


def _stacked(model: nn.Module) -> dict[str, list[int]]:
    """The stacked row layouts (train/tensor_parallel.py: fc1's rows reordered per TP rank) of the parameters
    every rank saves, by checkpoint name: DCP stores a stacked DTensor as the global tensor it stands for,
    in that order, so a load into another layout must know it. Collective (pipeline stages differ)."""
    mine = {_clean_name(n): list(v) for n, v in stacked_layouts(model).items()}
    if not _distributed():
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: v for d in every for n, v in d.items()}


def _saved_stacking(final: Path, meta) -> dict[str, tuple[int, int]]:
    """The checkpoint's stacked layouts (`_stacked`), checked: its metadata is untrusted input. A folder
    from before they were recorded has none."""
    got = meta.get("stacked", {}) if isinstance(meta, dict) else None

    def count(x) -> bool:
        return type(x) is int and x >= 1

    # parts: their number, or (unequal sub-tensors, train/tensor_parallel.py) a list of their rows
    ok = isinstance(got, dict) and all(
        isinstance(v, list)
        and len(v) == 2
        and count(v[1])
        and (count(v[0]) or (isinstance(v[0], list) and v[0] and all(count(x) for x in v[0])))
        for v in got.values()
    )
    if not ok:
        raise UserError(
            f"{final / META}: 'stacked' is not a map of names to [parts, tp]; not a ttt checkpoint"
        )
    return {n: (v[0] if type(v[0]) is int else tuple(v[0]), v[1]) for n, v in got.items()}


def _restacking(final: Path, model_sd: dict, ours: dict, saved: dict, target: dict, optim: bool) -> dict:
    """{state key: the saved layout to undo after reading} for parameters saved stacked and read into a
    whole, unsharded tensor (one process, pipeline stages without TP); one line, before anything is read,
    for a stacking that cannot be undone in place (another TP degree, FSDP2 shards, optimizer moments)."""
    target = {_clean_name(n): v for n, v in target.items()}
    out = {}
    for key, t in model_sd.items():
        was, want = saved.get(_clean_name(key)), target.get(_clean_name(ours.get(key, key)))
        if was == want:
            continue
        if want is None and not isinstance(t, DTensor) and not optim:
            out[key] = was
            continue
        raise UserError(
            f"{final}: {_clean_name(key)} was saved with its rows stacked for tp={was[1] if was else 1} and is "
            f"read here for tp={want[1] if want else 1}; load it under the saving run's tp degree, or into one "
            "process or pipeline stages without tp (the model alone)"
        )
    return out


# What reading a truncated or garbled shard, or one that is not plain tensors, raises (torch.load with
# weights_only=True raises UnpicklingError for a planted object).
_SHARD_ERRORS = (pickle.UnpicklingError, RuntimeError, ValueError, KeyError, EOFError, OSError)


def _checkpoint_error(final: Path, failures: list[BaseException]) -> BaseException:
    """One UserError for a failed DCP read: ours as it is, a damaged shard as one line; anything else (a
    bug, an interrupt) is handed on unchanged."""
    for exc in failures:
        if isinstance(exc, UserError):
            return exc
    for exc in failures:
        if isinstance(exc, _SHARD_ERRORS):
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return UserError(f"{final}: a shard cannot be read ({reason}); the checkpoint is damaged")
    return failures[0]


def _local(t):
    """An expert slice's DTensor view (`_state`) -> the slice's own parameter (a plain slice, or FSDP2's
    shard of it: `expert_parallel.expert_dtensors`), which the view was read into; anything else as it is."""
    param = getattr(t, "_ttt_expert_view", None) if isinstance(t, DTensor) else None
    return t if param is None else param.detach()


def _check_fits(final: Path, state: dict) -> None:
    """Compare names and global shapes with the checkpoint's metadata first: every rank reads the same
    file and so raises the same one-line error, instead of DCP's per-rank tracebacks."""
    saved = dcp_safe.read_metadata(final).state_dict_metadata
    for name, t in state["model"].items():
        if not isinstance(t, torch.Tensor):
            continue
        entry = saved.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise UserError(
                f"{final}: the checkpoint has no model tensor {name}; it was saved from another model"
            )
        if tuple(entry.size) != tuple(t.shape):  # DTensor.shape is the global shape
            raise UserError(
                f"{final}: {name} is {list(entry.size)} in the checkpoint but {list(t.shape)} in this model; "
                "build the model with the config the checkpoint was saved from"
            )
    if "optim" in state and not any(k.startswith("optim.") for k in saved):
        raise UserError(f"{final}: the checkpoint has no optimizer state; load it with optimizer=None")
