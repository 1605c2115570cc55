"""GPT-OSS-20B-shaped mixture-of-experts decoder (the MLPerf `gpt_oss_20b` model, docs/benchmarks/gpt_oss_20b.md).

This is the Megatron/Primus reference configuration, not Hugging Face's GPT-OSS: Llama 3.1 vocabulary, plain
RoPE (theta 150k, no YaRN), no biases, no attention sinks, no shared expert, a plain SwiGLU (no clamp),
RMSNorm on per-head Q and K, and a router that takes the top-k logits and softmaxes over those k only.

Block: RMSNorm -> GQA attention (QK-norm, RoPE, causal; every other layer a 128-token sliding window) ->
residual, RMSNorm -> MoE (router + top-k of E SwiGLU experts, dropless) -> residual. Final RMSNorm, untied
head.

Readings of the reference that its published configuration does not spell out:

- Which layers slide. Megatron's `window_attn_skip_freq` list is indexed by the 1-indexed layer number
  (`list[layer_number - 1]`, truthy = windowed); the reference list is [1, 0, 1, 0, ...], so 1-indexed layers
  1, 3, ..., 23 slide, i.e. 0-indexed layers 0, 2, ..., 22. `MoEConfig.window_pattern` is that list, repeated
  cyclically over the layers so that tiny configs can reuse it.
- Window width. Megatron passes `window_size=(128, 0)` to the kernel with flash-attn / Transformer Engine
  semantics: query `i` sees keys `i - 128 <= j <= i` inclusive, i.e. 129 keys counting itself (Megatron's own
  unfused mask, `get_sliding_window_causal_mask`, is the same band). HF's GPT-OSS `sliding_window=128` means
  `i - 128 < j <= i` (128 keys); we follow Megatron.
- QK-norm order. Megatron applies `q_layernorm` / `k_layernorm` inside `get_query_key_value_tensors`, before
  the rotary embedding in `forward`; so do we. The norm runs over `head_dim` with one weight vector shared by
  all heads (Megatron builds it with `hidden_size=kv_channels`).
- Epsilon. Megatron-LM's `core_transformer_config_from_args` overwrites `layernorm_epsilon` with
  `args.norm_epsilon`, so the experiment's `layernorm_epsilon: 1e-5` has no effect and every RMSNorm,
  QK-norm included, uses 1e-6.
- Expert weighting. Like Megatron's experts, the router probability scales the SwiGLU activation before the
  down projection (`act(x) * p` in fp32, cast back); the combine is then a plain sum over the k slots.

The layers are the shared ones (`common/layers.py`, `common/decoder.py`, `common/moe/`); this file holds the
assembly of the blocks, and the sizes and FLOPs; `config.py` the configuration.
"""

from __future__ import annotations

import torch

from timetotrain.models.common.decoder import Decoder
from timetotrain.models.common.layers import attention_keys_per_query, attention_matmul_params
from timetotrain.models.common.moe import MoE, TopKRouter
from timetotrain.models.common.moe.telemetry import expert_load
from timetotrain.models.family import ModelFamily
from timetotrain.models.gpt_oss.config import GptOssConfig
from timetotrain.models.gpt_oss.parallelize import check_shape, tensor_parallel


class GptOss(Decoder):
    def __init__(self, cfg: GptOssConfig):
        def moe(layer: int) -> MoE:
            router = TopKRouter(cfg.dim, cfg.n_experts, cfg.top_k)
            return MoE(router, cfg.n_experts, cfg.top_k, cfg.dim, cfg.expert_ffn_dim)

        super().__init__(
            cfg,
            moe,
            window_of=lambda layer: cfg.sliding_window if cfg.is_window_layer(layer) else None,
            qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
        )

    def tokens_per_expert(self) -> torch.Tensor:
        """`[n_layers, n_experts]` token copies routed to each expert in the last forward (on device)."""
        return torch.stack([block.ffn.tokens_per_expert for block in self.layers])


def init_weights(model: GptOss, generator: torch.Generator | None = None) -> None:
    """Megatron initialisation with `init_method_std` (σ, and σ/√(2L) on attention output and expert fc2)."""
    model.init_weights(generator)


def _layer_matmul_params(cfg: GptOssConfig, experts: int) -> int:
    attention = attention_matmul_params(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    router = cfg.dim * cfg.n_experts
    return attention + router + experts * 3 * cfg.dim * cfg.expert_ffn_dim


def _norm_params(cfg: GptOssConfig) -> int:
    per_layer = 2 * cfg.dim + (2 * cfg.head_dim if cfg.qk_norm else 0)
    return cfg.n_layers * per_layer + cfg.dim


def param_count(cfg: GptOssConfig) -> int:
    """All trainable parameters: embedding + head + per layer (attention, router, all experts, norms)."""
    layers = cfg.n_layers * _layer_matmul_params(cfg, cfg.n_experts)
    return layers + 2 * cfg.vocab_size * cfg.dim + _norm_params(cfg)


def active_param_count(cfg: GptOssConfig) -> int:
    """Parameters one token touches: as `param_count` but `top_k` experts per layer instead of all."""
    layers = cfg.n_layers * _layer_matmul_params(cfg, cfg.top_k)
    return layers + 2 * cfg.vocab_size * cfg.dim + _norm_params(cfg)


def flops_per_token(cfg: GptOssConfig, seq_len: int, causal: bool = True) -> float:
    """Training (forward + backward) FLOPs per token over the ACTIVE weights, as the llama family counts them.

    6 * (attention, router, `top_k` experts per layer, LM head matmul weights) + attention scores/weighted sum
    at 12 * H * hd FLOPs per (query, key) pair a layer computes, averaged per query:
    - full layers: `T` keys over the full square, or `T / 2` with `causal` (the llama convention);
    - window layers (W = `sliding_window`): only the band a windowed kernel computes: `min(W, T)` keys, or
      with `causal` the band's area per query, `W - W^2 / (2T)` for `T > W` (else `T / 2`, the full triangle).
    Router softmax/top-k, permutation, norms, RoPE and element-wise work are left out.
    """
    full_keys = attention_keys_per_query(seq_len, None, causal)
    window_keys = attention_keys_per_query(seq_len, cfg.sliding_window, causal)
    n_window = sum(cfg.is_window_layer(i) for i in range(cfg.n_layers))
    keys = (cfg.n_layers - n_window) * full_keys + n_window * window_keys
    matmul = cfg.n_layers * _layer_matmul_params(cfg, cfg.top_k) + cfg.dim * cfg.vocab_size
    return 6 * matmul + 12 * cfg.n_heads * cfg.head_dim * keys


def activation_elements(cfg: GptOssConfig) -> float:
    """Elements autograd keeps per token for one block (see train/memory.py), in the compute precision
    (bf16; an fp32 tensor counts 2, an int64 4), as this block's code saves them, on a GPU:

    - each RMSNorm (attention, MoE, per-head Q and K): its input cast to fp32 (2), the normalised values
      (1) and one fp32 1/rms per row (2); the weight's product is kept by what reads it;
    - attention: the QKV projection's input (h) and output ((H + 2 H_kv) d: V is a view of it, which keeps
      it whole), the rotated q and k ((H + H_kv) d; RoPE keeps only its tables), the kernel's output, which
      is the output projection's input (H d), and its fp32 log-sum-exp per head (2H);
    - the MoE: the router's fp32 input (2h), its top-k ids (4k) and fp32 softmax (2k); per routed copy
      (k): the expert's input (h), fc1's output (2f), the SwiGLU output the probability scales (f) with
      that fp32 probability (2), fc2's input (f), and the two int64 orders (8: permute, unpermute); the
      combine (a sum over the k slots) keeps nothing.

    Sliding-window and full-attention layers keep the same: a GPU runs both in FlashAttention kernels
    (`layers.native_window_works`: torch's windowed `varlen_attn`; SDPA with `enable_gqa`), which keep
    q, k, v, the output and the log-sum-exp whatever the window. A CPU, or a GPU where the windowed kernel
    fails its check, runs the band as masks (`layers.windowed_attention`), which keeps more; not counted.
    Checked against the tensors a block saves under `ttt plan --simulate`'s fake tensors at the reference
    shape, both kinds of layer (tests/test_plan.py)."""
    return sum(_block_elements(cfg))


def _block_elements(cfg: GptOssConfig) -> tuple[float, float, float]:
    """`activation_elements` in three parts: (the attention with its norm, the MoE's norm, the router and
    the routed copies)."""
    h, f, k, d = cfg.dim, cfg.expert_ffn_dim, cfg.top_k, cfg.head_dim
    q, kv = cfg.n_heads * d, cfg.n_kv_heads * d

    def norm(width: int, rows: int = 1) -> int:
        return 3 * width + 2 * rows  # fp32 input + normalised values, fp32 1/rms per row

    qk_norm = norm(q, cfg.n_heads) + norm(kv, cfg.n_kv_heads) if cfg.qk_norm else 0
    attention = norm(h) + h + (q + 2 * kv) + qk_norm + (q + kv) + q + 2 * cfg.n_heads
    router = 2 * h + 4 * k + 2 * k
    return attention, norm(h), router + k * (h + 2 * f + f + 2 + f + 8)


def tensor_parallel_elements(cfg: GptOssConfig, tp: int) -> float:
    """`activation_elements` per token on one rank under the TP plan (parallelize.py): the attention, the
    norms and their heads 1/tp (sequence parallelism, heads split), but the QKV input gathered whole (h)
    and the MoE whole (router and routed copies: every TP rank of a group runs it on all the group's
    tokens)."""
    attention, moe_norm, routed = _block_elements(cfg)
    return (attention - cfg.dim + moe_norm) / tp + cfg.dim + routed


def telemetry(model: GptOss) -> tuple[dict, str]:
    """Tokens routed to each expert in the last training forward: per layer, and the load spread."""
    return expert_load(model.tokens_per_expert().tolist())


FAMILY = ModelFamily(
    name="gpt_oss",
    build=GptOss,
    init=init_weights,
    param_count=param_count,
    active_param_count=active_param_count,
    flops_per_token=flops_per_token,
    block_params=lambda cfg: _layer_matmul_params(cfg, cfg.n_experts) + _norm_params(cfg) // cfg.n_layers,
    # A pipeline's split by what a token computes: top-k experts per layer, the head (train/pipeline.py).
    stage_costs=lambda cfg: (
        [float(_layer_matmul_params(cfg, cfg.top_k))] * cfg.n_layers,
        float(cfg.dim * cfg.vocab_size),
    ),
    activation_elements=activation_elements,
    telemetry=telemetry,
    tensor_parallel=tensor_parallel,
    tensor_parallel_check=check_shape,
    tensor_parallel_elements=tensor_parallel_elements,
)
