"""The dlrm_dcnv2 family (DLRM with a DCNv2 cross-net interaction): `config.py` its sizes, `model.py` the
module, its init, counts and FAMILY."""

from timetotrain.models.dlrm_dcnv2.config import (
    CRITEO_MULTI_HOT,
    CRITEO_TABLE_SIZES,
    DENSE_FEATURES,
    DLRMConfig,
)
from timetotrain.models.dlrm_dcnv2.model import (
    FAMILY,
    DLRMDCNv2,
    FusedEmbeddingBag,
    LowRankCrossNet,
    active_param_count,
    dense_param_count,
    embedding_param_count,
    flops_per_sample,
    init,
    param_count,
)

__all__ = [
    "CRITEO_MULTI_HOT",
    "CRITEO_TABLE_SIZES",
    "DENSE_FEATURES",
    "DLRMConfig",
    "DLRMDCNv2",
    "FusedEmbeddingBag",
    "LowRankCrossNet",
    "init",
    "param_count",
    "dense_param_count",
    "embedding_param_count",
    "active_param_count",
    "flops_per_sample",
    "FAMILY",
]
