"""The hstu family (the dlrmv4 reference's DlrmHSTU generative recommender): `config.py` its sizes,
`batch.py` the batch and its collate, `model.py` the module, its init, counts, FLOPs and FAMILY."""

from timetotrain.models.hstu.batch import HSTUBatch, collate, synthetic_samples
from timetotrain.models.hstu.config import YAMBDA_TABLES, Features, HSTUConfig, tiny_tables
from timetotrain.models.hstu.model import (
    FAMILY,
    HSTU,
    active_param_count,
    dense_param_count,
    dense_parameters,
    flops_per_sample,
    init,
    jagged_flops_per_sample,
    param_count,
    table_parameters,
)

__all__ = [
    "FAMILY",
    "HSTU",
    "HSTUBatch",
    "HSTUConfig",
    "Features",
    "YAMBDA_TABLES",
    "active_param_count",
    "collate",
    "dense_param_count",
    "dense_parameters",
    "flops_per_sample",
    "init",
    "jagged_flops_per_sample",
    "param_count",
    "synthetic_samples",
    "table_parameters",
    "tiny_tables",
]
