"""Heterogeneous neighbour sampling over CSC, vectorized (pyg-lib and torch-sparse, which PyG's
NeighborLoader needs, do not install here; GLT's sampler, the reference's, needs CUDA).

Semantics are the reference's (GLT NeighborLoader, edge direction "in"): hop h takes, for every node that
entered the subgraph at hop h-1 and every relation into its type, up to `fanouts[h]` of its in-neighbours
uniformly without replacement (all of them when it has no more). The result is the layout
`HeteroConv` consumes: per node type the global ids of its nodes (seeds first), per relation an edge
index [2, E] of local ids, row 0 the source and row 1 the destination.

Choosing k of d neighbours without replacement is Floyd's algorithm run for all nodes at once: k steps
(a Python loop over the fanout, never over nodes), each drawing one index per node and checking it
against the k already taken. Its cost is O(nodes x k^2), independent of the degree, so hubs of a
power-law graph cost no more than anyone else (a top-k over random keys would cost their degree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sample_neighbours(
    indptr: torch.Tensor, indices: torch.Tensor, dst: torch.Tensor, k: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to k in-neighbours of each node of `dst`, without replacement. Returns (sources as global ids,
    position in `dst` of each source's destination)."""
    start = indptr[dst]
    deg = indptr[dst + 1] - start
    full = deg <= k
    # Nodes with at most k neighbours take them all: their CSC ranges through a [n, k] mask (a ragged
    # arange without repeat_interleave, which is slow on the CPU).
    a = full.nonzero().squeeze(1)
    offs = torch.arange(k, dtype=torch.int64).unsqueeze(0)
    keep = offs < deg[a].unsqueeze(1)
    pos_a = (start[a].unsqueeze(1) + offs)[keep]
    owner_a = a.unsqueeze(1).expand(-1, k)[keep]
    # The others draw k distinct offsets in [0, d) (Floyd): at step j the candidate range is [0, d-k+j].
    m = (~full).nonzero().squeeze(1)
    pos_m = torch.empty(0, dtype=torch.int64)
    if len(m):
        d = deg[m]
        chosen = torch.empty(len(m), k, dtype=torch.int64)
        for j in range(k):
            top = d - k + j
            t = (torch.rand(len(m), dtype=torch.float64, generator=generator) * (top + 1)).long()
            t = torch.minimum(t, top)
            taken = (chosen[:, :j] == t.unsqueeze(1)).any(1)
            chosen[:, j] = torch.where(taken, top, t)
        pos_m = (start[m].unsqueeze(1) + chosen).reshape(-1)
    pos = torch.cat([pos_a, pos_m])
    owner = torch.cat([owner_a, m.unsqueeze(1).expand(-1, k).reshape(-1)])
    return indices[pos].long(), owner


@dataclass
class Subgraph:
    nodes: dict[str, torch.Tensor]  # type -> global ids (int64); the seeds are the first of their type
    edges: dict[tuple[str, str, str], torch.Tensor]  # relation -> [2, E] local (source, destination)
    # Cumulative counts by hop, for trimming layer by layer (nodes and edges are numbered in the order
    # they were sampled): node_hops[t][h] nodes of type t are within h hops of the seeds, and the first
    # edge_hops[r][h] edges of r are those into nodes within h hops.
    node_hops: dict[str, list[int]]
    edge_hops: dict[tuple[str, str, str], list[int]]

    @property
    def num_edges(self) -> int:
        return sum(e.shape[1] for e in self.edges.values())


class NeighbourSampler:
    """Samples the subgraph of a batch of seeds. One instance per thread: it keeps a global -> local id
    table per node type (reset after each batch at the entries it touched), which makes relabeling a
    gather instead of a sort."""

    def __init__(self, csc: dict, num_nodes: dict[str, int], fanouts: list[int] | tuple[int, ...]):
        self.csc, self.num_nodes, self.fanouts = csc, num_nodes, tuple(fanouts)
        self._local = {t: torch.full((n,), -1, dtype=torch.int64) for t, n in num_nodes.items()}

    def sample(self, seed_type: str, seeds: torch.Tensor, generator: torch.Generator) -> Subgraph:
        local = self._local
        nodes = {t: [] for t in self.num_nodes}
        size = dict.fromkeys(self.num_nodes, 0)
        edges: dict[tuple, list[torch.Tensor]] = {r: [] for r in self.csc}

        def add(t: str, ids: torch.Tensor) -> torch.Tensor:
            local[t][ids] = torch.arange(size[t], size[t] + len(ids))
            size[t] += len(ids)
            nodes[t].append(ids)
            return ids

        seeds = seeds.long()
        frontier = {t: torch.empty(0, dtype=torch.int64) for t in self.num_nodes}
        frontier[seed_type] = add(seed_type, seeds)
        node_hops = {t: [size[t]] for t in self.num_nodes}
        edge_hops: dict[tuple, list[int]] = {r: [] for r in self.csc}
        n_edges = dict.fromkeys(self.csc, 0)
        try:
            for k in self.fanouts:
                grown = {t: [] for t in self.num_nodes}
                for rel, (indptr, indices) in self.csc.items():
                    s, _, d = rel
                    dst = frontier[d]
                    if not len(dst):
                        continue
                    src, owner = sample_neighbours(indptr, indices, dst, k, generator)
                    fresh = src[local[s][src] < 0]
                    if len(fresh):
                        grown[s].append(add(s, torch.unique(fresh)))
                    edges[rel].append(torch.stack([local[s][src], local[d][dst[owner]]]))
                    n_edges[rel] += len(src)
                for t in node_hops:
                    node_hops[t].append(size[t])
                for r in edge_hops:
                    edge_hops[r].append(n_edges[r])
                frontier = {
                    t: torch.cat(v) if v else torch.empty(0, dtype=torch.int64) for t, v in grown.items()
                }
        finally:
            out = {t: torch.cat(v) if v else torch.empty(0, dtype=torch.int64) for t, v in nodes.items()}
            for t, ids in out.items():
                local[t][ids] = -1
        empty = torch.empty(2, 0, dtype=torch.int64)
        edges_out = {r: torch.cat(e, 1) if e else empty for r, e in edges.items()}
        return Subgraph(out, edges_out, node_hops, edge_hops)
