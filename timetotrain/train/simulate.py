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
  the first), so the peak is reached by then; the loss of a shorter step is the same code.
- Depth (`layers`): the model is simulated at `L` and at `L + unit` repeated layers (unit: one layer; flux's
  double:single 1:2 triple) and every byte count is extrapolated linearly to the tier's depth. That holds
  only where the added layers are identical: the embedding, head, MTP and DeepSeek's dense-first layers sit
  in both simulated models (L starts past them), gpt-oss alternates sliding and full attention, whose kept
  tensors have the same shapes. Without `layers` the full depth runs.
- Ranks: FSDP2 cuts dim 0 as `torch.chunk` does, so the first ranks hold the largest shards and the last
  may hold fewer rows or none; the chosen rank and the last rank are simulated and the larger is "the most
  loaded". (No pipeline parallelism: every rank holds a part of every layer.)
- MoE routing is balanced (timetotrain/fakes.py): real routing skews expert loads, and a rank receiving more
  copies needs more activation memory than simulated.
- Not simulated: DDP layouts (`dp=N`, `ep=N`): DDP's constructor checks parameter shapes across ranks in C++
  by reading their data, which fake tensors have none of. Allocator fragmentation, NCCL buffers and the
  CUDA context are not tensors: `ttt plan`'s margin stands for them.
"""

from __future__ import annotations

import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from timetotrain.errors import UserError
from timetotrain.train import distributed, prepare
from timetotrain.train.synth import _with_layers

KINDS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "gathered", "other")


@dataclass
class RankMemory:
    """Bytes of one simulated rank (one depth): at the peak by kind, and the steady states."""

    rank: int
    peak: dict[str, int]  # kind -> bytes, at the moment of the peak
    parameters: int  # this rank's parameters and buffers (shards, expert slices)
    gradients: int  # gradients when the optimizer starts
    optimizer: int  # optimizer states after its first step
    where: str  # the module and phase of the peak
    empty: list[str] = field(default_factory=list)  # parameters this rank holds no rows of

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


def _tracker(model, opt, fsdp: bool):
    """The tracker, recording where (module, phase) each new peak is reached."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    base = FSDPMemTracker if fsdp else MemTracker

    class Tracker(base):
        where = "before the step"

        def _update_peak_stats(self, peak_state) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            if self._peak_mem != before:
                inner = sorted(self._mod_tracker.parents - {"Global"}, key=len)
                phase = (
                    "optimizer step"
                    if self._in_opt
                    else ("backward" if self._mod_tracker.is_bw else "forward")
                )
                self.where = f"{phase}, in {inner[-1] if inner else 'the step outside modules'}"

    if fsdp:
        return Tracker(model, opt)
    t = Tracker()
    t.track_external(model, opt)
    return t


def _empty_shards(model) -> list[str]:
    from torch.distributed.tensor import DTensor

    return [n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.to_local().numel() == 0]


def simulate_rank(
    bench, tier, world: int, spec: str, rank: int, precision: str, ac: bool, fake: bool = True
) -> RankMemory:  # fmt: skip
    """Build rank `rank` of `world` for `tier` (already at the depth to simulate) and run one step, counting
    its bytes. `fake=False` measures a real run instead, with the same tracker: this process is that rank of
    a torchrun job (gloo), and the tensors are real (the check of the simulator, tests/test_simulate.py)."""
    import contextlib

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    prep = prepare.preflight(
        bench, tier, Path(tempfile.gettempdir()), spec, precision, ac, False, device="cpu", seed=0,
        ranks=distributed.Dist(rank=rank, world=world, local_rank=0),
    )  # fmt: skip
    if prep.plan.dp > 1:
        raise UserError(
            f"--simulate --parallel {spec}: DDP layouts (dp, ep without fsdp) cannot be simulated: DDP's "
            "constructor reads parameter data, which fake tensors have none of; simulate fsdp or ep=N,fsdp=N"
        )
    if fake:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        prepare.start_device(prep, "cpu", seed=0)
        micro = prep.tier.micro_batch_size
        accum = min(prep.accum, 2)  # module docstring: the second micro-batch repeats the first's allocations
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            try:
                tr = prepare.build(prep)
            except (RuntimeError, ValueError, AssertionError, TypeError) as e:
                raise UserError(
                    f"--parallel {spec}: rank {rank} of {world} does not build: {_line(e)}"
                ) from e
            data = bench.task.synthetic(
                prep.tier, micro * accum, torch.Generator().manual_seed(0), prep.device
            )
            batch = data.batch(0)
            mt = _tracker(tr.bare, tr.opt, prep.plan.fsdp > 1)
            seen: dict[str, dict] = {}

            def snap(name: str):
                def hook(*_) -> None:
                    seen.setdefault(name, mt.get_tracker_snapshot())

                return hook

            pre = tr.opt.register_step_pre_hook(snap("grads"))
            post = tr.opt.register_step_post_hook(snap("opt"))

            def loss(model, mb):
                mt.reset_mod_stats()  # the trackers refuse a second forward of the root otherwise
                return data.loss(model, mb)

            with mt:
                try:
                    tr.step(0, batch, accum, loss)
                except (RuntimeError, ValueError, AssertionError, TypeError) as e:
                    raise UserError(
                        f"--parallel {spec}: rank {rank} of {world} fails its step: {_line(e)}"
                    ) from e
            pre.remove()
            post.remove()
            grads, opt = _by_kind(seen["grads"]), _by_kind(seen["opt"])
            peak = _by_kind(mt.get_tracker_snapshot("peak"))
            return RankMemory(
                rank, peak, grads["parameters"], grads["gradients"], opt["optimizer"], mt.where,
                _empty_shards(tr.bare),
            )  # fmt: skip
    finally:
        distributed.teardown(barrier=not fake)


def _line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (torch's name the tensor)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def depth_unit(bench, tier) -> tuple[int, int]:
    """(the smallest simulated depth, the repeat unit) for extrapolation (module docstring)."""
    cfg = tier.model
    if bench.family.with_layers is not None:  # flux: double:single as 1:2
        return 3, 3
    return getattr(cfg, "first_dense", 0) + 1, 1


@dataclass
class Simulation:
    bench: str
    tier: str
    world: int
    parallel: str
    precision: str
    ac: bool
    layers: tuple[int, int] | None  # the two simulated depths (None: full depth)
    full_layers: int
    ranks: dict[int, RankMemory]  # rank -> extrapolated bytes (a RankMemory of the full depth)
    micro_batch: int
    accum: int
    seconds: float
    rss: int

    def most_loaded(self) -> RankMemory:
        return max(self.ranks.values(), key=lambda m: m.total)


def _combine(a: RankMemory, b: RankMemory, steps: float) -> RankMemory:
    """`a` + `steps` x (b - a), every count: linear in identical layers (module docstring)."""

    def lin(x: int, y: int) -> int:
        return max(0, round(x + steps * (y - x)))

    peak = {k: lin(a.peak[k], b.peak[k]) for k in KINDS}
    return RankMemory(
        a.rank, peak, lin(a.parameters, b.parameters), lin(a.gradients, b.gradients),
        lin(a.optimizer, b.optimizer), b.where, b.empty,
    )  # fmt: skip


def simulate(
    bench, tier, world: int, spec: str, rank: int = 0, layers: int | None = None, precision: str = "bf16",
    ac: bool = False,
) -> Simulation:  # fmt: skip
    """Rank `rank` and the last rank of `world`, at the tier's depth or extrapolated from `layers`."""
    if not 0 <= rank < world:
        raise UserError(f"--rank {rank} must be in [0, {world - 1}] (--gpus {world})")
    full = _depth(tier)
    t0 = time.monotonic()
    depths = None
    if layers is not None:
        least, unit = depth_unit(bench, tier)
        if layers < least:
            raise UserError(
                f"--layers {layers}: simulate at least {least} layers here (the layers before them differ "
                "from the repeated ones, so extrapolation needs them in)"
            )
        if layers + unit <= full:
            depths = (layers, layers + unit)
    ranks = {}
    for r in sorted({rank, world - 1}):
        if depths is None:
            ranks[r] = simulate_rank(bench, tier, world, spec, r, precision, ac)
            continue
        a, b = (
            simulate_rank(bench, _with_layers(bench, tier, d), world, spec, r, precision, ac) for d in depths
        )
        ranks[r] = _combine(a, b, (full - depths[0]) / (depths[1] - depths[0]))
    prep_tier = tier
    local = tier.global_batch_size // _data_parallel(spec, world)
    micro = min(prep_tier.micro_batch_size, local)
    return Simulation(
        bench.name, tier.name, world, spec, precision, ac, depths, full, ranks, micro, local // micro,
        time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )  # fmt: skip


def _depth(tier) -> int:
    cfg = tier.model
    if hasattr(cfg, "n_double"):
        return cfg.n_double + cfg.n_single
    return cfg.n_layers


def _data_parallel(spec: str, world: int) -> int:
    from timetotrain.train import parallel

    return parallel.parse(spec, world, world_from="--gpus is").data_parallel
