"""The qwen3_5_moe family (Qwen3.5-MoE text model: Gated DeltaNet + gated attention hybrid, MoE with a gated shared
expert): `config.py` its sizes, `deltanet.py` and `attention.py` the token mixers, `model.py` the module, its counts
and FAMILY, `hf.py` the Hugging Face interchange, `generate.py` batched decoding with a KV cache and recurrent
state."""

from timetotrain.models.qwen3_5_moe.config import QWEN35_397B, Qwen35MoeConfig
from timetotrain.models.qwen3_5_moe.model import (
    FAMILY,
    Qwen35Moe,
    activation_elements,
    active_param_count,
    flops_per_token,
    init_weights,
    param_count,
)

__all__ = [
    "Qwen35MoeConfig",
    "QWEN35_397B",
    "Qwen35Moe",
    "init_weights",
    "param_count",
    "active_param_count",
    "flops_per_token",
    "activation_elements",
    "FAMILY",
]
