"""R-GAT: our heterogeneous GAT equals PyG's HeteroConv(GATConv) with the same weights (outputs and
gradients), and the parameter count and init follow PyG's defaults."""

import pytest
import torch
import torch.nn.functional as F

from timetotrain.data.igbh import NODE_TYPES, RELATIONS
from timetotrain.models import rgat

pytestmark = pytest.mark.parity

pyg = pytest.importorskip("torch_geometric.nn")


def _graph(dim, gen, nodes=(30, 20, 5, 8, 4, 3), edges=60):
    n = dict(zip(NODE_TYPES, nodes, strict=True))
    x = {t: torch.randn(k, dim, generator=gen) for t, k in n.items()}
    e = {}
    for s, r, d in RELATIONS:
        src = torch.randint(0, n[s], (edges,), generator=gen)
        dst = torch.randint(0, n[d], (edges,), generator=gen)
        e[(s, r, d)] = torch.stack([src, dst])
    # cites as the reference builds it (data/igbh.py): every paper's self-loop twice, and edges stored
    # twice, which both softmaxes must count twice.
    loops = torch.arange(n["paper"]).repeat(2)
    cites = e[RELATIONS[0]]
    e[RELATIONS[0]] = torch.cat([cites, cites[:, :5], torch.stack([loops, loops])], 1)
    e[RELATIONS[-1]] = torch.empty(2, 0, dtype=torch.long)  # a relation with no sampled edge
    return x, e


def _pyg_name(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 4 and parts[2] == "convs":
        parts[3] = "<" + parts[3].replace("__", "___") + ">"
    return ".".join(parts)


class _PyG(torch.nn.Module):
    """The reference model's structure with PyG's layers (rgnn.py of the MLPerf reference)."""

    def __init__(self, cfg):
        super().__init__()
        dims = [cfg.in_dim] + [cfg.hidden] * cfg.n_layers
        self.layers = torch.nn.ModuleList(
            pyg.HeteroConv(
                {
                    r: pyg.GATConv(a, b // cfg.heads, heads=cfg.heads, add_self_loops=False)
                    for r in cfg.relations
                },
                aggr="sum",
            )
            for a, b in zip(dims, dims[1:], strict=False)
        )
        self.head = torch.nn.Linear(cfg.hidden, cfg.classes)
        self.cfg = cfg

    def forward(self, x, e, n):
        for i, layer in enumerate(self.layers):
            x = layer(x, e)
            if i < len(self.layers) - 1:
                x = {t: F.leaky_relu(v) for t, v in x.items()}
        return self.head(x["paper"][:n])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_pyg_heteroconv(dtype):
    gen = torch.Generator().manual_seed(0)
    cfg = rgat.RGATConfig(
        relations=RELATIONS, in_dim=12, hidden=16, heads=4, n_layers=3, classes=7, dropout=0.0
    )
    ours = rgat.RGAT(cfg).to(dtype)
    rgat.init(ours, gen)
    ref = _PyG(cfg).to(dtype)
    # PyG's names are ours but for the relation's spelling: convs.<paper___cites___paper> for
    # convs.paper__cites__paper; strict loading proves every tensor has its counterpart.
    ref.load_state_dict({_pyg_name(k): v for k, v in ours.state_dict().items()}, strict=True)
    x, e = _graph(12, gen)
    x = {t: v.to(dtype) for t, v in x.items()}
    y = torch.randint(0, 7, (10,), generator=gen)
    outs, grads = [], []
    for m in (ours, ref):
        out = m(x, e, 10)
        F.cross_entropy(out, y).backward()
        outs.append(out)
        grads.append({k: p.grad for k, p in m.named_parameters()})
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    assert {_pyg_name(k) for k in grads[0]} == set(grads[1])
    for k in grads[0]:
        a, b = grads[0][k], grads[1][_pyg_name(k)]
        if a is None and b is None:
            continue
        # A parameter that cannot reach the seeds: PyG leaves its grad None, our concatenated weights zero.
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, k=k: f"{k}: {m}")
    assert any(g.abs().sum() > 0 for k, g in grads[0].items() if "att_dst" in k)


def test_a_relation_missing_from_the_subgraph_contributes_nothing_as_in_heteroconv():
    """HeteroConv skips an edge type its edge dict lacks; ours raised KeyError. Two relations dropped whose
    destinations keep others (papers and authors), so every node type still has an output for PyG."""
    gen = torch.Generator().manual_seed(0)
    cfg = rgat.RGATConfig(
        relations=RELATIONS, in_dim=12, hidden=16, heads=4, n_layers=3, classes=7, dropout=0.0
    )
    ours = rgat.RGAT(cfg).double()
    rgat.init(ours, gen)
    ref = _PyG(cfg).double()
    ref.load_state_dict({_pyg_name(k): v for k, v in ours.state_dict().items()}, strict=True)
    x, e = _graph(12, gen)
    x = {t: v.double() for t, v in x.items()}
    dropped = [("fos", "rev_topic", "paper"), ("paper", "written_by", "author")]
    kept = {r: v for r, v in e.items() if r not in dropped}
    out = ours(x, kept, 10)
    torch.testing.assert_close(out, ref(x, kept, 10), atol=1e-12, rtol=1e-12)
    assert not torch.allclose(out, ours(x, e, 10))  # the dropped relations did count when present


def test_param_count_and_init():
    with torch.device("meta"):  # the reference size, counted without allocating it
        assert rgat.param_count(rgat.RGATConfig(relations=RELATIONS)) == sum(
            p.numel() for p in rgat.RGAT(rgat.RGATConfig(relations=RELATIONS)).parameters()
        )
    cfg = rgat.RGATConfig(relations=RELATIONS, in_dim=96, hidden=32, heads=4, n_layers=2, classes=5)
    model = rgat.RGAT(cfg)
    assert rgat.param_count(cfg) == sum(p.numel() for p in model.parameters())
    rgat.init(model, torch.Generator().manual_seed(0))
    conv = model.layers[0].convs["paper__cites__paper"]
    bound = (6 / (96 + 32)) ** 0.5  # PyG glorot
    assert conv.lin.weight.abs().max() <= bound and conv.lin.weight.abs().max() > 0.9 * bound
    assert conv.bias.abs().sum() == 0
    assert conv.att_src.abs().max() <= (6 / (4 + 8)) ** 0.5


def test_trimmed_layers_give_the_same_seed_logits():
    """Trimming each layer to the nodes the seeds depend on (the sampler's hop counts) changes the work,
    not the seeds' logits or gradients."""
    from timetotrain.data import graph_synth
    from timetotrain.data.sampler import NeighbourSampler

    sc = graph_synth.scaled(graph_synth.SCALES["tiny"], 0.02, dim=12, classes=7)
    g = graph_synth.in_memory(sc, 0)
    sub = NeighbourSampler(g.csc, g.num_nodes, (4, 3, 2)).sample(
        "paper", torch.arange(16), torch.Generator().manual_seed(0)
    )
    x = {t: torch.from_numpy(g.feats[t][ids.numpy()]).double() for t, ids in sub.nodes.items()}
    cfg = rgat.RGATConfig(
        relations=RELATIONS, in_dim=12, hidden=16, heads=4, n_layers=3, classes=7, dropout=0.0
    )
    model = rgat.RGAT(cfg).double()
    rgat.init(model, torch.Generator().manual_seed(1))
    full = model(x, sub.edges, 16)
    full.square().sum().backward()
    grad = lambda p: torch.zeros_like(p) if p.grad is None else p.grad.clone()  # noqa: E731 - unused: None
    g_full = [grad(p) for p in model.parameters()]
    model.zero_grad()
    trimmed = model(x, sub.edges, 16, (sub.node_hops, sub.edge_hops))
    trimmed.square().sum().backward()
    torch.testing.assert_close(trimmed, full, atol=1e-12, rtol=1e-12)
    for a, b in zip(g_full, (grad(p) for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
