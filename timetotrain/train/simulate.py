"""`ttt plan --simulate`: one rank of an N-rank job built and stepped on this machine, with no memory used.

The production path runs unchanged: `prepare.preflight` (the layout and batch checks of `ttt run`), the fake
process group of torch (`backend="fake"`: every collective returns at once, this process is rank r of N) and,
under FakeTensorMode (tensors with shape, dtype and device but no storage), `prepare.build` (meta model ->
task adaptation -> `parallel.apply` -> `to_empty` -> init -> warm-up -> optimizer) and one `Training.step`
(forward, backward, gradient clipping, optimizer, the loss all-reduce). torch's memory tracker
(`torch.distributed._tools`: `FSDPMemTracker` under FSDP2, `MemTracker` otherwise) counts the bytes each
tensor would hold, by kind, through that step. Where fake tensors cannot run ttt's code, the one seam is
`timetotrain/fakes.py` (host bookkeeping kept real; routing assumed balanced).

What is simulated and what is assumed, as the report says it:
- The step: with gradient accumulation only the first two micro-batches run (`--micro-batches` in the
  report): from the second on, each allocates what the one before did (the accumulated gradients exist from
  the first), so the peak is reached by then; the loss of a shorter step is the same code. A pipeline's
  step (`pp`, train/pipeline.py) is its schedule's, which needs at least P micro-batches and holds several
  in flight: it runs P + 1 of them under 1F1B (rank r's warm-up leaves P - r forwards in flight; the next
  backward and forward are its steady state, the gradients beside as many forwards, which every later
  micro-batch repeats) and 2 P under interleaved 1F1B (its warm-up of (V - 1) P + 2 (P - 1) virtual-stage
  forwards and its steady state), all of them where the step has fewer: the tiny tier's two on `pp=2`.
  The micro-batches in flight are then the schedule's own, not assumed.
- Depth (`layers`): the model is simulated at `L` and at `L + unit` repeated layers and every byte count is
  extrapolated linearly to the tier's depth (`depth_unit`). The unit is one layer, or the cycle of unlike
  layers: gpt-oss's sliding and full attention (two), qwen3_5_moe's DeltaNet and full attention (four),
  flux's double:single 1:2 (three), so that the added layers are those of the whole model in proportion.
  That holds only where the added units are identical: the embedding, head, MTP and DeepSeek's dense-first
  layers sit in both simulated models (L starts past them). L is at least three repeated layers: FSDP2
  holds up to three gathered blocks in the backward, which fewer layers would not show. Without `layers`
  the full depth runs.
  Under pipeline parallelism `layers` is per stage: the simulated depths are the smallest total the split
  (train/pipeline.py, the head weighed against blocks) gives every stage at least `layers`, and that plus
  one unit per stage; each simulated rank is extrapolated from its own stages' layer counts at the two
  depths to its count at the tier's depth (its bytes grow with its own layers). Refused in one line where
  a rank's count does not grow between the two, or with checkpointing every K > 1 blocks (counted over the
  whole model, a stage's share of them moves with depth).
  Each module's own peak (a moment: the embedding, the head, each block of a ModuleList) is extrapolated
  too, and a phase's peak is the largest of them: where a step peaks moves with depth when one thing grows
  faster per layer than another shrinks (deepseekv3_671b on 8,192 GPUs, one micro-batch: at 6 and 7 layers
  the backward peaks at its start, before any gradient exists; at 61 layers at its end, in the first MoE
  block beside every layer's expert gradients: 63.9 GiB against the 61.1 of the two shallow peaks).
  Where the two depths disagree on where a phase peaks, or a count would extrapolate below zero, the
  depths chosen do not extrapolate: the simulation refuses in one line and asks for more layers.
- Ranks: FSDP2 cuts dim 0 as `torch.chunk` does, so the first ranks hold the largest shards and the last
  may hold fewer rows or none; the chosen rank and the last rank are simulated and the larger is "the most
  loaded". Under pipeline parallelism (ranks laid out pipeline outermost) rank 0 holds the first stage, the
  last rank the last stage.
- Pipeline stages: ttt gives each stage its input and output shapes, and under fake tensors the schedule's
  warm-up vote is taken from them on each rank (timetotrain/fakes.py: the fake process group's receives
  carry nothing); the schedule runs as in a real run, its receives allocating buffers of those shapes.
  Under FSDP2 torch's schedule turns gradient reduction and resharding off until the last micro-batch's
  backward (`set_requires_gradient_sync(False)`): each stage holds its gradients unsharded in fp32 through
  the step, which the report shows as temporaries (llama31_8b `pp=2,fsdp=4`: 15.8 GiB on rank 0).
- Steady state: the simulated step is the first, whose optimizer creates the AdamW moments in its step;
  from the second step on they exist through the forward and the backward, so their bytes (measured after
  the step) are added to those phases' peaks.
- The optimizer step's peak is counted, not traced: under FakeTensorMode some temporaries of the AdamW
  step outlive their use (the tracker saw 3x the real step's transient on the tiny tier), so the simulator
  takes the step's states, parameters and gradients as the tracker holds them after it, plus what a real
  step measured on top (tests/test_simulate.py): one fp32 temporary per parameter of one foreach call under
  the foreach implementation (its square roots of the second moments; DTensors and plain expert slices are
  separate calls), none per-parameter (TP: `foreach=False`).
- qwen3_5_moe's Gated DeltaNet chunk scan (a Python loop of one step per 64 tokens) runs its steps batched
  under fake tensors, keeping the tensors the loop keeps (timetotrain/fakes.py `shapes_only`): op by op,
  1,024 steps a layer at qwen35_397b_grpo's 65,536 tokens took hours. At 8,192 tokens the batched scan's
  peak was 0.3% below the loop's, at the same place; its own backward holds less than the loop's.
- MoE routing is balanced (timetotrain/fakes.py): real routing skews expert loads, and a rank receiving more
  copies needs more activation memory than simulated.
- A GPU's attention kernels: the simulation runs on the CPU device, whose SDPA falls back to the math path
  (H x T x T scores kept in fp32) where query and value head dims differ (DeepSeek-V3's MLA); those calls
  are counted as the GPU's memory-efficient kernel keeps them (output and log-sum-exp, timetotrain/fakes.py).
  gpt-oss's sliding-window layers take the GPU's windowed FlashAttention kernel (`varlen_attn`, which a
  GPU takes where `layers.native_window_works` passes), not the CPU's masked band, whose math attention
  kept fp32 scores and keys repeated per head: 5.35 GiB a layer at 16,384 tokens per rank, against the
  3.40 both kinds keep in the GPU's kernels. Equal head dims and no mask take the CPU's flash kernel, which
  keeps what a GPU's flash kernel keeps.
- DTensor's shape propagation (it runs each op once on global-shaped fake tensors) happens outside the
  tracked fake mode, as in a real run (timetotrain/fakes.py): before, the first FSDP2 gradient clip showed
  world-size times the gradient shards.
- DDP layouts (`dp=N`, `ep=N`) run with a stand-in for DDP (timetotrain/fakes.py: its constructor and reducer
  read parameter and gradient data in C++, which fake tensors have none of) that holds DDP's buckets: a
  second copy of the gradients, counted in every phase as "DDP buckets" (DDP's own bucket sizes in a real
  run). Allocator fragmentation, NCCL buffers and the CUDA context are not tensors: `ttt plan`'s margin stands
  for them.
- Embedding tables (dlrm_dcnv2, dlrmv4 under `dp=N`, train/embedding_parallel.py): the rank's shards, built as
  `ttt run` builds them, and the all-to-alls of the step. Their batch is real (ids and lengths, on the host):
  hstu's jagged layout reads its lengths there, outside the fake mode (`fakes.real_host`). Assumed: ids
  uniform over each table's rows, so a rank's lookups split evenly over their owners (`fakes.host_sizes`),
  and a table's sparse gradient holds a row per id looked up (`fakes.sparse_rows`: coalesce counts repeated
  ids as distinct, DLRM's bag backward keeps the ids of a row-wise shard's padding row; both upper bounds,
  as `ttt plan`'s count). The whole model is simulated (`--layers` is refused: three STU layers, no
  repeated ones in DLRM). The build is tracked too, by every family (`_Allocations`, which counts what ops
  allocate: torch's tracker follows modules, and a pipeline's warm-up calls its stage twice): its peak (the
  init and the warm-up) and its largest tensor, where a table built whole before it is cut would show (dlrm_dcnv2's did,
  97 GiB at the reference, until its build cut them first: docs/scale.md). Under FSDP2 it counts a DTensor by
  its shard and follows FSDP2's storage resizes (`_Allocations`), within 0.02% of a real gloo build's CPU
  allocator at the tiny tier (tests/test_simulate_build.py).
"""

from __future__ import annotations

import contextlib
import math
import resource
import tempfile
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from timetotrain import fakes
from timetotrain.errors import UserError
from timetotrain.train import distributed, parallel, pipeline, prepare
from timetotrain.train.memory import HEADROOM, margin_bytes
from timetotrain.train.parallel import ac_words
from timetotrain.train.synth import with_layers

KINDS = ("parameters", "gradients", "optimizer", "buckets", "activations", "temporaries", "gathered", "other")


@dataclass
class RankMemory:
    """Bytes of one simulated rank (one depth): at the peak by kind, and the steady states."""

    rank: int
    phases: dict[str, dict[str, int]]  # phase -> kind -> bytes, at that phase's peak
    where: dict[str, str]  # phase -> the module its peak is reached in
    parameters: int  # this rank's parameters and buffers (shards, expert slices)
    gradients: int  # gradients when the optimizer starts
    optimizer: int  # optimizer states after its first step
    empty: list[str] = field(default_factory=list)  # parameters this rank holds no rows of
    # "phase|module" -> kind -> bytes: each module's own peak in the forward and the backward (a block of
    # a ModuleList counts as one module), for extrapolating over depth (`_combine`); emptied after it.
    moments: dict[str, dict[str, int]] = field(default_factory=dict)
    buckets: int = 0  # DDP's gradient buckets (timetotrain/fakes.py), held from its constructor on
    build: int = 0  # the build's peak (meta model -> this rank's parameters -> init -> warm-up), bytes
    largest: int = 0  # the largest tensor the build allocates, bytes (a whole table would be it)
    largest_shape: str = ""  # its shape and dtype

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def peak(self) -> dict[str, int]:
        return self.phases[self.peak_phase]

    @property
    def total(self) -> int:
        return sum(self.peak.values())


def _kind(ref: str) -> str:
    """The tracker's reference types (`_MemRefType`, `_FSDPRefType`) as the kinds the report prints."""
    return {
        "Parameter": "parameters", "Sharded Param": "parameters", "Buffer": "parameters",
        "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
        "Optstate": "optimizer", "OptState": "optimizer",
        "Activation": "activations", "Inputs": "activations",
        "Temp": "temporaries",
        "Unsharded Param": "gathered", "All Gather": "gathered", "Reduce Scatter": "gathered",
    }.get(ref, "other")  # fmt: skip


def _by_kind(snapshot: dict) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for dev_snap in snapshot.values():
        for ref, nbytes in dev_snap.items():
            if ref != "Total":
                out[_kind(getattr(ref, "value", ref))] += nbytes
    return out


PHASES = ("forward", "backward", "optimizer step")


class _NoHook:
    """A hook handle for a parameter the tracker does not hook (`_tracker`)."""

    @staticmethod
    def remove() -> None:
        pass


_NO_HOOK = _NoHook()


def _tracker(model, opt, fsdp: bool):
    """The tracker, also keeping the peak of each phase (forward, backward, optimizer step): its snapshot
    and where (module) it was reached. Per phase, because extrapolating over depth needs the same moment at
    both depths; the overall peak may move from one phase to another as layers are added."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    base = FSDPMemTracker if fsdp else MemTracker

    class Tracker(base):
        phase_peak: dict[str, tuple[int, dict, str]] = {}
        moments: dict[str, tuple[int, dict]] = {}
        stepped = False

        def _again(self, module) -> None:
            # A pipeline schedule calls its stage, a root module, once per micro-batch; the trackers take a
            # root's second forward for a second iteration and refuse it. Its per-module statistics (which
            # this class does not read) start again instead.
            fqn = self._mod_tracker.get_known_fqn(module)
            if not self._mod_tracker.is_bw and set(self._mod_tracker.parents) - {fqn} == {"Global"}:
                self.memory_tracking.pop(module, None)

        def _pre_fw_hook(self, module, inputs) -> None:
            self._again(module)
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # torch's tracker hooks the gradient of every parameter of a module it enters, which a frozen
            # one (LoRA's base, a pipeline stage without FSDP2) refuses: a stand-in handle skips it.
            for p in module.parameters():
                if not p.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(p, (_NO_HOOK, _NO_HOOK))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):  # FSDPMemTracker's own check of the same
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def pre_forward(*args, **kwargs):
                self._again(fsdp_mod)
                return inner(*args, **kwargs)

            return pre_forward

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            phase = (
                "optimizer step" if self._in_opt else ("backward" if self._mod_tracker.is_bw else "forward")
            )
            total = sum(d["Total"] for d in self._curr_mem_snap.values())
            inner = sorted(self._mod_tracker.parents - {"Global"}, key=len)
            where = inner[-1] if inner else "outside modules"
            moment = f"{phase}|{_moment_module(where)}"
            # The forward and the backward only until the optimizer steps: after it (the loss all-reduce,
            # which the tracker calls forward) its states exist already, which the steady state adds to
            # these phases once; counted there they were counted twice (gpt_oss_20b ep=8,fsdp=8 with AC at 4
            # and 5 layers: the forward's peak was that moment, 99.8 GiB extrapolated, the step's 52).
            self.stepped = self.stepped or self._in_opt
            if self.stepped and not self._in_opt:
                return
            if not self.stepped and total > self.moments.get(moment, (-1,))[0]:
                self.moments[moment] = (total, {dev: dict(d) for dev, d in self._curr_mem_snap.items()})
            if total > self.phase_peak.get(phase, (-1,))[0]:
                snap = {dev: dict(d) for dev, d in self._curr_mem_snap.items()}
                self.phase_peak[phase] = (total, snap, where)

    if fsdp:
        from torch.distributed.fsdp import FSDPModule

        # A pipeline's stages are FSDP2 roots of their own inside `model`: the tracker instruments every
        # FSDP2 module under its root, and asks only that the root be one.
        t = Tracker(next(m for m in model.modules() if isinstance(m, FSDPModule)), opt)
        t._root_mod = model
    else:
        t = Tracker()
    t.phase_peak = {}
    t.moments = {}
    if not fsdp:
        t.track_external(model, *_optimizers(opt))
    return t


@contextlib.contextmanager
def _sparse_counted():
    """torch's memory tracker reads a tensor's storage, which a sparse one (a table's gradient) has none of:
    within this its values and indices are counted instead."""
    from torch.distributed._tools import mem_tracker
    from torch.distributed._tools.common_utils import get_untyped_storages

    def storages(t):
        if t.is_sparse:
            return get_untyped_storages(t._values()) | get_untyped_storages(t._indices())
        return get_untyped_storages(t)

    mem_tracker.get_untyped_storages = storages
    try:
        yield
    finally:
        mem_tracker.get_untyped_storages = get_untyped_storages


class _Allocations(TorchDispatchMode):
    """What ops allocate on this rank's device while it is active (meta tensors, the model before it is
    materialised, left out): the bytes live at the peak, and the largest tensor with its shape (a whole
    embedding table built before it is cut would be it). For the build, before the step's tracker runs: that
    one follows modules and refuses a module called twice, as a pipeline's warm-up calls its stage.

    Under FSDP2 two things read wrong before (llama31_8b `fsdp=8` at 3 layers: 94.3 GiB, 51.4 now; checked
    against the CPU allocator of a real gloo build, tests/test_simulate_build.py):
    - A DTensor (a wrapper subclass) is counted by its local tensors (`_holders`): this mode sees the
      wrapper, not the ops DTensor runs on its shards below it, and the wrapper's own storage holds nothing
      but reads as its global shape's bytes, for as long as the wrapper lives (every parameter, whole).
    - A storage counts its bytes as they are now, not as first seen: FSDP2 frees a gathered parameter by
      resizing its storage to 0 (`_fsdp_param.free_storage`) and grows the same storage again for the next
      all-gather, and a storage's resize passes no dispatch mode. So `UntypedStorage.resize_` is watched while
      the mode is active (any caller's), and an op's output whose storage is known (`aten.resize_`, `set_`)
      is counted at its new size; a storage that dies uncounts what it held last."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.live, self.peak, self.largest, self.shape = device, 0, 0, 0, ""
        # storage -> ([its bytes as last counted], the weak reference that uncounts them when it dies)
        self._seen = WeakIdKeyDictionary()
        self._resize = None

    def _count(self, st) -> None:
        """Count storage `st` at its current size: new, or known and resized."""
        n = st.nbytes()
        known = self._seen.get(st)
        if known is None:
            cell = [0]
            self._seen[st] = known = (cell, weakref.ref(st, lambda _, cell=cell: self._freed(cell)))
        cell = known[0]
        self.live += n - cell[0]
        cell[0] = n
        self.peak = max(self.peak, self.live)

    def _freed(self, cell: list[int]) -> None:
        self.live -= cell[0]
        cell[0] = 0

    def __enter__(self):
        resize = self._resize = torch.UntypedStorage.resize_

        def watched(st, size):
            out = resize(st, size)
            if st in self._seen:
                self._count(st)
            return out

        torch.UntypedStorage.resize_ = watched
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not (isinstance(t, torch.Tensor) and t.device.type == self.device.type):
                continue
            for part in _holders(t):
                self._count(part.untyped_storage())
            for part in [t] if t.is_sparse else _holders(t):  # a DTensor's shard, not its global shape
                n = _nbytes(part)
                if n > self.largest:
                    dtype = str(part.dtype).removeprefix("torch.")
                    self.largest, self.shape = n, f"{list(part.shape)} {dtype}"
        return out


def _holders(t) -> list:
    """The tensors whose storages hold `t`'s bytes: a sparse tensor's values and indices; a wrapper subclass's
    inner tensors (a DTensor's local shard), whose ops run below this mode, which sees the wrapper only: the
    wrapper's own storage holds no bytes but reads as its global shape's (a gathered parameter at 8 times its
    shard under `fsdp=8`), and lives as long as the wrapper."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)  # a DTensor's names its mesh too
        return [h for i in inner if isinstance(i, torch.Tensor) for h in _holders(i)]
    return [t._values(), t._indices()] if t.is_sparse else [t]


def _nbytes(t) -> int:
    """A tensor's bytes: a sparse one's values and int64 indices."""
    if t.is_sparse:
        return t._values().numel() * t.element_size() + t._indices().numel() * 8
    return t.numel() * t.element_size()


def _optimizers(opt) -> list:
    """The torch optimizers of `opt`, in the order they step: a table model's pair (train/optim.OptimizerPair:
    the dense part's, then the tables'), else `opt` itself."""
    return [opt.dense, opt.tables] if hasattr(opt, "tables") else [opt]


def _moment_module(fqn: str) -> str:
    """The module a moment is keyed by: `fqn` cut after its first numbered part, so that everything inside
    one block of a ModuleList (`...layers.3`, its attention, experts, recomputation) is one moment."""
    parts = fqn.split(".")
    cut = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    return ".".join(parts[: cut + 1])


def _held(model, opt) -> tuple[int, int, int]:
    """(parameter and buffer bytes, gradient bytes, optimizer-state bytes) this rank holds: local shards."""
    from torch.distributed.tensor import DTensor

    def nbytes(t) -> int:
        return _nbytes(t.to_local() if isinstance(t, DTensor) else t)

    params = sum(nbytes(p) for p in model.parameters()) + sum(nbytes(b) for b in model.buffers())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(nbytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return params, grads, states


def _foreach_temporary(model) -> int:
    """The foreach AdamW step's transient: one fp32 tensor per parameter of one foreach call at a time, and
    DTensors and plain tensors (expert slices) go to separate calls: the larger of the two."""
    from torch.distributed.tensor import DTensor

    sizes = [0, 0]
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sizes[isinstance(p.grad, DTensor)] += local.numel() * 4
    return max(sizes)


def _track_untracked(mt, model, fsdp: bool) -> None:
    """Count as parameters what the tracker does not know, and their gradients as gradients: FSDPMemTracker
    follows the parameters FSDP2 manages, not the `ignored_params` (expert-parallel slices under
    `ep=N,fsdp=N`), whose gradients it would count as backward temporaries."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.distributed.tensor import DTensor

    ref = _FSDPRefType.SHARDED_PARAM if fsdp else _MemRefType.PARAM
    grad = _FSDPRefType.SHARDED_GRAD if fsdp else _MemRefType.GRAD

    def as_gradient(p) -> None:  # else counted as a backward temporary
        mt._update_and_maybe_create_winfos(p.grad, grad)

    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.untyped_storage() not in mt._WINFO:
            mt._update_and_maybe_create_winfos(local, ref)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(as_gradient)


def _empty_shards(model) -> list[str]:
    from torch.distributed.tensor import DTensor

    return [n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.to_local().numel() == 0]


def simulate_rank(
    bench, tier, world: int, spec: str, rank: int, precision: str, ac: int, fake: bool = True
) -> RankMemory:  # fmt: skip
    """Build rank `rank` of `world` for `tier` (already at the depth to simulate) and run one step, counting
    its bytes. `fake=False` measures a real run instead, with the same tracker: this process is that rank of
    a torchrun job (gloo), and the tensors are real (the check of the simulator, tests/test_simulate.py)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def preflight(tier):
        return prepare.preflight(
            bench, tier, Path(tempfile.gettempdir()), spec, precision, ac, False, device="cpu", seed=0,
            ranks=distributed.Dist(rank=rank, world=world, local_rank=0),
        )  # fmt: skip

    prep = preflight(tier)
    keep = pipeline_micro_batches(prep.plan.pp, prep.plan.vpp, prep.accum)
    if keep < prep.accum:  # the schedule's steady state with fewer micro-batches (module docstring)
        prep = preflight(replace(tier, global_batch_size=tier.global_batch_size // prep.accum * keep))
    if fake:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        prepare.start_device(prep, "cpu", seed=0)
        built = _Allocations(prep.device)
        micro = prep.tier.micro_batch_size
        # module docstring: the second micro-batch repeats the first's allocations; a pipeline's whole step
        accum = prep.accum if prep.plan.pp > 1 else min(prep.accum, 2)
        with (
            FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(),
            fakes.global_shapes_untracked() if fake else contextlib.nullcontext(),
            fakes.gpu_attention() if fake else contextlib.nullcontext(),
            fakes.sparse_rows() if fake else contextlib.nullcontext(),
        ):
            try:
                with built:
                    tr = prepare.build(prep)
            except (RuntimeError, ValueError, AssertionError, TypeError) as e:
                raise UserError(
                    f"--parallel {spec}: rank {rank} of {world} does not build: {_line(e)}"
                ) from e
            data = bench.task.synthetic(
                prep.tier, micro * accum, torch.Generator().manual_seed(0), prep.device
            )
            # A batch of embedding-table ids is made real (module docstring): hstu's jagged layout is read
            # from its lengths on the host.
            with fakes.real_host() if bench.family.embedding_tables is not None else contextlib.nullcontext():
                batch = data.batch(0)
            # a pipeline's stages (FSDP2 roots under fsdp), else the model
            mt = _tracker(tr.model if prep.plan.pp > 1 else tr.bare, tr.opt, prep.plan.fully_sharded)
            seen: dict[str, dict] = {}

            def snap(name: str):
                def hook(*_) -> None:
                    if name not in seen:
                        seen[name] = mt.get_tracker_snapshot()
                        seen[name + " bytes"] = _held(tr.bare, tr.opt)
                        seen.setdefault("temporary", _foreach_temporary(tr.bare))

                return hook

            pre = _optimizers(tr.opt)[0].register_step_pre_hook(snap("grads"))
            post = _optimizers(tr.opt)[-1].register_step_post_hook(snap("opt"))

            def loss(model, mb):
                mt.reset_mod_stats()  # the trackers refuse a second forward of the root otherwise
                return data.loss(model, mb)

            with _sparse_counted(), mt:
                _track_untracked(mt, tr.bare, prep.plan.fully_sharded)
                try:
                    tr.step(0, batch, accum, loss)
                except (RuntimeError, ValueError, AssertionError, TypeError) as e:
                    raise UserError(
                        f"--parallel {spec}: rank {rank} of {world} fails its step: {_line(e)}"
                    ) from e
            pre.remove()
            post.remove()
            opt = _by_kind(seen["opt"])
            # The steady figures counted from the tensors themselves (local shards and slices).
            n_params, n_grads, _ = seen["grads bytes"]
            n_opt = seen["opt bytes"][2]
            phases = {p: _by_kind(snap) for p, (_, snap, _) in mt.phase_peak.items()}
            where = {p: w for p, (_, _, w) in mt.phase_peak.items()}
            moments = {m: _by_kind(snap) for m, (_, snap) in mt.moments.items()}
            if prep.plan.pp > 1:
                where, moments = _rank_blocks(tr.bare, where, moments)
            # The step simulated is the first, whose AdamW moments appear in its optimizer step; from the
            # second on they exist through the forward and the backward too: the steady state adds them.
            for p in ("forward", "backward"):
                if p in phases:
                    phases[p]["optimizer"] += n_opt
            for kinds in moments.values():
                kinds["optimizer"] += n_opt
            if fake:  # (module docstring: the optimizer step's peak is counted from its states)
                phases["optimizer step"] = dict(opt)
                if tr.opt.defaults.get("foreach"):
                    phases["optimizer step"]["optimizer"] += seen["temporary"]
                where["optimizer step"] = "the optimizer (states + one fp32 temporary per parameter)"
            # DDP's buckets exist from its constructor, before the tracker: in every phase and moment.
            buckets = fakes.ddp_bucket_bytes(tr.model)
            for kinds in (*phases.values(), *moments.values()):
                kinds["buckets"] += buckets
            return RankMemory(
                rank, phases, where, n_params, n_grads, n_opt, _empty_shards(tr.bare), moments, buckets,
                built.peak, built.largest, built.shape,
            )  # fmt: skip
    finally:
        distributed.teardown(barrier=not fake)


def _rank_blocks(owned, where: dict, moments: dict) -> tuple[dict, dict]:
    """A pipeline rank's blocks named by their place among its own (`layers.0` its first), not by the
    model's index (`layers.21` on the last of 8 stages at 24 layers, `layers.28` at 32): extrapolation over
    depth compares the same block of the shallower and the deeper model (`_same_place`)."""
    import re

    local = {g: str(i) for i, g in enumerate(owned.layers.keys())}

    def name(fqn: str) -> str:
        return re.sub(r"(^|\.)layers\.(\d+)", lambda m: f"{m[1]}layers.{local.get(m[2], m[2])}", fqn)

    return {p: name(w) for p, w in where.items()}, {
        f"{k.split('|', 1)[0]}|{name(k.split('|', 1)[1])}": v for k, v in moments.items()
    }


def pipeline_micro_batches(pp: int, vpp: int, accum: int) -> int:
    """How many of a step's `accum` micro-batches a pipeline's simulated step runs: enough for every rank to
    reach its schedule's steady state (module docstring); all of them without pipeline parallelism."""
    if pp == 1:
        return accum
    return min(accum, pp + 1 if vpp == 1 else 2 * pp)


def _line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (torch's name the tensor)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def depth_unit(bench, tier) -> tuple[int, int]:
    """(the smallest simulated depth, the repeat unit) for extrapolation (module docstring)."""
    cfg = tier.model
    # At least three repeated layers: in the backward FSDP2 holds up to three gathered blocks (the one it
    # computes, the one it prefetches, the one whose gradients it is reducing), so below three layers each
    # added layer adds a gathered block that later layers do not add again (seen on llama31_405b: 2 -> 3
    # layers +0.74 GiB, 3 -> 4 -> 5 +0).
    if bench.family.with_layers is not None:  # flux: double:single as 1:2, three double blocks at least
        return 9, 3
    # Unlike layers in a cycle repeat by the cycle, so that every kind is extrapolated: gpt-oss's sliding
    # and full attention (the window pattern, two layers), qwen3_5_moe's DeltaNet and full attention (its
    # interval, four). One added gpt-oss layer extrapolated one kind: 123.0 GiB at fsdp=8 without AC, where
    # all 24 layers simulated gave 141.6, when the simulator still ran the sliding band as the CPU's masked
    # math attention (docs/scale.md).
    unit = len(getattr(cfg, "window_pattern", ())) or getattr(cfg, "full_attention_interval", 1)
    return getattr(cfg, "first_dense", 0) + 3, unit


@dataclass
class Simulation:
    bench: str
    tier: str
    world: int
    parallel: str
    precision: str
    ac: int  # every ac-th block checkpointed; 0 none
    layers: tuple[int, int] | None  # the two simulated depths (None: full depth)
    full_layers: int
    ranks: dict[int, RankMemory]  # rank -> extrapolated bytes (a RankMemory of the full depth)
    micro_batch: int
    accum: int
    seconds: float
    rss: int
    ran: int = 0  # the micro-batches of a step simulated (`pipeline_micro_batches`; else at most 2)

    def most_loaded(self) -> RankMemory:
        return max(self.ranks.values(), key=lambda m: m.total)


def _combine(a: RankMemory, b: RankMemory, steps: float, depths: tuple[int, int] = (0, 0)) -> RankMemory:
    """`a` + `steps` x (b - a), every count: linear in identical layers (module docstring). A phase's peak
    is the larger of its peak extrapolated and of every moment (`_comparable_moments`) extrapolated: where
    a phase peaks can move as layers are added (a one-micro-batch backward peaks at its start in a shallow
    model, before any gradient exists, and at its end, in the first repeated block beside every layer's
    gradients, in the deep one), and the peak at two shallow depths extrapolates only the first.

    A phase's peak is extrapolated by kind only where both depths reach it at the same place (the same
    module, or the same block counted from the end); where it moved, only moments that are the same in
    both extrapolate (llama31_405b tp=4,fsdp=32 at 3 and 4 layers: the forward peaked in the first block,
    beside its gathered weights, then at the head, beside the logits; mixing the two by kind gave 482 GiB
    where 4 and 5 layers give 67). A count that extrapolates below zero, or a moved peak that no comparable
    moment holds, is refused with the reason (`depths`: the two simulated depths, for the message)."""

    def lin(x: int, y: int, what: str) -> int:
        v = round(x + steps * (y - x))
        if v < 0:
            raise UserError(
                f"--layers {depths[0]}: {what} extrapolates to {v / 2**30:.1f} GiB from {depths[0]} and "
                f"{depths[1]} layers ({x / 2**30:.2f}, {y / 2**30:.2f} GiB): it does not grow linearly with "
                "depth there; simulate from more layers (a larger --layers) or the full depth (no --layers)"
            )
        return v

    def grow(x: dict, y: dict, where: str) -> dict:
        return {k: lin(x[k], y[k], f"{k} of {where}") for k in KINDS}

    la, lb = _list_lengths(a), _list_lengths(b)
    phases = {
        p: grow(a.phases[p], b.phases[p], f"the {p}'s peak")
        if _same_place(a.where.get(p), b.where.get(p), la, lb)
        else None
        for p in b.phases
        if p in a.phases
    }
    where = dict(b.where)
    comparable = _comparable_moments(a, b)
    for m in comparable:
        phase, module = m.split("|", 1)
        if phase not in phases:
            continue
        kinds = grow(a.moments[m], b.moments[m], f"the {phase} in {module}")
        if phases[phase] is None or sum(kinds.values()) > sum(phases[phase].values()):
            phases[phase], where[phase] = kinds, module
    for p, kinds in phases.items():
        moved = not _same_place(a.where.get(p), b.where.get(p), la, lb)
        if kinds is None or (moved and f"{p}|{_moment_module(b.where[p])}" not in comparable):
            raise UserError(
                f"--layers {depths[0]}: the {p}'s peak is in {a.where[p]} at {depths[0]} layers and in "
                f"{b.where[p]} at {depths[1]}, and no moment of both holds it, so it does not extrapolate; "
                "simulate from more layers (a larger --layers) or the full depth (no --layers)"
            )
    return RankMemory(
        a.rank, phases, where, lin(a.parameters, b.parameters, "the parameters"),
        lin(a.gradients, b.gradients, "the gradients"), lin(a.optimizer, b.optimizer, "the optimizer states"),
        b.empty, buckets=lin(a.buckets, b.buckets, "DDP's buckets"), build=lin(a.build, b.build, "the build"),
        largest=b.largest, largest_shape=b.largest_shape,
    )  # fmt: skip


def _list_lengths(m: RankMemory) -> dict[str, int]:
    """The length of every ModuleList the moments of `m` name (`head.N` keys)."""
    out: dict[str, int] = {}
    for key in m.moments:
        head, _, last = key.partition("|")[2].rpartition(".")
        if last.isdigit():
            out[head] = max(out.get(head, 0), int(last) + 1)
    return out


def _same_place(wa: str | None, wb: str | None, la: dict[str, int], lb: dict[str, int]) -> bool:
    """Whether two peaks (module names) are the same place of the shallower and the deeper model: the same
    name outside a growing ModuleList, or the same block of it counted from its end (with the same
    submodule): the last block's backward at 3 layers is block 2, at 4 layers block 3."""
    if wa is None or wb is None:
        return False
    pa, pb = wa.split("."), wb.split(".")
    cut = next((i for i, part in enumerate(pa) if part.isdigit()), None)
    head = ".".join(pa[:cut]) if cut is not None else None
    if cut is None or len(pa) != len(pb) or la.get(head) == lb.get(head):
        return wa == wb
    if pa[:cut] != pb[:cut] or pa[cut + 1 :] != pb[cut + 1 :] or not pb[cut].isdigit():
        return False
    return la[head] - int(pa[cut]) == lb.get(head, 0) - int(pb[cut])


def _comparable_moments(a: RankMemory, b: RankMemory) -> list[str]:
    """The moments of `a` (the shallower model) that are the same moment in `b`, one repeat unit deeper:
    every module outside the repeated blocks, every block of a ModuleList as long in both (DeepSeek-V3's
    MTP), and of the lists that grow, the blocks with at least two more after them in `a` (the last ones see
    FSDP2's prefetch and reduce-scatter differently from the same index in `b`, and a block's neighbours
    differ in kind where kinds alternate: gpt-oss's sliding and full attention)."""
    la, lb = _list_lengths(a), _list_lengths(b)
    keep = []
    for key in a.moments:
        if key not in b.moments:
            continue
        head, _, last = key.partition("|")[2].rpartition(".")
        if last.isdigit() and la[head] != lb.get(head) and int(last) > la[head] - 3:
            continue
        keep.append(key)
    return keep


def simulate(
    bench, tier, world: int, spec: str, rank: int = 0, layers: int | None = None, precision: str = "bf16",
    ac: int = 0, also: tuple[int, ...] = (),
) -> Simulation:  # fmt: skip
    """Rank `rank`, the last rank of `world` and the ranks `also`, at the tier's depth or extrapolated from
    `layers`."""
    if not 0 <= rank < world:
        raise UserError(f"--rank {rank} must be in [0, {world - 1}] (--gpus {world})")
    full = _depth(tier)
    t0 = time.monotonic()
    depths = None
    plan = parallel.parse(spec, world, world_from="--gpus is")
    if layers is not None and plan.pp > 1:
        return _simulate_stages(bench, tier, world, spec, plan, rank, layers, precision, ac, t0)
    if layers is not None:
        least, unit = depth_unit(bench, tier)
        if ac > 1:  # the added layers hold the same share of checkpointed blocks: whole periods of ac
            unit = math.lcm(unit, ac)
        if layers < least:
            raise UserError(
                f"--layers {layers}: simulate at least {least} layers here (the layers before them differ "
                "from the repeated ones, so extrapolation needs them in)"
            )
        if layers + unit <= full:
            depths = (layers, layers + unit)
    ranks = {}
    for r in sorted({rank, world - 1, *also}):
        if depths is None:
            ranks[r] = replace(
                _in_child(simulate_rank, bench, tier, world, spec, r, precision, ac), moments={}
            )
            continue
        a, b = (
            _in_child(simulate_rank, bench, with_layers(bench, tier, d), world, spec, r, precision, ac)
            for d in depths
        )
        ranks[r] = _combine(a, b, (full - depths[0]) / (depths[1] - depths[0]), depths)
    return _simulation(bench, tier, world, spec, plan, precision, ac, depths, ranks, t0)


def _simulation(bench, tier, world, spec, plan, precision, ac, depths, ranks, t0) -> Simulation:
    local = parallel.check_batch_split(tier.global_batch_size, plan)
    micro = prepare.settle_micro_batch(bench, tier, plan, local)  # as `ttt run` settles it
    return Simulation(
        bench.name, tier.name, world, spec, precision, ac, depths, _depth(tier), ranks, micro, local // micro,
        time.monotonic() - t0, _max_rss(), pipeline_micro_batches(plan.pp, plan.vpp, local // micro),
    )  # fmt: skip


def _simulate_stages(bench, tier, world, spec, plan, rank, layers, precision, ac, t0) -> Simulation:
    """`--layers` under pipeline parallelism: `layers` per stage at least. A rank's bytes grow with its own
    stages' layers (the split, train/pipeline.py, gives the last stage fewer for the head), so each
    simulated rank is extrapolated from its layer counts at the two simulated depths to its count at the
    full depth (module docstring)."""
    least, unit = depth_unit(bench, tier)
    stages, full = plan.pp * plan.vpp, _depth(tier)
    if ac > 1:
        raise UserError(
            f"--layers {layers}: with pipeline parallelism and --ac-every {ac} the checkpointed share of a "
            "stage's layers changes with depth; simulate the full depth (no --layers)"
        )
    if layers < least:
        raise UserError(f"--layers {layers}: simulate at least {least} layers per stage here")

    def counts(depth: int) -> list[int]:  # layers per pipeline rank at `depth`
        ranges = pipeline.split_layers(
            *pipeline.stage_costs(bench, replace(tier.model, n_layers=depth)), stages
        )
        return [sum(hi - lo for lo, hi in ranges[p :: plan.pp]) for p in range(plan.pp)]

    d1 = next((d for d in range(layers * stages, full + 1) if min(counts(d)) >= layers), full)
    d2 = d1 + unit * stages
    if d2 > full:
        return simulate(bench, tier, world, spec, rank, None, precision, ac)
    ranks = {}
    for r in sorted({rank, world - 1}):
        p = plan.coords(r)["pp"]
        (a_n, b_n, f_n) = (counts(d)[p] for d in (d1, d2, full))
        if b_n <= a_n:
            raise UserError(
                f"--layers {layers}: rank {r}'s stages hold {a_n} layers at {d1} and at {d2}, so its bytes do "
                "not extrapolate over depth; simulate from more layers or the full depth (no --layers)"
            )
        a, b = (
            _in_child(simulate_rank, bench, with_layers(bench, tier, d), world, spec, r, precision, ac)
            for d in (d1, d2)
        )
        ranks[r] = _combine(a, b, (f_n - a_n) / (b_n - a_n), (a_n, b_n))
    return _simulation(bench, tier, world, spec, plan, precision, ac, (d1, d2), ranks, t0)


def _child(conn, fn, args) -> None:
    # GNU OpenMP is not fork-safe: a parent that ran a parallel region (a test before, on 2 threads) leaves a
    # thread pool the child does not have, and the child's first parallel op (hstu's repeat_interleave)
    # waits for it forever. One thread keeps torch's ops out of OpenMP; the simulation's real ops are small.
    torch.set_num_threads(1)
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        conn.send((False, e if isinstance(e, UserError) else UserError(f"simulation failed: {_line(e)}")))
    finally:
        conn.close()


def _in_child(fn, *args):
    """`fn(*args)` in a forked child process. Each simulated rank needs a fresh torch.distributed: device
    meshes of an earlier, destroyed fake process group stay cached in torch and resolve to groups that no
    longer exist. Fork (not spawn) keeps the imports: a child starts in milliseconds."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args))
    proc.start()
    child.close()
    try:
        ok, value = parent.recv()
    except EOFError:
        proc.join()
        raise UserError(f"the simulation's process died (exit code {proc.exitcode})") from None
    proc.join()
    if not ok:
        raise value
    return value


def _max_rss() -> int:
    """The largest resident set of this process and its simulation children (Linux reports KiB)."""
    return 1024 * max(
        resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )


def _depth(tier) -> int:
    """The repeated layers of the tier's model: hstu's STU layers (`layers`); 0 for DLRM, which has none."""
    cfg = tier.model
    if hasattr(cfg, "n_double"):
        return cfg.n_double + cfg.n_single
    return getattr(cfg, "n_layers", None) or getattr(cfg, "layers", 0)


def fits_text(peak: float) -> str:
    """Whether a peak fits devices of 80, 141 and 192 GiB, as `ttt plan --gpu-mem` judges each (its margin
    added, within its 90% line)."""
    G = 2**30
    return ", ".join(
        f"{g} GiB: {'yes' if peak + margin_bytes(g) <= HEADROOM * g * G else 'no'}" for g in (80, 141, 192)
    )


def format_simulation(sim: Simulation, est, gpu_mem_gib: float, counted: dict[int, int] | None = None) -> str:
    """The report `ttt plan --simulate` prints below the plan table: per rank, by kind, beside the formula
    (`est`, a memory.Estimate of the same layout, AC and micro-batch, or None), or for a model with
    embedding tables beside each rank's own count (`counted`: rank -> bytes, train/embedding_memory.py)."""
    G = 2**30
    ranks = sorted(sim.ranks)
    top = sim.most_loaded()
    head = [f"rank {r}" + (" (most loaded)" if r == top.rank and len(ranks) > 1 else "") for r in ranks]
    depth = (
        f"{sim.layers[0]} and {sim.layers[1]} of its {sim.full_layers} layers simulated, every count extrapolated "
        "linearly to the full depth"
        + (", per rank by its stages' layers" if "pp=" in sim.parallel else "")
        + " (valid where the added layers are identical: see timetotrain/train/simulate.py)"
        if sim.layers
        else f"all {sim.full_layers} layers simulated"
        if sim.full_layers
        else "the whole model simulated"
    )
    accum = (
        f"{min(sim.accum, sim.ran or 2)} of its {sim.accum} micro-batches run"
        if sim.accum > 1
        else "one micro-batch"
    )
    out = [
        f"simulated: {sim.bench} {sim.tier}, {sim.parallel} on {sim.world} ranks (fake process group, fake "
        f"tensors), {sim.precision}, AC {ac_words(sim.ac)}, micro-batch {sim.micro_batch} ({accum}); {depth}",
    ]
    w = max(14, *(len(h) + 2 for h in head))
    out.append(f"{'':<30}" + "".join(f"{h:>{w}}" for h in head) + f"{'formula':>{w}}")

    def row(label: str, values: list[float], formula: float | None = None) -> str:
        f = f"{formula / G:>{w - 1}.2f}G" if formula is not None else f"{'':>{w}}"
        return f"{label:<30}" + "".join(f"{v / G:>{w - 1}.2f}G" for v in values) + f

    ms = [sim.ranks[r] for r in ranks]
    out.append(row("parameters + buffers", [m.parameters for m in ms]))
    out.append(row("gradients", [m.gradients for m in ms]))
    out.append(row("optimizer states", [m.optimizer for m in ms]))
    if any(m.buckets for m in ms):
        out.append(row("DDP buckets", [m.buckets for m in ms]))
    out.append(row("  states together", [m.parameters + m.gradients + m.optimizer + m.buckets for m in ms],
                   est.states if est else None))  # fmt: skip
    for phase in PHASES:
        if not all(phase in m.phases for m in ms):
            continue
        where = ", ".join(f"rank {m.rank}: {m.where[phase]}" for m in ms)
        out.append(f"peak of the {phase} ({where}):")
        for kind, label in (
            ("parameters", "parameters + buffers"), ("gradients", "gradients"), ("optimizer", "optimizer"),
            ("buckets", "DDP buckets"), ("activations", "activations"), ("temporaries", "temporaries (backward)"),
            ("gathered", "gathered (FSDP2 unsharded)"), ("other", "other"),
        ):  # fmt: skip
            if any(m.phases[phase][kind] for m in ms):
                out.append(row("  " + label, [m.phases[phase][kind] for m in ms]))
        out.append(row("  total", [sum(m.phases[phase].values()) for m in ms]))
    formula = est.total - est.margin if est else None
    out.append(row(f"peak ({top.peak_phase})", [m.total for m in ms], formula))
    if est:
        out.append(f"ratio simulated / formula (without its margin): {top.total / formula:.2f}")
        # The build too (tests/test_simulate_build.py checks it under FSDP2): a warm-up above the step's peak
        # would end `ttt run` before its first step.
        need = max(top.total, *(m.build for m in ms))
        line = HEADROOM * gpu_mem_gib * G
        verdict = "yes" if need + est.margin <= line else "no"
        # Against the plan's own line (--gpu-mem, GiB), then the common sizes judged the same way; a device
        # sold as "141 GB" holds about 140 GiB (nvidia-smi's MiB), so GiB is the unit throughout.
        out.append(
            f"fits --gpu-mem {gpu_mem_gib:g} (the larger of the step's and the build's peaks, {need / G:.2f} GiB, "
            f"+ the plan's margin {est.margin / G:.2f}, within the line {line / G:.2f}): {verdict}; "
            f"on {fits_text(need)}"
        )
    if counted:
        out.append(row("ttt plan's per-rank count", [counted[m.rank] for m in ms]))
        out.append(f"ratio simulated / count, rank {top.rank}: {top.total / counted[top.rank]:.2f}")
    if any(m.build for m in ms):
        out.append(row("build's peak (init, warm-up)", [m.build for m in ms]))
        big = max(ms, key=lambda m: m.largest)
        out.append(
            f"largest tensor the build allocates: {big.largest_shape} ({big.largest / G:.2f} GiB, rank {big.rank})"
        )
    if counted:
        need = max(top.total, *(m.build for m in ms))
        verdict = "yes" if need <= 0.9 * gpu_mem_gib * G else "no"
        out.append(
            f"fits (the larger of the step's and the build's peaks within 90% of {gpu_mem_gib:g} GiB): {verdict}"
        )
    empty = sorted({n for m in ms for n in m.empty})
    if empty:
        out.append(f"ranks holding no rows of: {', '.join(empty[:5])}" + (" ..." if len(empty) > 5 else ""))
    out.append(f"simulation: {sim.seconds:.1f} s, peak RSS {sim.rss / G:.2f} GiB (this process)")
    assumed = (
        "ids uniform over each table's rows (the lookups split evenly over their owners), a table's sparse "
        "gradient one row per id looked up (module docstring)"
        if counted
        else "balanced MoE routing"
    )
    out.append(
        f"assumed: {assumed}; not counted: allocator fragmentation, NCCL buffers, the CUDA context "
        "(the plan's margin). Not validated on GPUs."
    )
    return "\n".join(out)
