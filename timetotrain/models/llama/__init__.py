"""The llama family (Llama 2 and 3.x decoders): `config.py` its sizes, `model.py` the module, its counts
and FAMILY, `hf.py` the Hugging Face interchange."""

from timetotrain.models.llama.config import LLAMA2_70B, LLAMA31_8B, LLAMA31_405B, LlamaConfig, RopeScaling
from timetotrain.models.llama.model import (
    FAMILY,
    Llama,
    activation_elements,
    flops_per_token,
    init_weights,
    param_count,
)

__all__ = [
    "LlamaConfig",
    "RopeScaling",  # a LlamaConfig field's type, so a config can be written from this package alone
    "LLAMA31_8B",
    "LLAMA31_405B",
    "LLAMA2_70B",
    "Llama",
    "init_weights",
    "param_count",
    "flops_per_token",
    "activation_elements",
    "FAMILY",
]
