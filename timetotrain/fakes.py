"""The one seam between ttt and fake tensors (`ttt plan --simulate`, timetotrain/train/simulate.py).

The simulator runs the production build and training step of one rank of a large job under torch's
FakeTensorMode (tensors with shapes, dtypes and devices but no storage) and the fake process group. Almost all
of ttt runs unchanged there. What cannot is here, so that nothing else needs to know about fake tensors:

- `real_host()`: host bookkeeping that must hold real values: the meta-device model (a fake mode would keep
  weak references to its tensors, and `to_empty` could then not swap them for the materialised ones), device
  meshes (rank ids in a tensor the mesh reads back) and the MoE kernel probe (it compares real numbers).
  Without a fake mode it does nothing.
- `host_sizes(counts, rows)`: the one host read of routing results, as the split sizes the MoE expert loop
  and the expert-parallel all-to-all need. A fake tensor holds no values, so the simulation assumes balanced
  routing (the rows split evenly): what `ttt plan`'s formula counts too. A real tensor is read as it is.
- `global_shapes_untracked()`: DTensor derives an op's output shape by running the op once on fake tensors of
  the GLOBAL shape (`ShardingPropagator._propagate_tensor_meta_non_cached`), in the active fake mode if there
  is one. Under the simulator that is ours, below the memory tracker, which then counts tensors no rank ever
  allocates: at the first FSDP2 gradient clip of flux1 fsdp=8, 8x the gradient shards (11 GiB at the
  reference shape, `ttt plan --simulate` read it as a forward peak). A real run's propagation uses a fresh
  fake mode the tracker does not see; this makes the simulation's do the same.
- `gpu_attention()`: the simulation runs on the CPU device, whose SDPA has no fused kernel for a value head
  dim unlike the query's (DeepSeek-V3's MLA: 192 and 128) and falls back to the math path, which keeps the
  heads x T x T scores in fp32 (45 GiB at the reference shape, micro-batch 2). A GPU runs such a call in
  a fused kernel (torch's CUDA memory-efficient or cuDNN attention take unequal head dims) that keeps only
  the output and the log-sum-exp. Under fake tensors this sends those calls to the memory-efficient
  kernel's own op, whose fake implementation gives the GPU's shapes; a real tensor is not touched.
  Within it `gpu_kernels()` is true while a fake mode is active, for a choice a GPU makes by a check that
  cannot run here (`layers.native_window_works`: a GPU runs gpt-oss's sliding-window layers in torch's
  windowed FlashAttention kernel, which keeps q, k, v, the output and the log-sum-exp; this CPU has none and
  runs the band as masked math attention, which keeps fp32 scores, probabilities, upcast q/k/v and the
  keys repeated per query head: 5.35 GiB a layer against a full-attention layer's 3.40 at gpt_oss_20b's
  shape, 16,384 tokens per rank). The op has a fake implementation, so the simulation runs it.
- `shapes_only()`: a fake mode is active. qwen3_5_moe's DeltaNet chunk scan (one step per 64 tokens, 1,024 a
  layer at the reference's 65,536) then runs its steps batched, keeping the tensors the loop keeps
  (`deltanet._chunk_scan_shapes`): op by op under the fake mode and the memory tracker the loop took hours.
- `data_parallel(model, **kwargs)`: DDP, or for a model of fake tensors a stand-in that holds what DDP holds.
  DDP's constructor checks the parameters' shapes across ranks by reading their data in C++, and its reducer
  copies each gradient into its bucket there too: neither runs on fake tensors. What DDP adds to memory is its
  buckets (the flat buffers the all-reduce runs on; ttt keeps `gradient_as_bucket_view` off, so they are a
  second copy of the trained, not ignored, parameters' gradients, allocated in the constructor): the stand-in
  says their bytes (`bucket_bytes`, the simulation adds them to every phase) and its forward is the module's.
  The simulator reads a real DDP's own bucket sizes the same way (tests/test_simulate.py: equal).
- `sparse_rows()`: an embedding table's gradient is a sparse tensor of the rows looked up, and the fake
  implementations of torch's sparse ops do not carry its number of entries (nnz): the clone autograd makes of
  it, `coalesce` and DLRM's `embedding_bag` backward all come out with none, so the gradient and the row-wise
  update it drives would count 0 bytes. Inside this context they keep it: a clone and `coalesce` as many as
  the input (coalesce's repeated ids counted as distinct, an upper bound: which ids repeat is in their
  values), the bag backward one per id looked up (the ids pointing at a row-wise shard's padding row
  included, which the real backward drops: how many do is in their values; ttt plan's formula counts the
  same). F.embedding's own sparse backward already keeps it.
- `pipeline_schedule(schedule)`: a pipeline schedule's first step starts with a vote sent from stage to stage
  and back (`_warmup_p2p`: whether every stage was given its input and output shapes, else each infers them
  from a forward sent between ranks), read with `.item()`, which a fake tensor has no value for; and the
  fake process group's receives return at once with nothing in them. ttt gives every stage its shapes
  (train/pipeline.py `_examples`), so every rank votes the same: under fake tensors each stage takes the
  vote's outcome from its own shapes, and the schedule runs as it would (its receives allocate fake buffers
  of those shapes, the micro-batches it holds in flight are its own).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.nn.parallel import DistributedDataParallel as DDP


@contextlib.contextmanager
def real_host():
    """Run host bookkeeping outside any fake-tensor mode (module docstring); a no-op without one."""
    with unset_fake_temporarily():
        yield


def host_sizes(counts: torch.Tensor, rows: int) -> list:
    """`counts.tolist()` (one host sync). Fake `counts` (shape `[n]` or `[m, n]`): `rows` split evenly over
    the last dimension, the same for every leading index."""
    # Compiled, Dynamo's tensors are fake only while it traces (and asking would break the graph once more).
    if torch.compiler.is_compiling() or not is_fake(counts):
        return counts.tolist()
    n = counts.shape[-1]
    even = [rows // n + (i < rows % n) for i in range(n)]
    return even if counts.dim() == 1 else [list(even) for _ in range(counts.shape[0])]


class _OutsideOurFakeMode:
    """A re-entrant context that hides the active fake mode (`unset_fake_temporarily`, as `real_host`)."""

    def __init__(self) -> None:
        self._entered: list = []

    def __enter__(self) -> None:
        cm = unset_fake_temporarily()
        cm.__enter__()
        self._entered.append(cm)

    def __exit__(self, *exc):
        return self._entered.pop().__exit__(*exc)


@contextlib.contextmanager
def global_shapes_untracked():
    """DTensor's shape propagation outside our fake mode (module docstring). It enters
    `ShardingPropagator._fake_mode_lock` (a no-op context by default) before it looks for a fake mode; that
    context, swapped for the time of the simulation, hides ours, so the propagation makes its own."""
    before = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = _OutsideOurFakeMode()
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = before


_GPU_KERNELS = False


def gpu_kernels() -> bool:
    """Whether tensors are being counted as a GPU's kernels would keep them (`gpu_attention`): inside it and
    under a fake mode (never for real tensors, which run this machine's kernels)."""
    return _GPU_KERNELS and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def shapes_only() -> bool:
    """Whether a fake mode is active: tensors have shapes and no values, so a loop whose steps differ only in
    values (qwen3_5_moe's DeltaNet chunk scan) may run batched, allocating what it would (`ttt plan
    --simulate`). False while torch.compile traces (its own fake tensors are no simulation; the query would
    break the graph)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


@contextlib.contextmanager
def gpu_attention():
    """SDPA calls of unequal head dims counted as a GPU's fused kernel keeps them, and `gpu_kernels()` true
    (module docstring). It swaps `torch.nn.functional.scaled_dot_product_attention` for the time of the simulation (a function
    mode would not reach the recomputation of activation checkpointing in the backward)."""
    sdpa = F.scaled_dot_product_attention

    def fused(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if is_fake(query) and query.shape[-1] != value.shape[-1] and attn_mask is None and not enable_gqa:
            out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, None, True, dropout_p, is_causal, scale=scale
            )
            return out
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    global _GPU_KERNELS
    F.scaled_dot_product_attention, _GPU_KERNELS = fused, True
    try:
        yield
    finally:
        F.scaled_dot_product_attention, _GPU_KERNELS = sdpa, False


class SimulatedDDP(nn.Module):
    """DDP's forward and memory for a model of fake tensors (module docstring): no reducer, no collective."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.bucket_bytes = sum(
            p.numel() * p.element_size()
            for n, p in module.named_parameters()
            if p.requires_grad and n not in ignored
        )

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield


def data_parallel(model: nn.Module, **kwargs) -> nn.Module:
    """`DDP(model, **kwargs)`, or `SimulatedDDP` where the model's parameters are fake (module docstring)."""
    if any(is_fake(p) for p in model.parameters()):
        return SimulatedDDP(model)
    return DDP(model, **kwargs)


def ddp_bucket_bytes(wrapped: nn.Module) -> int:
    """The bytes of DDP's gradient buckets, of a real DDP (its own logged sizes) or a stand-in; 0 without
    DDP."""
    if isinstance(wrapped, SimulatedDDP):
        return wrapped.bucket_bytes
    if isinstance(wrapped, DDP):
        sizes = str(wrapped._get_ddp_logging_data().get("bucket_sizes", ""))
        return sum(int(x) for x in sizes.split(",") if x.strip())
    return 0


def pipeline_schedule(schedule) -> None:
    """Under fake parameters, the schedule's warm-up vote decided on each rank from its stages' own shapes
    (module docstring); a schedule of real tensors is left as it is."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    if not any(is_fake(p) for stage in stages for p in stage.submod.parameters()):
        return

    def vote(stages, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} has no static shapes to simulate")
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote


def _sparse_like(like_size, indices: torch.Tensor, values: torch.Tensor, coalesced: bool) -> torch.Tensor:
    return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
        indices.shape[0], values.dim() - 1, list(like_size), indices, values, dtype=values.dtype,
        layout=torch.sparse_coo, device=values.device, is_coalesced=coalesced,
    )  # fmt: skip


_aten = torch.ops.aten


def _sparse_impl(mode, func, *args, **kwargs):
    """The sparse ops of `sparse_rows` (module docstring), else NotImplemented (fake tensors' own)."""
    if func is _aten._embedding_bag_backward.default:
        grad, indices = args[:2]
        num_weights, sparse = args[6], args[9]
        if not sparse:
            return NotImplemented
        rows = grad.new_empty(indices.numel(), grad.shape[1])  # the bag's gradient, a row per id looked up
        return _sparse_like((num_weights, grad.shape[1]), indices.reshape(1, -1).clone(), rows, False)
    x = args[0]
    if not (isinstance(x, torch.Tensor) and x.is_sparse):
        return NotImplemented
    coalesced = func is _aten._coalesce.default or x.is_coalesced()
    return _sparse_like(x.shape, x._indices().clone(), x._values().clone(), coalesced)


_SPARSE_OPS = (_aten.clone.default, _aten._coalesce.default, _aten._embedding_bag_backward.default)


@contextlib.contextmanager
def sparse_rows():
    """Fake sparse gradients that keep their entries (module docstring); only under a fake mode."""
    entry = (lambda func: func in _SPARSE_OPS, _sparse_impl)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)
