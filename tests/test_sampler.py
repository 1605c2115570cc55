"""The vectorized neighbour sampler: every sampled edge exists, no CSC entry twice, small neighbourhoods
taken whole, neighbours drawn uniformly (chi-square), and the same seed gives the same subgraph."""

import numpy as np
import pytest
import torch

from timetotrain.data.igbh import coo_to_csc
from timetotrain.data.sampler import NeighbourSampler, sample_neighbours

scipy_stats = pytest.importorskip("scipy.stats")

RELS = (("a", "to", "b"), ("b", "back", "a"), ("a", "self", "a"))
N = {"a": 300, "b": 120}


def _graph(seed=0):
    """Random relations with power-law in-degrees (some nodes with hundreds of neighbours, many with few),
    each edge once: the CSC keeps an edge stored twice (test_igbh.py), and here a neighbour drawn twice
    would be a sampler bug."""
    rng = np.random.default_rng(seed)
    csc, pairs = {}, {}
    for s, r, d in RELS:
        e = 3000
        dst = np.minimum(rng.zipf(1.6, e) - 1, N[d] - 1)
        key = np.unique(dst * N[s] + rng.integers(0, N[s], e))
        dst, src = np.divmod(key, N[s])
        indptr, indices = coo_to_csc(src, dst, N[s], N[d])
        csc[(s, r, d)] = (torch.from_numpy(indptr), torch.from_numpy(indices))
        pairs[(s, r, d)] = set(zip(src.tolist(), dst.tolist(), strict=True))
    return csc, pairs


def _sample(csc, seed, fanouts=(6, 4)):
    sampler = NeighbourSampler(csc, N, fanouts)
    return sampler.sample("a", torch.arange(0, 300, 7), torch.Generator().manual_seed(seed))


def test_edges_exist_no_duplicates_and_small_neighbourhoods_whole():
    csc, pairs = _graph()
    sub = _sample(csc, 1)
    assert sub.nodes["a"][:43].tolist() == list(range(0, 300, 7))  # the seeds come first
    for ids in sub.nodes.values():
        assert len(ids.unique()) == len(ids)
    for rel, e in sub.edges.items():
        s, _, d = rel
        src, dst = sub.nodes[s][e[0]].tolist(), sub.nodes[d][e[1]].tolist()
        assert all(p in pairs[rel] for p in zip(src, dst, strict=True)), rel
        assert len(set(zip(src, dst, strict=True))) == len(src), f"{rel}: a neighbour drawn twice"
    # Every seed, through each relation into its type, has min(degree, fanout) neighbours, and all of
    # them when its degree is at most the fanout.
    indptr, indices = csc[("b", "back", "a")]
    e = sub.edges[("b", "back", "a")][:, : sub.edge_hops[("b", "back", "a")][0]]
    for seed_local in range(43):
        g = int(sub.nodes["a"][seed_local])
        mine = set(sub.nodes["b"][e[0][e[1] == seed_local]].tolist())
        nbrs = set(indices[indptr[g] : indptr[g + 1]].tolist())
        assert len(mine) == min(len(nbrs), 6) and mine <= nbrs
        if len(nbrs) <= 6:
            assert mine == nbrs


def test_uniform_without_replacement():
    """One node of degree 20 sampled 4,000 times at fanout 5 (in one vectorized call): each neighbour is
    drawn 1,000 times in expectation; chi-square against uniform."""
    src = np.arange(20)
    indptr, indices = coo_to_csc(src, np.zeros(20, np.int64), 20, 1)
    draws = 4000
    got, owner = sample_neighbours(
        torch.from_numpy(indptr), torch.from_numpy(indices), torch.zeros(draws, dtype=torch.long), 5,
        torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert len(got) == draws * 5
    per_draw = got.view(draws, 5).sort(1).values
    assert (per_draw[:, 1:] != per_draw[:, :-1]).all(), "a draw repeats a neighbour"
    counts = torch.bincount(got, minlength=20).numpy()
    assert scipy_stats.chisquare(counts).pvalue > 1e-3, counts
    # Pairs too: Floyd's algorithm makes every 5-subset equally likely, so each pair appears equally often.
    pairs = np.zeros((20, 20))
    pd = per_draw.numpy()
    for i in range(5):
        for j in range(i + 1, 5):
            np.add.at(pairs, (pd[:, i], pd[:, j]), 1)
    assert scipy_stats.chisquare(pairs[np.triu_indices(20, 1)]).pvalue > 1e-3


def test_same_seed_same_subgraph():
    csc, _ = _graph()
    a, b, c = _sample(csc, 5), _sample(csc, 5), _sample(csc, 6)
    assert all(torch.equal(a.nodes[t], b.nodes[t]) for t in N)
    assert all(torch.equal(a.edges[r], b.edges[r]) for r in RELS)
    assert a.node_hops == b.node_hops and a.edge_hops == b.edge_hops
    assert any(not torch.equal(a.edges[r], c.edges[r]) for r in RELS)


def test_hop_counts_order_nodes_and_edges():
    """Edges sampled at hop h point into nodes that entered by hop h-1, and come from nodes that entered
    by hop h: what trimming relies on."""
    csc, _ = _graph()
    sub = _sample(csc, 2, fanouts=(5, 3, 2))
    for (s, _, d), e in sub.edges.items():
        hops = sub.edge_hops[(s, _, d)]
        start = 0
        for h, end in enumerate(hops):
            assert (e[1, start:end] < sub.node_hops[d][h]).all()
            assert (e[0, start:end] < sub.node_hops[s][h + 1]).all()
            start = end
        assert end == e.shape[1]
