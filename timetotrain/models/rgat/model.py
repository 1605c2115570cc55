"""R-GAT (MLPerf rgat): layers of a heterogeneous convolution that sums, over the relations into a node
type, one GAT convolution per relation (PyG `HeteroConv(aggr="sum")` of `GATConv(heads, add_self_loops=
False)`), LeakyReLU and dropout between layers, and a Linear head on the seed papers.

Our own GATConv rather than PyG's, equal to it (tests/test_rgat.py: outputs and gradients), because:
- PyG projects the destination nodes with the full [in, heads x C] weight only to dot the result with
  `att_dst`; folding `att_dst` into the weight first ([in, heads]) gives the same scores for a
  fraction of the FLOPs (papers, the largest type, are the destination of five relations);
- the relations leaving one node type share their input, so their projections run as one matmul;
- no `MessagePassing` machinery (inspection, hooks, a dict of kwargs per call) in the hot loop.
Parameter names and shapes are PyG's (`convs.<src>__<rel>__<dst>.lin.weight`, `att_src`, `att_dst`,
`bias`; PyG 2.8 spells the relation `<src___rel___dst>`), so a PyG state dict loads by renaming keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.models.family import ModelFamily
from timetotrain.models.rgat.config import RGATConfig

NEGATIVE_SLOPE = 0.2  # GATConv's LeakyReLU on attention logits
ACT_SLOPE = 0.01  # F.leaky_relu default, between layers in the reference


def _key(rel) -> str:
    return "__".join(rel)


class GATRelation(nn.Module):
    """The parameters of one relation's GATConv (PyG names and shapes)."""

    def __init__(self, in_dim: int, heads: int, per_head: int):
        super().__init__()
        self.lin = nn.Linear(in_dim, heads * per_head, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, per_head))
        self.att_dst = nn.Parameter(torch.empty(1, heads, per_head))
        self.bias = nn.Parameter(torch.empty(heads * per_head))


def edge_softmax(logits: torch.Tensor, dst: torch.Tensor, n_dst: int) -> torch.Tensor:
    """Softmax of [E, H] logits over the edges into each destination (max-shifted, as PyG's `softmax`)."""
    h = logits.shape[1]
    idx = dst.unsqueeze(1).expand(-1, h)
    top = logits.new_full((n_dst, h), -math.inf).scatter_reduce(0, idx, logits.detach(), "amax")
    e = (logits - top[dst]).exp()
    total = e.new_zeros(n_dst, h).index_add_(0, dst, e)
    return e / (total[dst] + 1e-16)


def _group(relations, end: int) -> dict[str, list]:
    """The relations by their source (`end` 0) or destination (2) node type, in order."""
    out: dict[str, list] = {}
    for r in relations:
        out.setdefault(r[end], []).append(r)
    return out


class HeteroGATLayer(nn.Module):
    def __init__(self, relations, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.relations, self.heads, self.per_head = tuple(relations), heads, out_dim // heads
        self.convs = nn.ModuleDict({_key(r): GATRelation(in_dim, heads, self.per_head) for r in relations})

    def forward(
        self, x: dict[str, torch.Tensor], edges: dict, n_dst: dict | None = None, n_edges: dict | None = None
    ) -> dict[str, torch.Tensor]:
        """`n_dst[t]`: compute outputs only for the first n_dst[t] nodes of type t, from the first
        n_edges[r] edges of each relation (trimming; None: every node, as HeteroConv)."""
        h, c = self.heads, self.per_head
        if n_dst is not None:
            edges = {r: e[:, : n_edges[r]] for r, e in edges.items()}
            x_dst = {t: v[: n_dst[t]] for t, v in x.items()}
        else:
            x_dst = x
        proj, a_src, a_dst = {}, {}, {}
        # A relation the subgraph does not hold contributes nothing, as HeteroConv skips an edge type absent
        # from its edge dict (one with no sampled edge is there, empty: only its bias reaches the output).
        present = [r for r in self.relations if r in edges]
        by_src, by_dst = _group(present, 0), _group(present, 2)
        for t, rels in by_src.items():  # one matmul per source type for all its relations
            convs = [self.convs[_key(r)] for r in rels]
            ys = (x[t] @ torch.cat([m.lin.weight for m in convs]).t()).split(h * c, dim=1)
            for r, m, y in zip(rels, convs, ys, strict=True):
                y = y.view(-1, h, c)
                proj[r] = y
                a_src[r] = (y * m.att_src).sum(-1)
        for t, rels in by_dst.items():  # att_dst folded into the weight: [in, heads] per relation
            convs = [self.convs[_key(r)] for r in rels]
            w = torch.cat([(m.lin.weight.view(h, c, -1) * m.att_dst.view(h, c, 1)).sum(1) for m in convs])
            for r, s in zip(rels, (x_dst[t] @ w.t()).split(h, dim=1), strict=True):
                a_dst[r] = s
        out = {}
        for r in present:
            src, dst = edges[r][0], edges[r][1]
            n = x_dst[r[2]].shape[0]
            alpha = F.leaky_relu(a_src[r][src] + a_dst[r][dst], NEGATIVE_SLOPE)
            alpha = edge_softmax(alpha, dst, n)
            msg = proj[r][src] * alpha.unsqueeze(-1)
            y = msg.new_zeros(n, h, c).index_add_(0, dst, msg).view(n, h * c) + self.convs[_key(r)].bias
            out[r[2]] = out[r[2]] + y if r[2] in out else y
        return out


class RGAT(nn.Module):
    # The last layer's relations into types other than the target's never reach the logits (the reference
    # builds them too; PyG leaves their grads None): data parallelism must expect parameters without grads.
    has_unused_parameters = True

    def __init__(self, cfg: RGATConfig):
        super().__init__()
        self.cfg = cfg
        dims = [cfg.in_dim] + [cfg.hidden] * cfg.n_layers
        self.layers = nn.ModuleList(
            HeteroGATLayer(cfg.relations, a, b, cfg.heads) for a, b in zip(dims, dims[1:], strict=False)
        )
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(
        self, x: dict[str, torch.Tensor], edges: dict, n_seeds: int, hops: tuple[dict, dict] | None = None
    ) -> torch.Tensor:
        """Logits of the first `n_seeds` nodes of the target type (the seeds of the sampled subgraph).

        `hops` = (node_hops, edge_hops) of the sampler (cumulative counts by hop) trims each layer to what
        the seeds depend on, as PyG's `trim_to_layer`: layer i of L computes only nodes within L-1-i hops
        of the seeds. The seeds' logits are the same as without it; the work is a fraction (the last hop
        holds most of the nodes)."""
        n_layers = len(self.layers)
        for i, layer in enumerate(self.layers):
            if hops is None:
                x = layer(x, edges)
            else:
                keep = n_layers - 1 - i
                x = layer(
                    x,
                    edges,
                    {t: v[keep] for t, v in hops[0].items()},
                    {r: v[keep] for r, v in hops[1].items()},
                )
            if i < len(self.layers) - 1:
                x = {
                    t: F.dropout(F.leaky_relu(v, ACT_SLOPE), self.cfg.dropout, self.training)
                    for t, v in x.items()
                }
        return self.head(x[self.cfg.target_type][:n_seeds])


def _glorot(t: torch.Tensor, generator) -> None:
    bound = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))  # PyG's glorot: the last two dimensions
    t.uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def init(model: RGAT, generator) -> None:
    """PyG's defaults: glorot for GATConv's weight and attention vectors, zero bias; torch's Linear head."""
    for layer in model.layers:
        for m in layer.convs.values():
            _glorot(m.lin.weight, generator)
            _glorot(m.att_src, generator)
            _glorot(m.att_dst, generator)
            m.bias.zero_()
    bound = 1.0 / math.sqrt(model.head.in_features)  # kaiming_uniform(a=sqrt(5)) reduces to this bound
    model.head.weight.uniform_(-bound, bound, generator=generator)
    model.head.bias.uniform_(-bound, bound, generator=generator)


def param_count(cfg: RGATConfig) -> int:
    r = len(cfg.relations)
    per = lambda i: cfg.hidden * (i + 1) + 2 * cfg.hidden  # noqa: E731 - lin, bias, att_src, att_dst
    layers = r * (per(cfg.in_dim) + (cfg.n_layers - 1) * per(cfg.hidden))
    return layers + cfg.hidden * cfg.classes + cfg.classes


def block_params(cfg: RGATConfig) -> int:
    return len(cfg.relations) * (cfg.hidden * (cfg.hidden + 1) + 2 * cfg.hidden)


def flops_per_node(cfg: RGATConfig, seq_len: int = 1, causal: bool = False) -> float:
    """Training FLOPs (3 x forward) of the projections of one node per relation leaving its type, on
    average (six node types share the eleven relations). Messages and softmax are not counted."""
    layer = cfg.in_dim * cfg.hidden + (cfg.n_layers - 1) * cfg.hidden * cfg.hidden
    return 6.0 * layer * len(cfg.relations) / 6


def subgraph_flops(cfg: RGATConfig, node_hops: dict, edge_hops: dict, n_seeds: int) -> float:
    """Training FLOPs (3 x forward) of one trimmed step on a sampled subgraph, counted from its sizes:
    source projections, folded destination scores, messages (2 per edge and channel), and the head."""
    total, n_layers = 0.0, cfg.n_layers
    for i in range(n_layers):
        keep, d_in = n_layers - 1 - i, cfg.in_dim if i == 0 else cfg.hidden
        for s, _, d in cfg.relations:
            total += 2.0 * node_hops[s][keep + 1] * d_in * cfg.hidden  # source projection
            total += 2.0 * node_hops[d][keep] * d_in * cfg.heads  # destination scores
        total += sum(2.0 * edge_hops[r][keep] * cfg.hidden for r in cfg.relations)
    return 3.0 * (total + 2.0 * n_seeds * cfg.hidden * cfg.classes)


FAMILY = ModelFamily(
    name="rgat",
    build=RGAT,
    init=init,
    param_count=param_count,
    active_param_count=param_count,
    flops_per_token=flops_per_node,
    block_params=block_params,
    activation_elements=lambda cfg: 4.0 * cfg.hidden,
)
