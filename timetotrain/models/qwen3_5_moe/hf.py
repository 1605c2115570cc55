"""Hugging Face `Qwen3_5MoeForCausalLM` interchange for the qwen3_5_moe family: the equivalent `transformers` text
config, our parameter name -> `Source` mapping for the streamed checkpoint loader
(`train/checkpoint.load_hf_checkpoint`, which also fills FSDP2 and expert-parallel shards), and the other
direction for the bases `ttt base` writes.

Checkpoint layouts accepted (each tensor from the first layout the checkpoint holds in full, `Source.otherwise`):
- prefix `model.` (what `Qwen3_5MoeForCausalLM.save_pretrained` writes) or `model.language_model.` (the hub's
  `Qwen3_5MoeForConditionalGeneration` checkpoints, e.g. Qwen/Qwen3.5-397B-A17B; their vision tower and MTP
  tensors are not read and end up in the load report's `ignored`);
- experts fused (`mlp.experts.gate_up_proj` `[E, 2F, h]`, gate rows first, and `mlp.experts.down_proj`
  `[E, h, F]`: transformers 5's in-memory layout, equal to ours) or per expert
  (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the hub layout).

Our weights equal HF's element for element (no permutation), some of them stacked: the attention's q (with its
gate), k and v projections are the rows of our `attn.qkv`, the DeltaNet's `in_proj_{qkv,z,b,a}` those of our
`attn.in_proj` (one matmul each); the 1-centred norms store the same offset from 1,
the conv taps keep `[C, 1, K]`, partial RoPE rotates the same halves of the same leading dimensions.
"""

from __future__ import annotations

import torch

from timetotrain.models.family import Source
from timetotrain.models.qwen3_5_moe.config import Qwen35MoeConfig

PREFIXES = ("model.", "model.language_model.")


def hf_config_kwargs(cfg: Qwen35MoeConfig) -> dict:
    """Keyword arguments for `transformers.Qwen3_5MoeTextConfig` describing the same model."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        linear_conv_kernel_dim=cfg.conv_kernel,
        linear_key_head_dim=cfg.lin_k_dim,
        linear_value_head_dim=cfg.lin_v_dim,
        linear_num_key_heads=cfg.lin_k_heads,
        linear_num_value_heads=cfg.lin_v_heads,
        moe_intermediate_size=cfg.expert_ffn_dim,
        shared_expert_intermediate_size=cfg.shared_ffn_dim,
        num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        layer_types=[
            "full_attention" if cfg.is_full_attention(i) else "linear_attention" for i in range(cfg.n_layers)
        ],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary,
        },
    )


def _mixer_names(cfg: Qwen35MoeConfig, layer: int) -> dict[str, str]:
    """Our block-relative name -> the HF layer-relative name, for everything but the experts."""
    out = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn.router.weight": "mlp.gate.weight",
        "ffn.shared.ffn.fc2.weight": "mlp.shared_expert.down_proj.weight",
        "ffn.shared.gate.weight": "mlp.shared_expert_gate.weight",
    }
    if cfg.is_full_attention(layer):
        out["attn.o_proj.weight"] = "self_attn.o_proj.weight"
        for p in ("q_norm", "k_norm"):
            out[f"attn.{p}.weight"] = f"self_attn.{p}.weight"
    else:
        for p in ("norm", "out_proj"):
            out[f"attn.{p}.weight"] = f"linear_attn.{p}.weight"
        out["attn.conv_weight"] = "linear_attn.conv1d.weight"
        out["attn.dt_bias"] = "linear_attn.dt_bias"
        out["attn.A_log"] = "linear_attn.A_log"
    return out


QKV_PARTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
IN_PROJ_PARTS = tuple(f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))


def _fused_names(cfg: Qwen35MoeConfig, layer: int) -> tuple[str, tuple[str, ...]]:
    """Our fused input projection of a layer and the HF tensors whose rows it stacks, in order."""
    if cfg.is_full_attention(layer):
        return "attn.qkv.weight", QKV_PARTS
    return "attn.in_proj.weight", IN_PROJ_PARTS


def _fused_sizes(cfg: Qwen35MoeConfig, layer: int) -> list[int]:
    if cfg.is_full_attention(layer):
        kv = cfg.n_kv_heads * cfg.head_dim
        return [2 * cfg.n_heads * cfg.head_dim, kv, kv]
    value = cfg.lin_v_heads * cfg.lin_v_dim
    return [cfg.conv_dim, value, cfg.lin_v_heads, cfg.lin_v_heads]


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def _stack_pairs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert gate, up, gate, up, ... -> `[E, 2F, h]` (gate rows first)."""
    return torch.stack([torch.cat(tensors[i : i + 2], dim=0) for i in range(0, len(tensors), 2)])


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors)


def _chain(layouts: list[Source]) -> Source:
    src = None
    for layout in reversed(layouts):
        src = Source(layout.hf_names, layout.combine, otherwise=src)
    return src


def _expert_sources(cfg: Qwen35MoeConfig, prefix: str) -> dict[str, list[Source]]:
    E = cfg.n_experts
    w1_per = tuple(f"{prefix}mlp.experts.{e}.{p}_proj.weight" for e in range(E) for p in ("gate", "up"))
    w2_per = tuple(f"{prefix}mlp.experts.{e}.down_proj.weight" for e in range(E))
    return {
        "ffn.experts.w1": [Source((f"{prefix}mlp.experts.gate_up_proj",)), Source(w1_per, _stack_pairs)],
        "ffn.experts.w2": [Source((f"{prefix}mlp.experts.down_proj",)), Source(w2_per, _stack)],
    }


def hf_mapping(cfg: Qwen35MoeConfig) -> dict[str, Source]:
    """Our parameter name -> its HF source (module docstring), for a `Qwen35Moe(cfg)`."""
    mapping = {
        "embed.weight": _chain([Source((p + "embed_tokens.weight",)) for p in PREFIXES]),
        "norm.weight": _chain([Source((p + "norm.weight",)) for p in PREFIXES]),
        "head.weight": Source(("lm_head.weight",)),
    }
    for i in range(cfg.n_layers):
        ours = f"layers.{i}."
        hf = [f"{p}layers.{i}." for p in PREFIXES]
        for name, theirs in _mixer_names(cfg, i).items():
            mapping[ours + name] = _chain([Source((h + theirs,)) for h in hf])
        fused = _fused_names(cfg, i)
        mapping[ours + fused[0]] = _chain([Source(tuple(h + n for n in fused[1]), _cat) for h in hf])
        fc1 = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")
        mapping[ours + "ffn.shared.ffn.fc1.weight"] = _chain(
            [Source(tuple(h + n for n in fc1), _cat) for h in hf]
        )
        per_prefix = [_expert_sources(cfg, h) for h in hf]
        for name in ("ffn.experts.w1", "ffn.experts.w2"):
            mapping[ours + name] = _chain([s for layouts in per_prefix for s in layouts[name]])
    return mapping


def hf_export(state_dict: dict[str, torch.Tensor], cfg: Qwen35MoeConfig) -> tuple[dict, dict]:
    """Our state dict -> (HF state dict with prefix `model.` and per-expert tensors, its `config.json`), loadable by
    our own `--init-checkpoint` and by `Qwen3_5MoeForCausalLM.from_pretrained`."""
    out = {}
    for ours, src in hf_mapping(cfg).items():
        t = state_dict[ours]
        names = src.hf_names
        if ours.endswith("ffn.experts.w1"):
            names, parts = src.otherwise.hf_names, [p for e in t for p in e.chunk(2, dim=0)]
        elif ours.endswith("ffn.experts.w2"):
            names, parts = src.otherwise.hf_names, list(t.unbind(0))
        elif ours.endswith("shared.ffn.fc1.weight"):
            parts = list(t.chunk(2, dim=0))
        elif ours.endswith(("attn.qkv.weight", "attn.in_proj.weight")):
            parts = list(t.split(_fused_sizes(cfg, int(ours.split(".")[1])), dim=0))
        else:
            parts = [t]
        for hf, part in zip(names, parts, strict=True):
            out[hf] = part.contiguous()
    dtype = next(iter(state_dict.values())).dtype
    config = {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "torch_dtype": str(dtype).removeprefix("torch."),
        **hf_config_kwargs(cfg),
    }
    return out, config
