"""Node classification on a heterogeneous graph (MLPerf rgat): sampled subgraphs around shuffled training
seeds, cross-entropy on the seeds' logits, accuracy on the validation seeds (an equal share per rank, as the
reference reads them), eval points in epochs.

A batch is one subgraph: `y` (the seeds' labels), `x.<type>` (features of every sampled node of a type,
seeds first) and `e.<src>__<rel>__<dst>` (local edge index [2, E]). Only `y` has the sample dimension, so a
batch cannot be cut into micro-batches (`validate` refuses gradient accumulation); data parallelism splits
the seeds instead, each rank sampling its own subgraph.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from timetotrain.data import graph_synth, igbh
from timetotrain.data.sampler import NeighbourSampler
from timetotrain.errors import UserError
from timetotrain.models import rgat
from timetotrain.spec.task import Batch, DataRecipe, Metric, RunData, Share, Task, evaluate_ratio

SEED_TYPE = "paper"


@dataclass(frozen=True)
class GraphData:
    fanouts: tuple[int, ...] = (15, 10, 5)
    train_fraction: float = 0.6
    val_fraction: float = 0.005
    eval_batch: int = 1024  # validation seeds per sampled subgraph
    # The reference's --validation_frac_within_epoch: an eval every int(batches per epoch x this) batches,
    # counted within each epoch (`eval_interval`).
    eval_fraction: float = 0.05
    # What the preflight expects: rows per node type (empty: not checked), labeled papers (None: any).
    num_nodes: tuple[tuple[str, int], ...] = ()
    num_labeled: int | None = None
    how_to_make: str = "download IGBH-full with `ttt data download --for rgat --tier reference --out DIR`"
    synth_scale: str = (
        "tiny"  # the generated graph of `ttt synth` and the warm-up (sizes scale with the batch)
    )


def batches_per_epoch(train_seeds: int, gbs: int) -> int:
    """Steps in one epoch: the reference's loader keeps the last, partial batch (drop_last=False)."""
    return -(-train_seeds // gbs)


def eval_interval(batches: int, fraction: float) -> int:
    """The reference's `validation_freq = int(batch_num * validation_frac_within_epoch)`
    (train_rgnn_multi_gpu.py), at least 1: an epoch shorter than 1/fraction batches evaluates every batch
    where the reference would divide by zero."""
    return max(int(batches * fraction), 1)


def eval_seeds(val_seeds: int, world: int) -> int:
    """Validation seeds one evaluation reads on `world` ranks: the reference splits `val_idx` into chunks
    of floor(len / world) seeds and gives rank r chunk r (train_rgnn_multi_gpu.py:96; `Share.equal_part`), so
    the last `len % world` seeds are never evaluated (3 of 788,379 on 4 GPUs)."""
    return val_seeds - val_seeds % world


def _split(tier) -> tuple[int, float, float]:
    return tier.data.num_labeled, tier.data.train_fraction, tier.data.val_fraction


def train_seeds(tier) -> int:
    return igbh.split_sizes(*_split(tier))[0]


def batch_of(graph: igbh.Graph, sub, labels: torch.Tensor | None) -> Batch:
    """A sampled subgraph as a batch: features gathered from the memory-mapped files (never cached)."""
    if graph.mapped is not None:
        graph.mapped.check_unchanged()  # before touching the mapped pages: a file cut short is a SIGBUS
    out = {f"x.{t}": igbh.gather_features(graph.feats[t], ids) for t, ids in sub.nodes.items()}
    out.update({f"e.{igbh.rel_key(r)}": e for r, e in sub.edges.items()})
    # The per-hop counts that trim each layer ride in the shapes of empty tensors: the harness moves them
    # to the device with the batch, and reading a shape never waits for the device (a count tensor would
    # need .tolist(), a host sync every step).
    out.update({f"h.{t}": torch.empty(0, *c) for t, c in sub.node_hops.items()})
    out.update({f"g.{igbh.rel_key(r)}": torch.empty(0, *c) for r, c in sub.edge_hops.items()})
    if labels is not None:
        out["y"] = labels
    return out


def forward(model, batch: Batch) -> torch.Tensor:
    x = {k[2:]: v for k, v in batch.items() if k.startswith("x.")}
    edges = {tuple(k[2:].split("__")): v for k, v in batch.items() if k.startswith("e.")}
    nodes = {k[2:]: v.shape[1:] for k, v in batch.items() if k.startswith("h.")}
    counts = {tuple(k[2:].split("__")): v.shape[1:] for k, v in batch.items() if k.startswith("g.")}
    return model(x, edges, batch["y"].shape[0], (nodes, counts))


def _loss(model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(forward(model, batch), batch["y"], reduction=reduction)


def _generator(*parts: int) -> torch.Generator:
    """A generator seeded from (run seed, purpose, step, rank): the same subgraph for the same step on any
    thread, in any order, on every rerun."""
    return torch.Generator().manual_seed(
        int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0]) >> 1
    )


class _Seeds(RunData):
    def __init__(self, graph: igbh.Graph, train, val, spec: GraphData, gbs, share: Share, seed, device):
        self.graph, self.train, self.spec = graph, train, spec
        # An epoch is the reference's batches_per_epoch batches, so eval points and `epoch_num` (the loop's
        # samples / samples_per_epoch = steps / batches, the reference's epoch + idx / batch_num) restart
        # with each epoch. Its last batch, partial in the reference, is filled with the epoch's first seeds:
        # every batch is whole, so each rank's share and `samples_count` stay exact.
        self.batches = batches_per_epoch(len(train), gbs)
        self.samples_per_epoch = self.batches * gbs
        self.gbs, self.local, self.offset = gbs, share.local, share.offset
        self.rank, self.world, self.seed, self.device = share.rank, share.world, seed, device
        self.val = val[share.equal_part(len(val))]  # equal shares, as the reference's (`eval_seeds`)
        # One sampler per thread: batches are sampled on the prefetch thread, evaluations on the main one.
        self.sampler = NeighbourSampler(graph.csc, graph.num_nodes, spec.fanouts)
        self.eval_sampler = NeighbourSampler(graph.csc, graph.num_nodes, spec.fanouts)
        self._order: dict[int, torch.Tensor] = {}
        self._evals = 0

    def _epoch(self, epoch: int) -> torch.Tensor:
        if epoch not in self._order:  # one seeded shuffle per epoch, the same on every rank
            g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
            self._order = {epoch: self.train[torch.randperm(len(self.train), generator=g)]}
        return self._order[epoch]

    def seeds(self, step: int) -> torch.Tensor:
        """This rank's seeds of batch `step` (from 0): batch j of epoch e is positions [j x GBS, (j+1) x GBS)
        of that epoch's shuffle, wrapping to its start in the last batch."""
        epoch, j = divmod(step, self.batches)
        start = j * self.gbs + self.offset
        return self._epoch(epoch)[torch.arange(start, start + self.local) % len(self.train)]

    def batch(self, step: int) -> Batch:
        seeds = self.seeds(step)
        sub = self.sampler.sample(SEED_TYPE, seeds, _generator(self.seed, 0, step, self.rank))
        return batch_of(self.graph, sub, self.graph.labels[seeds])

    def loss(self, model, batch, reduction="mean"):
        return _loss(model, batch, reduction)

    def evaluate(self, model, autocast=None) -> float:
        self._evals += 1
        gen = _generator(self.seed, 1, self._evals, self.rank)

        def items():
            for chunk in self.val.split(self.spec.eval_batch):
                sub = self.eval_sampler.sample(SEED_TYPE, chunk, gen)
                yield {
                    k: v.to(self.device)
                    for k, v in batch_of(self.graph, sub, self.graph.labels[chunk]).items()
                }

        def correct(m, b):
            return (forward(m, b).argmax(-1) == b["y"]).sum(), b["y"].shape[0]

        return evaluate_ratio(model, items(), correct, self.device, self.world, autocast)


class _Synthetic(RunData):
    """Subgraphs of a generated graph held in memory, made on the host and moved to the device (sampling
    is part of what `ttt synth` measures)."""

    def __init__(self, tier, local_batch: int, generator: torch.Generator, device):
        cfg = tier.model
        base = graph_synth.SCALES[tier.data.synth_scale]
        # Enough papers that a batch's 3-hop neighbourhood is not the whole graph, at most ~1/8 of `small`.
        factor = min(max(40 * local_batch / base.papers, 0.04), 1.0)
        sc = graph_synth.scaled(base, factor, dim=cfg.in_dim, classes=cfg.classes)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        self.graph = graph_synth.in_memory(sc, seed)
        self.sampler = NeighbourSampler(self.graph.csc, self.graph.num_nodes, tier.data.fanouts)
        self.n, self.generator, self.device = local_batch, generator, device
        self._seconds, self._subgraphs, self._edges, self._flops = 0.0, 0, 0, 0.0
        self.cfg = cfg

    def batch(self, step):
        t0 = time.perf_counter()
        seeds = torch.randint(0, len(self.graph.labels), (self.n,), generator=self.generator)
        sub = self.sampler.sample(SEED_TYPE, seeds, self.generator)
        b = batch_of(self.graph, sub, self.graph.labels[seeds])
        self._seconds += time.perf_counter() - t0
        self._subgraphs += 1
        self._edges += sub.num_edges
        self._flops += rgat.subgraph_flops(self.cfg, sub.node_hops, sub.edge_hops, self.n)
        return {k: v.to(self.device) for k, v in b.items()}

    def figures(self) -> dict[str, float]:
        """The sampler alone (sampling and feature gathering, on the host), over every batch made."""
        s = max(self._seconds, 1e-9)
        return {
            "sampled subgraphs/s": self._subgraphs / s,
            "sampled seeds/s": self._subgraphs * self.n / s,
            "sampled edges/s": self._edges / s,
            "model GFLOP/subgraph (counted)": self._flops / max(self._subgraphs, 1) / 1e9,
        }

    def loss(self, model, batch, reduction="mean"):
        return _loss(model, batch, reduction)


class Resolved:
    def __init__(self, files: igbh.GraphFiles, cache_seconds: float):
        self.graph_files, self.cache_seconds = files, cache_seconds

    def files(self):
        return self.graph_files.files()


def _generated_sizes(scale: str) -> tuple:
    """Node counts per type of the generated graph of that scale, () when there is no such scale."""
    if scale not in graph_synth.SCALES:
        return ()
    sc = graph_synth.SCALES[scale]
    counts = (sc.papers, sc.authors, sc.institutes, sc.fos, sc.journals, sc.conferences)
    return tuple(zip(igbh.NODE_TYPES, counts, strict=True))


class NodeClassification(Task):
    metric = Metric("validation accuracy", higher_is_better=True, unit="epochs", epoch_decimals=2)
    whole_batches = True

    def validate(self, tier) -> None:
        if "micro_batch_size" in tier.user_set and tier.micro_batch_size != tier.global_batch_size:
            raise UserError(
                f"--set micro_batch_size={tier.micro_batch_size}: a sampled subgraph is one batch; node "
                "classification has no gradient accumulation (micro_batch_size = global_batch_size)"
            )
        if len(tier.data.fanouts) != tier.model.n_layers:
            raise UserError(
                f"{len(tier.data.fanouts)} fanouts for {tier.model.n_layers} layers: one per layer"
            )
        if tier.data.num_labeled is None:
            raise UserError(
                f"{tier.name}: the tier's graph must say how many papers are labeled (num_labeled)"
            )

    def eval_due(self, tier, step: int) -> bool:
        """The reference's cadence (train_rgnn_multi_gpu.py): an eval after batch `idx` of an epoch when
        idx % int(batches_per_epoch x 0.05) == 0, idx restarting at 1 each epoch. A tier whose
        `eval_every_samples` was --set evaluates every that many samples instead."""
        if "eval_every_samples" in tier.user_set:
            return super().eval_due(tier, step)
        batches = batches_per_epoch(train_seeds(tier), tier.global_batch_size)
        return ((step - 1) % batches + 1) % eval_interval(batches, tier.data.eval_fraction) == 0

    def steps_at_gbs(self, tier, gbs: int) -> int:
        """The reference runs `--epochs` (2) epochs at any GBS (train_rgnn_multi_gpu.py:153,294): a new GBS
        keeps the tier's epochs, not its steps."""
        n = train_seeds(tier)
        epochs = max(tier.max_steps // batches_per_epoch(n, tier.global_batch_size), 1)
        return epochs * batches_per_epoch(n, gbs)

    def eval_windows(self, tier, world: int = 1) -> int:
        """Validation seeds one evaluation reads on `world` data-parallel ranks (`eval_seeds`); the log's
        `eval_samples` is the whole validation split, as the reference's."""
        return eval_seeds(igbh.split_sizes(*_split(tier))[1], world)

    def _generated(self, tier) -> bool:
        return bool(tier.data.num_nodes) and tier.data.num_nodes == _generated_sizes(tier.name)

    def data_name(self, tier) -> str | None:
        return f"igbh-synth-{tier.name}" if self._generated(tier) else None

    def data_recipe(self, tier, source: Path) -> DataRecipe:
        """A tier on a generated graph writes it (`source` is not read); the real IGBH is downloaded and
        named with `--data BENCH=DIR`. Seed 0 is `ttt data synth-graph`'s default, the graph the tiny RCP
        was measured on."""
        if not self._generated(tier):
            raise UserError(
                f"{tier.name} reads IGBH-full, which no recipe here makes: {tier.data.how_to_make}, then pass "
                "--data rgat=DIR"
            )
        scale = graph_synth.scale(tier.name)
        return DataRecipe(
            self.data_name(tier),
            f"a synthetic IGBH-like {tier.name} graph (seed 0)",
            call=lambda out: graph_synth.generate(Path(out), scale, seed=0, log=lambda *a: None),
        )

    def resolve(self, tier, data_dir: Path, verify: bool = True, init_checkpoint=None):
        spec: GraphData = tier.data
        files = igbh.check_layout(Path(data_dir))
        for t, n in spec.num_nodes:
            if files.num_nodes[t] != n:
                raise UserError(
                    f"{files.root / t / igbh.FEAT_FILE} has {files.num_nodes[t]:,} rows; the {tier.name} graph "
                    f"has {n:,} {t} nodes: {spec.how_to_make}"
                )
        if spec.num_labeled is not None and files.num_labeled != spec.num_labeled:
            raise UserError(
                f"{files.root / 'paper' / igbh.LABEL_FILE} has {files.num_labeled:,} labels; the {tier.name} "
                f"graph labels {spec.num_labeled:,} papers: {spec.how_to_make}"
            )
        if files.dim != tier.model.in_dim:
            raise UserError(
                f"{files.root / 'paper' / igbh.FEAT_FILE} has {files.dim}-d features; the {tier.name} model "
                f"reads {tier.model.in_dim}: {spec.how_to_make}"
            )
        if verify:  # a generated graph's manifest: sizes and sha256s, the same one-line errors as C4's
            igbh.verify(files)
        # Before the clock: a label outside the model's classes is bad data, not a run that aborts (it
        # would leave a result file). One pass over the labels, as reading them at open() did.
        label_file = files.root / "paper" / igbh.LABEL_FILE
        labels = np.load(label_file, mmap_mode="r", allow_pickle=False)
        if len(labels) and (int(labels.max()) >= tier.model.classes or int(labels.min()) < 0):
            raise UserError(f"{label_file}: labels outside [0, {tier.model.classes})")
        seconds = igbh.build_csc(files, log=lambda s: print(s, flush=True))
        if seconds:
            print(f"graph cache built in {seconds:.1f} s (off the clock: the rules allow graph caching)")
        return Resolved(files, seconds)

    def open(self, tier, resolved, seed, share, device):
        spec: GraphData = tier.data
        graph = igbh.open_graph(resolved.graph_files)  # labels range-checked in resolve(), before the clock
        train, val = igbh.split(len(graph.labels), spec.train_fraction, spec.val_fraction)
        return _Seeds(graph, train, val, spec, tier.global_batch_size, share, seed, device)

    def synthetic(self, tier, local_batch, generator, device):
        return _Synthetic(tier, local_batch, generator, device)

    def flops_per_sample(self, family, tier):
        """A lower bound: the FLOPs of the seed itself through every layer. How many nodes a seed brings in
        depends on the graph (3-hop neighbourhoods overlap more the smaller it is), so `ttt synth` also
        counts the FLOPs of each sampled subgraph (`figures`); an upper bound at the full fanouts would
        put MFU above 100% on small graphs."""
        return family.flops_per_token(tier.model)

    def sample_items(self, tier):
        return "seeds", 1

    def hyperparameters(self, bench, tier, accum):
        return [
            ("global_batch_size", tier.global_batch_size),
            ("gradient_accumulation_steps", accum),
            ("opt_base_learning_rate", tier.lr),
            *bench.optimizer.log_keys(),
            ("ttt_fanouts", list(tier.data.fanouts)),
            # The split's sizes, as the reference logs them (train_idx.size(0), val_idx.size(0)).
            *zip(
                ("train_samples", "eval_samples"),
                igbh.split_sizes(*_split(tier)),
                strict=True,
            ),
        ]

    def baseline_loss(self, tier):
        return math.log(tier.model.classes)
