"""The rgat family (heterogeneous GAT): `config.py` its sizes, `model.py` the module, its counts and FAMILY."""

from timetotrain.models.rgat.config import RGATConfig
from timetotrain.models.rgat.model import (
    ACT_SLOPE,
    FAMILY,
    NEGATIVE_SLOPE,
    RGAT,
    GATRelation,
    HeteroGATLayer,
    block_params,
    edge_softmax,
    flops_per_node,
    init,
    param_count,
    subgraph_flops,
)

__all__ = [
    "NEGATIVE_SLOPE",
    "ACT_SLOPE",
    "RGATConfig",
    "GATRelation",
    "edge_softmax",
    "HeteroGATLayer",
    "RGAT",
    "init",
    "param_count",
    "block_params",
    "flops_per_node",
    "subgraph_flops",
    "FAMILY",
]
