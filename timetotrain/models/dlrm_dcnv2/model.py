"""DLRM-DCNv2 (the MLPerf reference's torchrec.models.dlrm.DLRM_DCN, written on PyTorch itself): one fused
embedding bag over all tables, a bottom MLP for the dense features, a low-rank DCNv2 cross network over
[bottom output, 26 pooled embeddings], a top MLP to one logit. Free of parallelism: a model-parallel plan
replaces `embedding` from outside (train/embedding_parallel.py).

A batch's sparse input is one int tensor [B, sum(multi_hot)] of per-table row ids, the columns of table 0
first: every sample has exactly `multi_hot[t]` ids in table t (the materialized multi-hot dataset), so the
bags need no lengths and the offsets are the same arithmetic every step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.models.common.embedding_bag import FusedEmbeddingBag
from timetotrain.models.dlrm_dcnv2.config import DLRMConfig
from timetotrain.models.family import EmbeddingTables, ModelFamily


class LowRankCrossNet(nn.Module):
    """DCNv2's low-rank cross layers: x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l, W_l [N, r], V_l [r, N]
    (torchrec.modules.crossnet.LowRankCrossNet, its parameter shapes)."""

    def __init__(self, features: int, layers: int, rank: int):
        super().__init__()
        self.W = nn.ParameterList(nn.Parameter(torch.empty(features, rank)) for _ in range(layers))
        self.V = nn.ParameterList(nn.Parameter(torch.empty(rank, features)) for _ in range(layers))
        self.bias = nn.ParameterList(nn.Parameter(torch.empty(features)) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for w, v, b in zip(self.W, self.V, self.bias, strict=True):
            x = x0 * (F.linear(F.linear(x, v), w) + b) + x
        return x


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    mods: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        mods.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


class DLRMDCNv2(nn.Module):
    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = FusedEmbeddingBag(cfg.table_sizes, cfg.multi_hot, cfg.dim)
        # DenseArch: ReLU after every layer, the last too (torchrec MLP); OverArch: ReLU MLP then a linear.
        self.bottom = mlp([cfg.dense_in, *cfg.bottom], last_relu=True)
        self.cross = LowRankCrossNet(cfg.interaction_dim, cfg.dcn_layers, cfg.dcn_rank)
        self.top = mlp([cfg.interaction_dim, *cfg.top], last_relu=False)
        # The dense blocks, for activation checkpointing, compile and FSDP2 applied from outside.
        self.layers = nn.ModuleList([self.bottom, self.cross, self.top])

    def interact(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """[B, dim] bottom output and [B, tables, dim] pooled embeddings -> the logits [B]."""
        x0 = torch.cat([dense.unsqueeze(1), pooled], dim=1).flatten(1)
        return self.top(self.cross(x0)).squeeze(-1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.interact(self.bottom(dense), self.embedding(sparse))


@torch.no_grad()
def init(model: DLRMDCNv2, generator: torch.Generator) -> None:
    """The reference's init: each table U(-sqrt(1/rows), sqrt(1/rows)) (TorchRec's EmbeddingBagConfig
    default, applied by its batched kernel), torch's nn.Linear default for both MLPs (weight and bias
    U(-1/sqrt(fan_in), 1/sqrt(fan_in))), Xavier-normal W and V and zero bias in the cross net."""
    model.embedding.reset_parameters(generator)  # (or a rank's shards of it, drawn alike)
    for seq in (model.bottom, model.top):
        for m in seq:
            if isinstance(m, nn.Linear):
                bound = 1.0 / math.sqrt(m.in_features)  # kaiming_uniform(a=sqrt(5)) reduces to this bound
                m.weight.uniform_(-bound, bound, generator=generator)
                m.bias.uniform_(-bound, bound, generator=generator)
    for w, v, b in zip(model.cross.W, model.cross.V, model.cross.bias, strict=True):
        nn.init.xavier_normal_(w, generator=generator)
        nn.init.xavier_normal_(v, generator=generator)
        b.zero_()


def _mlp_params(sizes) -> int:
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))


def dense_param_count(cfg: DLRMConfig) -> int:
    n = cfg.interaction_dim
    cross = cfg.dcn_layers * (2 * n * cfg.dcn_rank + n)
    return _mlp_params([cfg.dense_in, *cfg.bottom]) + cross + _mlp_params([n, *cfg.top])


def embedding_param_count(cfg: DLRMConfig) -> int:
    return cfg.rows * cfg.dim


def param_count(cfg: DLRMConfig) -> int:
    return dense_param_count(cfg) + embedding_param_count(cfg)


def active_param_count(cfg: DLRMConfig) -> int:
    """What one sample touches: the dense part and its looked-up embedding rows."""
    return dense_param_count(cfg) + cfg.hots * cfg.dim


def flops_per_sample(cfg: DLRMConfig, seq_len: int = 1, causal: bool = False) -> float:
    """Training FLOPs (3 x forward) of the matmuls (2 per multiply-add) plus the pooling adds."""
    n = cfg.interaction_dim
    matmul = _mlp_params([cfg.dense_in, *cfg.bottom]) + cfg.dcn_layers * 2 * n * cfg.dcn_rank
    matmul += _mlp_params([n, *cfg.top])
    return 3.0 * (2.0 * matmul + cfg.hots * cfg.dim)


def embedding_tables(cfg: DLRMConfig) -> EmbeddingTables:
    # The step keeps the bottom and top MLPs' linear and ReLU outputs, each cross layer's x_l, V x_l and
    # W V x_l, x0 and the pooled rows.
    n = cfg.interaction_dim
    kept = (
        sum(cfg.bottom) * 2
        + cfg.dcn_layers * (2 * n + cfg.dcn_rank)
        + n
        + sum(cfg.top) * 2
        + cfg.tables * cfg.dim
    )
    return EmbeddingTables(tuple(cfg.table_sizes), tuple(cfg.multi_hot), cfg.dim, float(kept))


FAMILY = ModelFamily(
    name="dlrm_dcnv2",
    build=DLRMDCNv2,
    init=init,
    param_count=param_count,
    active_param_count=active_param_count,
    flops_per_token=flops_per_sample,
    block_params=dense_param_count,
    activation_elements=lambda cfg: 4.0 * cfg.interaction_dim,
    embedding_tables=embedding_tables,
)
