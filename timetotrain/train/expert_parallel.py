"""Expert parallelism (EP) for the MoE layers of `timetotrain.models.common.moe`, applied from outside the model.

`apply_expert_parallel(model, group)` leaves every rank of `group` (size `ep`) with a contiguous slice of
`E / ep` experts per MoE layer (rank r owns experts `[r*L, (r+1)*L)`, `L = E / ep`) and installs an
`ExpertParallelDispatch` as the layer's dispatch hook (`MoE.dispatcher`), which moves the token copies to
the rank that owns their expert and back. Any MoE model built on `models.common.moe.MoE` gets it. Parameter names
stay as they were (`...ffn.experts.w1`), only the expert tensors shrink to `[L, ...]`.

Token flow of one layer on rank r, for its `N` local tokens:

1. route (router replicated): probs, expert ids `[N, k]`;
2. `permute`: the `N*k` copies grouped by expert (`counts[E]`), so they are also grouped by owning rank;
3. all-gather of `counts` -> table `[ep, E]` (`table[s, e]`: copies rank s sends to expert e). One tiny
   collective gives both split-size lists and the global telemetry; an all-to-all of counts would carry
   only this rank's column block and need a second collective for the global counts;
4. all-to-all of the grouped copies packed with their router probs (one collective, see `_Dispatch`): send
   `sum(table[r, experts of d])` rows to each rank d, receive `sum(table[s, my experts])` rows from each
   rank s, source-major;
5. regroup the received rows by local expert with a stable sort (source-major within an expert: the rows
   of rank 0 first, then rank 1, ..., exactly the order the single-process layer sees on the concatenated
   batch, so the expert math is the same matmuls on the same rows);
6. `GroupedExperts` on the local slice; the probs weight the activation inside it as in the plain layer;
7. undo the regroup, inverse all-to-all (same splits, swapped), `unpermute` (sum of the k slots).

The all-to-alls are autograd functions whose backward is the reverse all-to-all, so gradients of the
copies return to the rank that routed them; gloo (CPU) and NCCL both implement `all_to_all_single`.

Telemetry: `tokens_per_expert` holds the GLOBAL per-expert counts `table.sum(0)`, shape `[E]`, identical on
every rank and equal to what one process would count on the concatenated batch; it comes free with step 3
(where several expert-parallel groups split the batch, one all-reduce over the replicas adds theirs).

Gradients (the training convention: each rank's loss is the mean over its own samples, and the global loss
is the mean of the rank losses over the `dp` data-parallel ranks):

- replicated parameters (embeddings, attention, norms, router, head) see only local tokens, so their grad
  on a rank is that of the rank's own loss: average them over the data-parallel ranks as usual (DDP);
- an expert on rank r receives, through the all-to-all backward, the gradient of EVERY EP rank's loss for
  the copies it processed: its local grad is the SUM over the EP group of the rank-loss gradients, i.e. `ep`
  times its share of the global-mean gradient. `apply_expert_parallel` therefore registers a hook that
  divides expert gradients by `ep` (exact for power-of-two `ep`). With `ep == dp` (EP over the data-parallel
  ranks) that is the full answer and expert grads must NOT be all-reduced; with `dp = ep * edp` (the hybrid
  `ep=E,fsdp=N`, built under FSDP2 only) the expert grads are additionally AVERAGED over the `edp` ranks
  that hold the same slice: sum / ep / edp = the mean over all dp ranks. Under `ep=E,fsdp=N` (with or
  without pp) FSDP2 shards each slice over those `edp` replicas (`shard_expert_replicas`, torchtitan's
  expert FSDP): each holds 1/edp of the slice's weights, gradients and AdamW states, the slice is
  all-gathered before the experts' forward and its gradient reduce-scattered after their backward, divided
  by ep * edp there (the hook cannot see FSDP2's gathered copy). Where the slices stay whole on their
  replicas (HSDP, tp or cp with ep: `parallel.Plan.expert_shards`), `average_expert_replicas` all-reduces
  their gradients once per step instead.

So the caller keeps DDP for the replicated parameters and hides the expert slices from it
(`ignore_experts_in_ddp`, before constructing DDP): DDP then neither averages them over the EP group nor
broadcasts rank 0's slice over the others' at construction, and keeps its bucketed, backward-overlapped
all-reduce and `no_sync` for accumulation. Under FSDP2 over the same ranks (`ep=N,fsdp=N`) the slices are
`fully_shard`'s `ignored_params` for the same reasons (FSDP2 neither shards, gathers, casts nor
reduce-scatters them; it averages the rest over the N ranks as DDP would), and the experts compute under
autocast when FSDP2 casts the rest to bf16 (`compute_dtype`). `is_expert_sharded` / `expert_sharded_names`
tell which parameters are sharded, `expert_slice` which rows of the full stack a slice holds;
`clip_grad_norm_ep` clips by the true global norm (expert slices and FSDP2's gradient shards summed over
the group, replicated gradients once; a slice sharded over its replicas is a DTensor on the ("replica",
"ep") mesh, each element on one rank).

Where the whole model exists (DDP), apply EP to the bare model after its weights are initialised
(identically on every rank: slicing the same full tensors keeps the same model), before activation
checkpointing, compile, DDP and the optimizer. The sharded build (FSDP2) applies it on the meta device
and fills the slices afterwards: `shards.full_init` draws each expert stack an expert at a time and keeps
this rank's rows, the checkpoint loaders copy this rank's rows, so both builds start from the same weights. Anything
that replaces parameter objects (`to_empty` from the meta device) drops the marks and the gradient scaling
hooks: `mark_expert_slices` puts them back. State dicts hold only the local slice.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.parallel import DistributedDataParallel as DDP

from timetotrain.fakes import host_sizes, real_host
from timetotrain.models.common.moe import MoE

# Marks expert-sharded Parameters with (experts in the full stack, first expert held); an attribute on the
# tensor survives DDP and optimizers holding it, not `to_empty` from the meta device (`mark_expert_slices`).
_SHARDED = "_ttt_expert_sharded"

# `all_gather_into_tensor` is deprecated in recent torch in favour of `all_gather_single`; keep both working.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Row all-to-all; backward sends the gradient rows back where they came from (splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _pack(rows: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """`[n, d]` rows and `[n]` probs as one `[n, bytes]` uint8 tensor (dtypes may differ, e.g. bf16 + fp32)."""
    return torch.cat(
        [rows.contiguous().view(torch.uint8), probs.contiguous().unsqueeze(1).view(torch.uint8)], 1
    )


def _unpack(buf: torch.Tensor, rows_dtype: torch.dtype, probs_dtype: torch.dtype):
    width = buf.shape[1] - probs_dtype.itemsize
    rows, probs = buf.split([width, probs_dtype.itemsize], dim=1)
    return rows.contiguous().view(rows_dtype), probs.contiguous().view(probs_dtype).squeeze(1)


class _Dispatch(torch.autograd.Function):
    """All-to-all of the grouped copies together with their router probs, in ONE collective each way.

    Two separate all-to-alls would each need their backward to run on every rank in the same order, but
    autograd orders them by when their gradients become ready, which depends on the local graph (a rank
    that receives no rows, the loop vs grouped_mm expert path); one fused collective cannot be misordered.
    """

    @staticmethod
    def forward(ctx, rows, probs, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        ctx.dtypes = rows.dtype, probs.dtype
        buf = _all_to_all(_pack(rows, probs), out_splits, in_splits, group)
        return _unpack(buf, rows.dtype, probs.dtype)

    @staticmethod
    def backward(ctx, grad_rows, grad_probs):
        # Unused outputs arrive as zeros (materialised grads), so every rank sends the same layout back.
        buf = _all_to_all(_pack(grad_rows, grad_probs), ctx.in_splits, ctx.out_splits, ctx.group)
        return (*_unpack(buf, *ctx.dtypes), None, None, None)


class ExpertParallelDispatch:
    """Installed as `MoE.dispatcher` on a layer holding experts `[ep_rank * L, (ep_rank + 1) * L)` of
    `n_experts`; moves the grouped copies to the rank owning their expert and back (module docstring)."""

    def __init__(
        self, group: dist.ProcessGroup | None, ep: int, rank: int, local: int,
        compute_dtype: torch.dtype | None = None, replicas: dist.ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
    ):  # fmt: skip
        self.group, self.ep, self.rank, self.local = group, ep, rank, local
        # The ranks holding the same slice in the other expert-parallel groups (`ep=E,fsdp=N`, E < N), or None.
        self.replicas = replicas
        # The ("replica", "ep") mesh of those groups where FSDP2 shards each slice over its replicas
        # (`shard_expert_replicas`), else None: the slices stay whole and `average_expert_replicas` averages.
        self.mesh = mesh
        # Autocast dtype for the expert matmuls (None: whatever autocast state the caller runs under).
        self.compute_dtype = compute_dtype

    def __call__(self, layer: MoE, grouped: torch.Tensor, grouped_probs: torch.Tensor, counts: torch.Tensor):
        ep, local, rank, group = self.ep, self.local, self.rank, self.group
        n_experts = layer.n_experts
        table = counts.new_empty(ep * n_experts)
        _all_gather(table, counts, group=group)
        table = table.view(ep, n_experts)
        with torch.no_grad():
            layer.tokens_per_expert.copy_(table.sum(0))
            if self.replicas is not None:
                # The other expert-parallel groups routed the rest of the batch (`ep=E,fsdp=N`, `cp=C,ep=E`):
                # the telemetry counts the whole step's tokens, as one process does (a tiny all-reduce).
                dist.all_reduce(layer.tokens_per_expert, group=self.replicas)
        mine = table[:, rank * local : (rank + 1) * local]  # [ep, L]: rows each source sends to my experts
        # to_rank[s][d]: rows source s sends to rank d. The one host sync of the layer: splits are lists.
        to_rank = host_sizes(table.view(ep, ep, local).sum(-1), grouped.shape[0])
        send = to_rank[rank]
        recv = [to_rank[s][rank] for s in range(ep)]

        rx, rp = _Dispatch.apply(grouped, grouped_probs, recv, send, group)
        regroup = None
        if local > 1:
            # Received rows are source-major, then by expert; a stable sort by local expert keeps source order.
            ids = torch.arange(local, device=grouped.device).repeat(ep)
            ids = ids.repeat_interleave(mine.reshape(-1), output_size=sum(recv))
            regroup = torch.sort(ids, stable=True).indices
            rx, rp = rx.index_select(0, regroup), rp.index_select(0, regroup)

        with self._around_experts(rx.device.type):
            if sum(recv) == 0:
                # No rows for any local expert. The experts run anyway, on one zero row of prob 0 for the first
                # local expert, whose output is dropped: the received rows and the weights stay in the graph
                # (the dispatch's backward is a collective every rank must enter; the weights get zero
                # gradients, not None, like the single-process layer's idle experts, so AdamW updates them in
                # step), and where FSDP2 shards the slice over its replicas, their all-gather and
                # reduce-scatter, which every replica must enter too, run here as on the others.
                one = torch.zeros(local, dtype=mine.dtype, device=mine.device)
                one[0] = 1
                row = rx.new_zeros(1, rx.shape[1]) + 0 * rx.sum()
                prob = rp.new_zeros(1) + 0 * rp.sum()
                y = layer.experts(row, one, prob)[:0]
            else:
                y = layer.experts(rx, mine.sum(0), rp)
        if regroup is not None:
            inverse = torch.empty_like(regroup).scatter_(
                0, regroup, torch.arange(regroup.numel(), device=regroup.device)
            )
            y = y.index_select(0, inverse)
        return _AllToAll.apply(y, send, recv, group)

    @contextlib.contextmanager
    def _around_experts(self, device_type: str):
        """The experts' call: under autocast to `compute_dtype` where set; where FSDP2 shards the slices, without
        its warning that the experts return a view (`_ContiguousGrad`'s identity on the grouped-mm path),
        which an in-place op would detach from its pre-backward hook: nothing here writes to it."""
        with contextlib.ExitStack() as stack:
            if self.compute_dtype is not None:
                stack.enter_context(torch.autocast(device_type, dtype=self.compute_dtype))
            if self.mesh is not None:
                stack.enter_context(warnings.catch_warnings())
                warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            yield


def apply_expert_parallel(
    model: nn.Module, group: dist.ProcessGroup | None = None, compute_dtype: torch.dtype | None = None,
    replicas: dist.ProcessGroup | None = None, mesh: DeviceMesh | None = None,
) -> None:  # fmt: skip
    """Shard the experts of every `MoE` in `model` over `group` (default: all ranks), in place; works on a
    model on the meta device too. `compute_dtype`: run the expert matmuls under autocast to it (bf16 under
    FSDP2, which casts only the parameters it manages). `replicas`: the ranks of the other expert-parallel
    groups holding the same slices (the hybrid `ep=E,fsdp=N`), whose gradients `average_expert_replicas`
    averages; with `mesh`, the ("replica", "ep") DeviceMesh of `replicas` and `group`, the slices are to be
    sharded over their replicas by `shard_expert_replicas` instead.

    A group of one rank leaves the model as it is. Raises if a layer's expert count is not a multiple of
    the group size or EP was already applied.
    """
    ep = dist.get_world_size(group)
    if ep == 1:
        return
    rank = dist.get_rank(group)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError("apply_expert_parallel: the model has no MoE layers")
    for name, moe in layers:
        if moe.dispatcher is not None:
            raise ValueError("apply_expert_parallel: expert parallelism is already applied")
        if moe.n_experts % ep:
            raise ValueError(
                f"{name}.experts.w1: {moe.n_experts} experts do not split evenly over {ep} expert-parallel ranks"
            )
        local = moe.n_experts // ep
        lo = rank * local
        for w in ("w1", "w2"):
            full = getattr(moe.experts, w)
            # A fresh Parameter (clone, not a view) so the full stack is freed and the optimizer sees [L, ...].
            shard = nn.Parameter(full.detach()[lo : lo + local].clone(), requires_grad=full.requires_grad)
            setattr(moe.experts, w, shard)
        moe.dispatcher = ExpertParallelDispatch(group, ep, rank, local, compute_dtype, replicas, mesh)
    mark_expert_slices(model)


def _sharded_dispatchers(model: nn.Module) -> list[tuple[MoE, ExpertParallelDispatch]]:
    """The expert-parallel layers whose slices FSDP2 shards over their replicas (`ExpertParallelDispatch.mesh`)."""
    out = []
    for moe in model.modules():
        dispatch = getattr(moe, "dispatcher", None) if isinstance(moe, MoE) else None
        if isinstance(dispatch, ExpertParallelDispatch) and dispatch.mesh is not None:
            out.append((moe, dispatch))
    return out


def shard_expert_replicas(model: nn.Module, param_dtype: torch.dtype | None) -> None:
    """`fully_shard` every expert slice over the N / E ranks that hold it (`ep=E,fsdp=N`, E < N, and the same
    within a pipeline stage), torchtitan's expert FSDP ("efsdp"): each rank keeps 1/(N/E) of its slice's fp32
    weights, gradients and AdamW states; FSDP2 all-gathers the slice (in `param_dtype`) before the experts'
    forward and reduce-scatters its gradient after their backward. The gradient a replica computes is the
    sum over its expert-parallel group of the rank-loss gradients (module docstring), so the reduce-scatter
    divides the sum over the N / E replicas by N = E x N / E: the mean over all data-parallel ranks, what the
    `ep` hook and `average_expert_replicas` give whole slices. Dim 0 (experts) is cut where the local
    experts divide evenly, else dim 1 (torchtitan's choice too: no padded, empty shards). Call on the model
    before FSDP2 wraps its blocks (which then leave the slices to this inner wrap), on the meta device or
    not; the probs stay in their dtype (`cast_forward_inputs=False`: the experts weight the activation in
    fp32, as without FSDP2)."""
    for moe, dispatch in _sharded_dispatchers(model):
        with real_host():  # slicing a mesh reads rank ids (timetotrain/fakes.py)
            replicas = dispatch.mesh["replica"]
        size = replicas.size()
        dim = 0 if dispatch.local % size == 0 else 1
        mp = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        fully_shard(moe.experts, mesh=replicas, mp_policy=mp, shard_placement_fn=lambda p, d=dim: Shard(d))
        moe.experts.set_gradient_divide_factor(float(dispatch.ep * size))
        if dist.get_backend(replicas.get_group()) != "nccl":
            # gloo (CPU) has no pre-multiplied sum: sum, then divide (as the rest's AVG is done there).
            moe.experts.set_force_sum_reduction_for_comms(True)
    mark_expert_slices(model)


@torch.no_grad()
def average_expert_replicas(model: nn.Module) -> None:
    """Under `ep=E,fsdp=N` (E < N): average every expert slice's gradient over the N / E ranks that hold the
    same slice, so that it is the mean over all N data-parallel ranks (module docstring: each group's
    gradient is already the mean over its E ranks). Once per optimizer step, after the last micro-batch's
    backward, in module order on every rank (a gradient hook would run in each rank's own autograd order,
    which differs where a rank receives no rows). gloo has no AVG: a sum, then a division. Without
    replicas it does nothing."""
    for moe in model.modules():
        dispatch = getattr(moe, "dispatcher", None) if isinstance(moe, MoE) else None
        if not isinstance(dispatch, ExpertParallelDispatch) or dispatch.replicas is None:
            continue
        n = dist.get_world_size(dispatch.replicas)
        for p in (moe.experts.w1, moe.experts.w2):
            # (A slice FSDP2 shards over its replicas, a DTensor, was averaged by its reduce-scatter.)
            if p.grad is not None and not isinstance(p, DTensor):
                dist.all_reduce(p.grad, group=dispatch.replicas)
                p.grad.div_(n)


def mark_expert_slices(model: nn.Module) -> None:
    """Mark the expert slices of every expert-parallel `MoE` in `model` and give each the hook that divides
    its gradient by `ep`; once per parameter object, so calling it again only covers parameters replaced
    since (`to_empty` from the meta device makes new ones, without the mark or the hook)."""
    for moe in model.modules():
        dispatch = getattr(moe, "dispatcher", None) if isinstance(moe, MoE) else None
        if not isinstance(dispatch, ExpertParallelDispatch):
            continue
        for p in (moe.experts.w1, moe.experts.w2):
            if getattr(p, _SHARDED, None) is not None:
                continue
            setattr(p, _SHARDED, (moe.n_experts, dispatch.rank * dispatch.local))
            # (A slice FSDP2 shards over its replicas, a DTensor, is divided by its reduce-scatter instead:
            # the forward runs on FSDP2's gathered copy, whose gradient never reaches this tensor's hooks.)
            if p.requires_grad and not isinstance(p, DTensor):
                # Each rank's expert grad sums all EP ranks' loss gradients: divide by ep (module docstring).
                p.register_hook(lambda g, ep=dispatch.ep: g / ep)


def is_expert_sharded(p: torch.Tensor) -> bool:
    return getattr(p, _SHARDED, None) is not None


def expert_slice(p: torch.Tensor) -> tuple[int, int] | None:
    """For an expert slice: (experts in the full stack, index of the first expert it holds); else None. The
    slice is rows `[first, first + p.shape[0])` of the full `[experts, ...]` tensor."""
    return getattr(p, _SHARDED, None)


def expert_sharded_names(model: nn.Module) -> list[str]:
    """Qualified names of the expert-sharded parameters of `model` (as `model.named_parameters` spells them)."""
    return [n for n, p in model.named_parameters() if is_expert_sharded(p)]


def expert_dtensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every expert slice of `model` as a DTensor of its full `[E, ...]` stack, sharded on dim 0 over the
    expert-parallel group and sharing the slice's storage, by the slice's parameter name (wrapper levels
    included). What torch.distributed.checkpoint needs to write and read the slices of all ranks as one
    tensor (a plain tensor it takes for a replica, keeping rank 0's alone). A slice FSDP2 shards over its
    replicas (`shard_expert_replicas`) is a DTensor on the ("replica", "ep") mesh: its local shard is the
    replica's part of the group's part, as FSDP2 over tensor parallelism cuts a TP shard again
    (`_StridedShard` over the replicas where FSDP2 cut dim 0, a plain `Shard(1)` where it cut dim 1)."""
    meshes: dict[int, DeviceMesh] = {}
    out = {}
    for prefix, moe in model.named_modules():
        dispatch = getattr(moe, "dispatcher", None) if isinstance(moe, MoE) else None
        if not isinstance(dispatch, ExpertParallelDispatch):
            continue
        group = dispatch.group or dist.group.WORLD
        for name in ("w1", "w2"):
            p = getattr(moe.experts, name)
            shape = torch.Size((moe.n_experts, *p.shape[1:]))
            stride = torch.empty(shape, device="meta").stride()
            if isinstance(p, DTensor):
                (inner,) = p.placements
                outer = _StridedShard(0, split_factor=dispatch.ep) if inner.dim == 0 else inner
                mesh, placements, local = dispatch.mesh, [outer, Shard(0)], p.to_local()
            else:
                if id(group) not in meshes:
                    meshes[id(group)] = DeviceMesh.from_group(group, p.device.type)
                mesh, placements, local = meshes[id(group)], [Shard(0)], p
            view = DTensor.from_local(
                local.detach(), mesh, placements, run_check=False, shape=shape, stride=stride
            )
            # (checkpoint.py hands the parameter back after loading into the view, which shares its storage)
            view._ttt_expert_view = p
            out[f"{prefix}.experts.{name}"] = view
    return out


def ignore_experts_in_ddp(model: nn.Module) -> None:
    """Call on the module about to be wrapped in DDP: DDP then neither all-reduces nor broadcasts the
    expert slices. (`_set_params_and_buffers_to_ignore_for_model` is DDP's static hook for exactly this.)"""
    DDP._set_params_and_buffers_to_ignore_for_model(model, expert_sharded_names(model))


@torch.no_grad()
def clip_grad_norm_ep(
    params: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """`clip_grad_norm_` (2-norm) over a model whose experts are sharded over `group`; returns the norm.

    Replicated gradients (already averaged, so equal on every rank) count once; the squared norms of the
    expert slices, and of FSDP2's gradient shards (DTensors, `ep=N,fsdp=N`: sharded over the same ranks as
    `group`, each element on one rank), are summed over `group`. Every rank of `group` must call it (one
    all-reduce). Without an initialised process group it is plain global-norm clipping.
    """
    params = [p for p in params if p.grad is not None]
    # FSDP2's gradient shards of the rest, and of the expert slices it shards over their replicas
    # (`shard_expert_replicas`: on another mesh, but with the slices' groups they cover the same ranks).
    fsdp = [p.grad for p in params if isinstance(p.grad, DTensor) and not is_expert_sharded(p)]
    expert_shards = [p.grad for p in params if isinstance(p.grad, DTensor) and is_expert_sharded(p)]
    wider = None  # FSDP2's group when it is wider than the expert-parallel one (`ep=E,fsdp=N`, E < N)
    for g in fsdp[:1]:
        # Under HSDP (`dp_replicate=R,fsdp=S,ep=E`) the mesh is (replicate, shard): the gradients are
        # already averaged over the replicas, so the sums run over one shard group, as under `fsdp=S`.
        hsdp = len(g.placements) == 2 and g.placements[0].is_replicate()
        shards = g.device_mesh.get_group(1 if hsdp else 0)
        size = dist.get_world_size(shards)
        if (len(g.placements) != 1 and not hsdp) or size % dist.get_world_size(group):
            raise ValueError(
                "clip_grad_norm_ep: FSDP2 must shard over the expert-parallel group or a multiple"
            )
        if size != dist.get_world_size(group):
            wider = shards
    if expert_shards and wider is None:
        raise ValueError(
            "clip_grad_norm_ep: expert slices sharded over replicas need FSDP2 over all their ranks"
        )
    replicated = [p.grad for p in params if not is_expert_sharded(p) and not isinstance(p.grad, DTensor)]
    experts = [p.grad for p in params if is_expert_sharded(p) and not isinstance(p.grad, DTensor)]
    sharded = experts + [g.to_local() for g in fsdp + expert_shards]
    device = params[0].grad.device if params else torch.device("cpu")
    zero = torch.zeros((), device=device, dtype=torch.float32)
    rep = torch.nn.utils.get_total_norm(replicated, foreach=foreach) if replicated else zero
    if wider is None:
        shard_sq = torch.nn.utils.get_total_norm(sharded, foreach=foreach) ** 2 if sharded else zero.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(shard_sq, group=group)
    else:
        # One sum over FSDP2's N ranks: every element of an FSDP2 shard, the rest's or an expert slice's
        # sharded over its replicas, sits on one rank; a whole expert slice is held (averaged, equal) by
        # N / E of them, so it counts 1 / (N / E) per holder.
        local = [g.to_local() for g in fsdp + expert_shards]
        shard_sq = torch.nn.utils.get_total_norm(local, foreach=foreach) ** 2 if local else zero.clone()
        if experts:
            copies = dist.get_world_size(wider) // dist.get_world_size(group)
            shard_sq = shard_sq + torch.nn.utils.get_total_norm(experts, foreach=foreach) ** 2 / copies
        dist.all_reduce(shard_sq, group=wider)
    total = (rep**2 + shard_sq).sqrt()
    if fsdp or expert_shards:
        # DTensor gradients take no plain-tensor factor: scale the local shards (as clip_grads_with_norm_).
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(replicated + sharded, coef)
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total
