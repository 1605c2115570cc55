"""The deepseek_v3 family (MLA, group-limited MoE, MTP): `config.py` its sizes, `model.py` the module, its
counts and FAMILY, `hf.py` the Hugging Face interchange."""

from timetotrain.models.deepseek_v3.config import DEEPSEEK_V3, DeepSeekV3Config
from timetotrain.models.deepseek_v3.model import (
    FAMILY,
    DeepSeekV3,
    LatentAttention,
    MultiTokenPrediction,
    activation_elements,
    active_param_count,
    flops_per_token,
    init_weights,
    make_ffn,
    param_count,
    telemetry,
)

__all__ = [
    "DeepSeekV3Config",
    "DEEPSEEK_V3",
    "LatentAttention",
    "make_ffn",
    "MultiTokenPrediction",
    "DeepSeekV3",
    "init_weights",
    "param_count",
    "active_param_count",
    "flops_per_token",
    "activation_elements",
    "telemetry",
    "FAMILY",
]
