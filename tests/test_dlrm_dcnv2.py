"""DLRM-DCNv2: our fused model equals an independent formulation written the obvious way (one
nn.EmbeddingBag per table, the cross layers as explicit matmuls, nn.Sequential MLPs) with the same weights,
outputs and gradients at 1e-6 in fp32; and TorchRec's DLRM_DCN where TorchRec imports (it needs
fbgemm-gpu kernels matching the installed torch: on this machine they fail to load under torch 2.13)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.models import dlrm_dcnv2 as dl

pytestmark = pytest.mark.parity

CFG = dl.DLRMConfig(
    table_sizes=(50, 7, 3, 120, 11), multi_hot=(3, 1, 2, 5, 1), dim=8, bottom=(16, 8), top=(32, 16, 1),
    dcn_layers=3, dcn_rank=6,
)  # fmt: skip


def _ours(seed=0):
    m = dl.DLRMDCNv2(CFG)
    dl.init(m, torch.Generator().manual_seed(seed))
    return m


class _Obvious(nn.Module):
    """Per-table EmbeddingBags (sum), and the DCNv2 formula x_{l+1} = x0 * (x_l V^T W^T + b) + x_l."""

    def __init__(self, ours):
        super().__init__()
        e = ours.embedding
        self.bags = nn.ModuleList()
        for t, n in enumerate(CFG.table_sizes):
            bag = nn.EmbeddingBag(n, CFG.dim, mode="sum")
            bag.weight.data.copy_(e.weight.data[e.table_rows(t)])
            self.bags.append(bag)
        self.bottom = _copy(ours.bottom)
        self.top = _copy(ours.top)
        self.W = [p.detach().clone().requires_grad_() for p in ours.cross.W]
        self.V = [p.detach().clone().requires_grad_() for p in ours.cross.V]
        self.b = [p.detach().clone().requires_grad_() for p in ours.cross.bias]

    def forward(self, dense, sparse):
        cols = 0
        pooled = []
        for t, k in enumerate(CFG.multi_hot):
            pooled.append(self.bags[t](sparse[:, cols : cols + k]))  # 2-D input: one bag per row
            cols += k
        x0 = torch.cat([self.bottom(dense), *pooled], dim=1)
        x = x0
        for w, v, b in zip(self.W, self.V, self.b, strict=True):
            x = x0 * (x @ v.T @ w.T + b) + x
        return self.top(x).squeeze(-1)


def _copy(seq):
    out = []
    for m in seq:
        if isinstance(m, nn.Linear):
            lin = nn.Linear(m.in_features, m.out_features)
            lin.weight.data.copy_(m.weight.data)
            lin.bias.data.copy_(m.bias.data)
            out.append(lin)
        else:
            out.append(nn.ReLU())
    return nn.Sequential(*out)


def _batch(b=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(b, CFG.dense_in, generator=g)
    sparse = torch.cat(
        [
            torch.randint(0, n, (b, k), generator=g)
            for n, k in zip(CFG.table_sizes, CFG.multi_hot, strict=True)
        ],
        1,
    )
    labels = torch.randint(0, 2, (b,), generator=g).float()
    return dense, sparse, labels


def test_forward_loss_and_gradients_match_the_obvious_formulation():
    ours = _ours()
    ref = _Obvious(ours)
    dense, sparse, labels = _batch()
    a, b = ours(dense, sparse), ref(dense, sparse)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    la = F.binary_cross_entropy_with_logits(a, labels)
    lb = F.binary_cross_entropy_with_logits(b, labels)
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    g = ours.embedding.weight.grad
    assert g.is_sparse  # only the looked-up rows: what the row-sparse Adagrad updates
    g = g.to_dense()
    for t, bag in enumerate(ref.bags):
        torch.testing.assert_close(g[ours.embedding.table_rows(t)], bag.weight.grad, rtol=1e-6, atol=1e-6)
    for mine, theirs in ((ours.bottom, ref.bottom), (ours.top, ref.top)):
        for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    for mine, theirs in ((ours.cross.W, ref.W), (ours.cross.V, ref.V), (ours.cross.bias, ref.b)):
        for p, q in zip(mine, theirs, strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_cross_layer_alone_matches_the_formula():
    torch.manual_seed(0)
    cross = dl.LowRankCrossNet(12, 2, 4)
    for p in cross.parameters():
        p.data.normal_()
    x0 = torch.randn(5, 12)
    x = x0
    for w, v, b in zip(cross.W, cross.V, cross.bias, strict=True):
        x = x0 * (torch.einsum("rn,bn->br", v, x) @ w.T + b) + x
    # Another summation order rounds differently: allow 8 ulps of the largest value (the values reach ~130,
    # where one fp32 ulp is 1.5e-5; AMD's AVX2 GEMM path differs from the formula's by one ulp there).
    ulp = torch.finfo(torch.float32).eps * x.abs().max().item()
    torch.testing.assert_close(cross(x0), x, rtol=1e-6, atol=8 * ulp)


def test_init_follows_the_reference():
    m = _ours(seed=3)
    e = m.embedding
    for t, n in enumerate(CFG.table_sizes):
        w = e.weight.data[e.table_rows(t)]
        assert w.abs().max() <= math.sqrt(1 / n) and w.abs().max() > 0.5 * math.sqrt(1 / n)
    lin = m.top[0]
    assert lin.weight.abs().max() <= 1 / math.sqrt(lin.in_features)
    assert all(b.abs().sum() == 0 for b in m.cross.bias)
    # Xavier normal: std sqrt(2 / (fan_in + fan_out)) on the big cross matrices of the reference size.
    big = dl.LowRankCrossNet(3456, 1, 512)
    torch.nn.init.xavier_normal_(big.W[0])
    assert abs(big.W[0].std().item() - math.sqrt(2 / (3456 + 512))) < 1e-3
    # Same seed, same weights; another seed, others.
    assert torch.equal(_ours(seed=3).top[0].weight, lin.weight)
    assert not torch.equal(_ours(seed=4).top[0].weight, lin.weight)


def test_counts_at_the_reference_size():
    cfg = dl.DLRMConfig()
    assert cfg.interaction_dim == 27 * 128 == 3456
    assert cfg.rows == 204_184_588 and cfg.hots == 214
    with torch.device("meta"):
        m = dl.DLRMDCNv2(cfg)
    assert sum(p.numel() for p in m.parameters()) == dl.param_count(cfg)
    assert dl.embedding_param_count(cfg) == cfg.rows * 128


def _torchrec():
    try:
        from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
        from torchrec.models.dlrm import DLRM_DCN
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
    except Exception as e:  # ImportError, or fbgemm's OSError/RuntimeError on a kernel library
        pytest.skip(
            f"TorchRec does not import here ({type(e).__name__}: {e}); it needs fbgemm-gpu built for this torch"
        )
    return EmbeddingBagCollection, KeyedJaggedTensor, DLRM_DCN, EmbeddingBagConfig


def test_matches_torchrec_dlrm_dcn():
    EBC, KJT, DLRM_DCN, EBConfig = _torchrec()
    ours = _ours()
    names = [f"f{t}" for t in range(CFG.tables)]
    tables = [EBConfig(name=f"t_{n}", embedding_dim=CFG.dim, num_embeddings=r, feature_names=[n])
              for n, r in zip(names, CFG.table_sizes, strict=True)]  # fmt: skip
    ref = DLRM_DCN(
        EBC(tables=tables), CFG.dense_in, list(CFG.bottom), list(CFG.top), CFG.dcn_layers, CFG.dcn_rank
    )
    sd = ref.state_dict()
    e = ours.embedding
    for t, n in enumerate(names):
        sd[f"sparse_arch.embedding_bag_collection.embedding_bags.t_{n}.weight"] = e.weight.data[
            e.table_rows(t)
        ]
    lin = lambda seq: [m for m in seq if isinstance(m, nn.Linear)]  # noqa: E731
    for i, m in enumerate(lin(ours.bottom)):
        sd[f"dense_arch.model._mlp.{i}._linear.weight"] = m.weight.data
        sd[f"dense_arch.model._mlp.{i}._linear.bias"] = m.bias.data
    top = lin(ours.top)
    for i, m in enumerate(top[:-1]):
        sd[f"over_arch.model.0._mlp.{i}._linear.weight"] = m.weight.data
        sd[f"over_arch.model.0._mlp.{i}._linear.bias"] = m.bias.data
    sd["over_arch.model.1.weight"], sd["over_arch.model.1.bias"] = top[-1].weight.data, top[-1].bias.data
    for i in range(CFG.dcn_layers):
        sd[f"inter_arch.crossnet.W_kernels.{i}"] = ours.cross.W[i].data
        sd[f"inter_arch.crossnet.V_kernels.{i}"] = ours.cross.V[i].data
        sd[f"inter_arch.crossnet.bias.{i}"] = ours.cross.bias[i].data
    ref.load_state_dict(sd)
    dense, sparse, _ = _batch()
    values, lengths, cols = [], [], 0
    for k in CFG.multi_hot:  # KJT order: key-major, then sample
        values.append(sparse[:, cols : cols + k].reshape(-1))
        lengths.append(torch.full((sparse.shape[0],), k))
        cols += k
    kjt = KJT(keys=names, values=torch.cat(values), lengths=torch.cat(lengths))
    torch.testing.assert_close(ours(dense, sparse), ref(dense, kjt).squeeze(-1), rtol=1e-6, atol=1e-6)
