"""The gpt_oss family (GQA with sliding windows, MoE): `config.py` its sizes, `model.py` the module, its
counts and FAMILY."""

from timetotrain.models.gpt_oss.config import GPT_OSS_20B, GptOssConfig
from timetotrain.models.gpt_oss.model import (
    FAMILY,
    GptOss,
    activation_elements,
    active_param_count,
    flops_per_token,
    init_weights,
    param_count,
    telemetry,
)

__all__ = [
    "GptOssConfig",
    "GPT_OSS_20B",
    "GptOss",
    "init_weights",
    "param_count",
    "active_param_count",
    "flops_per_token",
    "activation_elements",
    "telemetry",
    "FAMILY",
]
