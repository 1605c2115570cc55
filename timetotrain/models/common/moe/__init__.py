"""Mixture-of-experts pieces shared by MoE model families: routers, grouped experts, the MoE layer."""

from timetotrain.models.common.moe.experts import GroupedExperts, grouped_mm_supported, permute, unpermute
from timetotrain.models.common.moe.layer import MoE
from timetotrain.models.common.moe.router import GroupLimitedRouter, TopKRouter

__all__ = [
    "GroupLimitedRouter",
    "GroupedExperts",
    "MoE",
    "TopKRouter",
    "grouped_mm_supported",
    "permute",
    "unpermute",
]
