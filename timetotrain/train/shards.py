"""Full tensors in, local shards out: how the sharded build (`step.build_training` under `fsdp=N`) fills
FSDP2 parameters that were never materialised whole.

The sharded build shards on the meta device and then allocates only each rank's shards (`to_empty`), so
nothing can be initialised or loaded as a whole model. Two tools fill the shards with exactly the values
the unsharded build would give:

- `local_shard(full, param)`: this rank's part of a full tensor, by the DTensor's placements (FSDP2 cuts dim
  0 as `torch.chunk` does, the last ranks possibly short or empty). The checkpoint loader builds one
  parameter's full tensor at a time and copies this slice.
- `full_init()`: while active, a random draw or fill on a sharded parameter (`nn.init.normal_`,
  `kaiming_uniform_`, `ones_`, ...) runs on a full tensor of the parameter's global shape, on its device,
  with the caller's generator, and this rank keeps its slice. So a family's own `init(model, generator)`
  and the LoRA adapters' init draw the same numbers in the same order as on an unsharded model: results do
  not depend on the shard count, and a sharded run starts from the weights a one-process run starts from.
  Decision (over DTensor's own random ops): DTensor draws each shard from an offset of a shared seed, whose
  values differ from an unsharded draw and ignore the explicit `generator` our families pass; over
  initialising on the CPU and copying: the device's generator draws other numbers than the CPU's, and the
  unsharded build initialises on the device. Cost: one parameter's full tensor at a time, per rank
  (1.9 GB at 70B, fc1) and every rank draws every element; no communication.
  Low-precision parameters (a bf16 frozen LoRA base) are drawn in fp32 and rounded, as the unsharded build
  initialises its fp32 model before `apply_lora` casts the base.

Expert slices (`ep=N,fsdp=N`: plain tensors holding rows `[first, first + L)` of a full `[E, ...]` expert
stack, `expert_parallel.expert_slice`) are parts of a full tensor too: `local_shard` / `copy_full` cut their
rows, so a rank's experts equal the same rows of the one-process model's. Under `ep=E,fsdp=N` (E < N) FSDP2
shards each slice over its replicas: a DTensor of the slice's shape, whose part of the rows is cut as any
DTensor's.

Expert stacks are drawn an expert at a time. The MoE layer initialises its stacks with
`models/common/rows.by_rows` (one `[a, b]` draw per expert, in order) on every build, one process or
sharded; under `full_init` a sharded stack is then drawn one full row at a time, and the rank copies its
part of each row (`row_part`: where `local_shard` of a meta tensor of the full shape puts the local tensor,
read from that view's offset and strides; it covers FSDP2's Shard(0) (a range of rows), train/expert_fsdp.py's
Shard(1) (a part of every row), expert slices and slices FSDP2 shards again). The transient is one expert
in fp32 (deepseekv3_671b: `[4096, 7168]`, 112 MiB) instead of the stack (`[256, 4096, 7168]`, 28 GiB, on
every rank); where the local tensor is no such view (strided sharding, a tensor-parallel row order: not
used for experts today) the stack is drawn whole, still row by row, and cut by `copy_full`. Values: on
the CPU a row-by-row draw equals the whole stack's for `uniform_`, and for `normal_` where a row holds a
multiple of 16 elements (every expert stack of our families; torch's CPU `normal_` makes normals in blocks
of 16 and re-draws a short tail), so CPU initial weights did not change (tests/test_init_rows.py). On CUDA
each call starts at its own Philox offset, so the values differ from the whole draw's of before, but they
are equal between the one-process build and every layout, the invariant that matters: a sharded run starts
from the weights a one-process run starts from.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from timetotrain.models.common.rows import by_rows
from timetotrain.train.expert_parallel import expert_slice
from timetotrain.train.tensor_parallel import logical


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the full tensor `param` holds a part of: a DTensor's global shape, an expert slice's
    whole expert stack, else its own shape."""
    part = expert_slice(param)
    if part is not None:
        return (part[0], *param.shape[1:])
    return tuple(param.shape)


def is_part(param: torch.Tensor) -> bool:
    """Whether `param` holds only a part of its full tensor on this rank (a DTensor or an expert slice)."""
    return isinstance(param, DTensor) or expert_slice(param) is not None


def local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of `full` (a tensor of `full_shape(param)`) that this rank's local tensor of `param` holds:
    a view, cut per mesh dimension as DTensor's `Shard(d)` does (`torch.chunk`, trailing ranks possibly
    short or empty; `Replicate` keeps everything), or an expert slice's rows (cut again where FSDP2 shards
    the slice over its replicas: a DTensor of the slice's shape)."""
    if tuple(full.shape) != full_shape(param):
        expected = list(full_shape(param))
        raise ValueError(f"full tensor {list(full.shape)} does not match the parameter's {expected}")
    part = expert_slice(param)
    if part is not None:
        full = full[part[1] : part[1] + param.shape[0]]
        if not isinstance(param, DTensor):
            return full
    full = logical(full, param)  # a tensor-parallel fused layout's row order (train/tensor_parallel.py)
    if any(type(p).__name__ == "_StridedShard" for p in param.placements):
        # FSDP over tensor parallelism cuts the TP shard again: DTensor's own split knows the order.
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    mesh, out = param.device_mesh, full
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard():
            raise ValueError(f"cannot slice a full tensor for placement {placement}")
        dim, parts = placement.dim, mesh.size(mesh_dim)
        chunks = torch.chunk(out, parts, dim=dim)
        index = mesh.get_local_rank(mesh_dim)
        out = chunks[index] if index < len(chunks) else out.narrow(dim, 0, 0)
    local = param.to_local()
    if out.shape != local.shape:  # a placement this slicing does not know (e.g. strided sharding)
        raise ValueError(f"sliced {list(out.shape)} but the local shard is {list(local.shape)}")
    return out


@torch.no_grad()
def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor `full` into `param` (a DTensor or an expert slice; cast to
    its dtype and device)."""
    (param.to_local() if isinstance(param, DTensor) else param).copy_(local_shard(full, param))


# The in-place initialisers that draw or fill: what nn.init's functions end in (`ones_` is `fill_`, `zeros_`
# `zero_`, `xavier_*` / `kaiming_normal_` `normal_` or `uniform_`), the nn.init functions that dispatch to
# torch-function modes themselves (seen first, so they run whole on the full tensor), and `by_rows` (an expert
# stack drawn an expert at a time, models/common/rows.py).
_FILLS = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.fill_,
    torch.Tensor.zero_,
    nn.init.normal_,
    nn.init.uniform_,
    nn.init.constant_,
    nn.init.kaiming_uniform_,
    by_rows,
}


def fill_target(func, args, kwargs) -> torch.Tensor | None:
    """The tensor the call `func(*args, **kwargs)` fills, where `func` is one of the initialisers above
    (`by_rows`' is its second argument); None for any other call."""
    if func not in _FILLS:
        return None
    if func is by_rows:
        target = args[1] if len(args) > 1 else kwargs.get("t")
    else:
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
    return target if isinstance(target, torch.Tensor) else None


class _FullInit(TorchFunctionMode):
    def __init__(self, skip: bool):
        super().__init__()
        self.skip = skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = fill_target(func, args, kwargs)
        if target is None or not is_part(target):
            return func(*args, **kwargs)
        if self.skip:  # the values come from elsewhere (a checkpoint): draw nothing
            return target
        if func is by_rows:
            _draw_rows(args, kwargs, target, target.device, keep=True)
        else:
            copy_full(target, draw_full(func, args, kwargs, target, target.device))
        return target


def _draw_dtype(target: torch.Tensor) -> torch.dtype:
    """fp32 at least, as the unsharded build draws (it initialises its fp32 model before any cast)."""
    return torch.promote_types(target.dtype, torch.float32) if target.is_floating_point() else target.dtype


def draw_full(func, args, kwargs, target: torch.Tensor, device) -> torch.Tensor:
    """Run the initialiser `func(*args, **kwargs)` aimed at `target` on a new tensor of `target`'s full
    shape on `device` instead (in fp32 at least, as the unsharded build draws), and return it."""
    full = torch.empty(full_shape(target), dtype=_draw_dtype(target), device=device)
    if func is by_rows:
        by_rows(args[0], full, *args[2:], **kwargs)
    elif args:
        func(full, *args[1:], **kwargs)
    else:
        func(**{**kwargs, ("tensor" if "tensor" in kwargs else "self"): full})
    return full


def draw_dropped(func, args, kwargs, target: torch.Tensor, device) -> None:
    """Draw what the initialiser would draw for `target`'s full tensor on `device` and keep nothing (another
    rank's parameter, train/pipeline.py): the generator advances as in a one-process build. An expert stack
    one row at a time, so the transient is one expert."""
    if func is by_rows:
        _draw_rows(args, kwargs, target, device, keep=False)
    else:
        draw_full(func, args, kwargs, target, device)


def row_part(param: torch.Tensor) -> tuple[int, int, tuple, tuple, int] | None:
    """Where this rank's local tensor of `param` lies in the rows (dim 0) of its full tensor, read from the
    geometry of `local_shard` on a meta tensor of the full shape: (first row, rows, the part's shape and
    strides within a row, its offset within a row), the local tensor's row i being that strided part of full
    row first + i. Holds for a cut of whole rows (FSDP2's Shard(0), an expert slice, the two together) and
    for a cut within every row (Shard(1), train/expert_fsdp.py). None where the part is not such a view:
    a copy (strided sharding, a tensor-parallel row order) or rows mixed within one local row."""
    full = torch.empty(full_shape(param), device="meta")
    if isinstance(param, DTensor) and any(type(p).__name__ == "_StridedShard" for p in param.placements):
        return None
    try:
        view = local_shard(full, param)
    except ValueError:
        return None
    if view is not full and view._base is not full:  # a new tensor, not a view: no geometry to read
        return None
    if view.numel() == 0:
        return 0, 0, (), (), 0
    rows = full.stride(0)
    if view.dim() != full.dim() or view.stride(0) != rows:
        return None
    first, within = divmod(view.storage_offset(), rows)
    last = within + sum((n - 1) * s for n, s in zip(view.shape[1:], view.stride()[1:], strict=True))
    if last >= rows:
        return None
    return first, view.shape[0], tuple(view.shape[1:]), tuple(view.stride()[1:]), within


def _draw_rows(args, kwargs, target: torch.Tensor, device, keep: bool) -> None:
    """`by_rows(init, target, ...)` on `target`'s full stack, one full row (an expert) at a time on `device`,
    this rank keeping its part of each row (`row_part`) where `keep`. Where the part is not a view of whole
    rows (`row_part` is None) the whole stack is drawn, still row by row (the same values), and cut as
    `copy_full` cuts: the transient is the stack there."""
    init, rest = args[0], args[2:]
    part = row_part(target) if keep else (0, 0, (), (), 0)
    if part is None:
        copy_full(target, draw_full(by_rows, args, kwargs, target, device))
        return
    first, n, shape, stride, within = part
    local = target.to_local() if isinstance(target, DTensor) else target
    full = full_shape(target)
    row = torch.empty(full[1:], dtype=_draw_dtype(target), device=device)  # each draw fills all of it
    for e in range(full[0]):
        init(row, *rest, **kwargs)
        if first <= e < first + n:
            local[e - first].copy_(row.as_strided(shape, stride, within))


@contextlib.contextmanager
def full_init(skip_sharded: bool = False):
    """Initialisers on sharded parameters draw the full tensor and keep this rank's slice (module docstring).
    `skip_sharded`: leave sharded parameters untouched instead (they are loaded next), so that a family's
    `init` fills only what is not a parameter (RoPE tables, counters) without drawing a whole model."""
    with _FullInit(skip_sharded):
        yield
