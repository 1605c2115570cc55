"""rgat side by side: the neighbour sampler on a generated graph, and one training step of our R-GAT against
the reference's PyG HeteroConv(GATConv) model on the same subgraphs, alternated in one process.

    python bench/rgat.py                      # sampler on the `small` graph; steps at the tiny tier's model
    python bench/rgat.py --scale tiny --steps-only

Sampler figures: seeds/s and sampled edges/s at batch 1,024, fanouts 15/10/5 (sampling plus feature
gathering, as a training batch needs). PyG's NeighborLoader needs pyg-lib or torch-sparse; where neither
imports, it is reported unavailable rather than timed. Timings on a shared machine are inflated; compare
figures of one run only.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from timetotrain.data import graph_synth
from timetotrain.data.igbh import RELATIONS
from timetotrain.data.sampler import NeighbourSampler
from timetotrain.models import rgat
from timetotrain.tasks.node_classification import SEED_TYPE, batch_of


def sampler_figures(graph, batch: int, fanouts, n: int) -> dict:
    sampler = NeighbourSampler(graph.csc, graph.num_nodes, fanouts)
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randperm(len(graph.labels), generator=gen)
    sampler.sample(SEED_TYPE, seeds[:batch], gen)  # warm-up
    times, edges = [], 0
    for i in range(n):
        chunk = seeds[(i * batch) % (len(seeds) - batch) :][:batch]
        t0 = time.perf_counter()
        sub = sampler.sample(SEED_TYPE, chunk, gen)
        batch_of(graph, sub, graph.labels[chunk])
        times.append(time.perf_counter() - t0)
        edges += sub.num_edges
    total = sum(times)
    return {
        "batch": batch,
        "fanouts": list(fanouts),
        "subgraphs": n,
        "seeds_per_s": n * batch / total,
        "sampled_edges_per_s": edges / total,
        "edges_per_subgraph": edges / n,
        "p50_s": statistics.median(times),
    }


def pyg_neighbor_loader() -> str | None:
    """Why PyG's NeighborLoader cannot run here, or None when it can."""
    try:
        import torch_geometric.typing as t
    except ImportError:
        return "torch_geometric not installed"
    if not (t.WITH_PYG_LIB or t.WITH_TORCH_SPARSE):
        return "needs pyg-lib or torch-sparse, neither installed"
    return None


class PyGRGAT(torch.nn.Module):
    """The reference's model (rgnn.py: HeteroConv of GATConv(in, h/heads, heads, add_self_loops=False), sum
    over relations, LeakyReLU + dropout between layers, Linear head), built from PyG's layers."""

    def __init__(self, cfg: rgat.RGATConfig):
        super().__init__()
        from torch_geometric.nn import GATConv, HeteroConv

        dims = [cfg.in_dim] + [cfg.hidden] * cfg.n_layers
        self.convs = torch.nn.ModuleList(
            HeteroConv(
                {r: GATConv(a, b // cfg.heads, heads=cfg.heads, add_self_loops=False) for r in cfg.relations}
            )
            for a, b in zip(dims, dims[1:], strict=False)
        )
        self.lin = torch.nn.Linear(cfg.hidden, cfg.classes)
        self.drop = cfg.dropout

    def forward(self, x, edges, n_seeds):
        for i, conv in enumerate(self.convs):
            x = conv(x, edges)
            if i < len(self.convs) - 1:
                x = {k: F.dropout(F.leaky_relu(v), self.drop, self.training) for k, v in x.items()}
        return self.lin(x[SEED_TYPE][:n_seeds])


def step_figures(graph, cfg, fanouts, batch: int, reps: int) -> dict:
    sampler = NeighbourSampler(graph.csc, graph.num_nodes, fanouts)
    gen = torch.Generator().manual_seed(1)
    subs = []
    for _ in range(reps + 1):
        seeds = torch.randint(0, len(graph.labels), (batch,), generator=gen)
        sub = sampler.sample(SEED_TYPE, seeds, gen)
        x = {t: torch.from_numpy(graph.feats[t][ids.numpy()]) for t, ids in sub.nodes.items()}
        subs.append((x, sub, graph.labels[seeds]))
    ours = rgat.RGAT(cfg)
    rgat.init(ours, torch.Generator().manual_seed(0))
    peer = PyGRGAT(cfg)
    variants = {
        "ours_trimmed": (ours, lambda m, x, s, n: m(x, s.edges, n, (s.node_hops, s.edge_hops))),
        "ours_untrimmed": (ours, lambda m, x, s, n: m(x, s.edges, n)),
        "pyg_heteroconv": (peer, lambda m, x, s, n: m(x, s.edges, n)),
    }
    opts = {k: torch.optim.Adam(m.parameters(), 1e-3) for k, (m, _) in variants.items()}
    times = {k: [] for k in variants}
    for i, (x, sub, y) in enumerate(subs):
        for k, (m, fwd) in variants.items():  # alternated: every variant sees the same load
            t0 = time.perf_counter()
            F.cross_entropy(fwd(m, x, sub, len(y)), y).backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            if i:  # the first subgraph warms up
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "batch": batch,
        "fanouts": list(fanouts),
        "model": {"hidden": cfg.hidden, "layers": cfg.n_layers, "heads": cfg.heads, "in_dim": cfg.in_dim},
        **{f"{k}_step_s": v for k, v in med.items()},
        "speedup_vs_pyg": med["pyg_heteroconv"] / med["ours_trimmed"],
        "speedup_vs_pyg_untrimmed": med["pyg_heteroconv"] / med["ours_untrimmed"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="small", choices=sorted(graph_synth.SCALES))
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--subgraphs", type=int, default=10)
    ap.add_argument("--step-batch", type=int, default=256, help="seeds per training step (the tiny tier's)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--steps-only", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    graph = graph_synth.in_memory(graph_synth.scale(args.scale), seed=0)
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "graph": {
            "scale": args.scale,
            "nodes": graph.num_nodes,
            "seconds_to_generate": time.perf_counter() - t0,
        },
        "pyg_neighbor_loader": pyg_neighbor_loader() or "available (not timed by this script)",
    }
    if not args.steps_only:
        out["sampler"] = sampler_figures(graph, args.batch, (15, 10, 5), args.subgraphs)
    from timetotrain.suite.rgat import TINY

    cfg = TINY.model if args.scale == "tiny" else rgat.RGATConfig(
        relations=RELATIONS, in_dim=graph_synth.scale(args.scale).dim, hidden=64, heads=4, n_layers=2,
        classes=graph_synth.scale(args.scale).classes, dropout=0.0,
    )  # fmt: skip
    import dataclasses

    cfg = dataclasses.replace(cfg, dropout=0.0)  # equal work for both: no random masks
    out["step"] = step_figures(graph, cfg, TINY.data.fanouts, args.step_batch, args.reps)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
