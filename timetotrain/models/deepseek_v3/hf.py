"""Hugging Face `DeepseekV3ForCausalLM` interchange for the deepseek_v3 family: the equivalent `transformers`
config, and our parameter name -> `Source` mapping for the streamed checkpoint loader
(`train/checkpoint.load_hf_checkpoint`), plus the other direction for the bases `ttt base` writes.

The layout is `deepseek-ai/DeepSeek-V3`'s (which `save_pretrained` also writes): per-expert
`mlp.experts.{e}.{gate,up,down}_proj`, the router `mlp.gate.weight` and its balancing bias
`mlp.gate.e_score_correction_bias`, `mlp.shared_experts.*`, MLA's `q_a_proj`, `q_a_layernorm`, `q_b_proj`
(or `q_proj` without a query bottleneck), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`.
MTP depth k is HF layer `num_hidden_layers + k - 1` (61 at full size): `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` and an ordinary decoder layer; its `embed_tokens` and `shared_head.head` copies are the
main model's (shared here) and are not read.

Rotary rows: HF rotates interleaved pairs of the rope dimensions (`rope_interleave`, DeepSeek's layout);
ours rotate halves, so the rope rows of `q_b_proj` (per head) and of `kv_a_proj_with_mqa` are reordered
evens-then-odds on the way in (`rope_permutation`) and back on the way out.
"""

from __future__ import annotations

import torch

from timetotrain.models.deepseek_v3.config import DeepSeekV3Config
from timetotrain.models.family import Source


def hf_config_kwargs(cfg: DeepSeekV3Config) -> dict:
    """Keyword arguments for `transformers.DeepseekV3Config` describing the same model (MTP depths aside,
    which HF does not model: `num_nextn_predict_layers` records them)."""
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        moe_intermediate_size=cfg.expert_ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        n_shared_experts=cfg.n_shared_experts,
        n_routed_experts=cfg.n_experts,
        routed_scaling_factor=cfg.routed_scaling,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_dim,
        n_group=cfg.n_groups,
        topk_group=cfg.topk_groups,
        num_experts_per_tok=cfg.top_k,
        first_k_dense_replace=cfg.first_dense,
        norm_topk_prob=True,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_interleave=True,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
        num_nextn_predict_layers=cfg.mtp_layers,
    )
    s = cfg.rope_scaling
    if s is not None:
        kwargs["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "mscale": s.mscale,
            "mscale_all_dim": s.mscale_all_dim,
        }
    return kwargs


def rope_permutation(rope_dim: int) -> torch.Tensor:
    """`ours = hf[perm]` over the rope dimensions: the even ones, then the odd ones."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


def _q_rows(cfg: DeepSeekV3Config, inverse: bool = False) -> torch.Tensor:
    """Row order of the query projection `[H x (nope + rope), in]`: the rope rows of each head permuted."""
    perm = rope_permutation(cfg.qk_rope_dim)
    if inverse:
        perm = perm.argsort()
    head = torch.cat((torch.arange(cfg.qk_nope_dim), cfg.qk_nope_dim + perm))
    return (torch.arange(cfg.n_heads).unsqueeze(1) * cfg.qk_head_dim + head).reshape(-1)


def _kv_down_rows(cfg: DeepSeekV3Config, inverse: bool = False) -> torch.Tensor:
    perm = rope_permutation(cfg.qk_rope_dim)
    if inverse:
        perm = perm.argsort()
    return torch.cat((torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + perm))


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # index_select would quietly take a subset of a larger tensor: a checkpoint of another shape must fail
    # (RuntimeError, which the loader reports as a config mismatch).
    if t.shape[0] != rows.numel():
        raise RuntimeError(f"expected {rows.numel()} rows, got {t.shape[0]}")
    return t.index_select(0, rows)


def _block_names(cfg: DeepSeekV3Config, layer: int) -> dict[str, tuple[str, ...]]:
    """Our block-relative name -> the HF tensors (layer-relative) it is built from, for one decoder layer."""
    out = {
        "attn_norm.weight": ("input_layernorm.weight",),
        "ffn_norm.weight": ("post_attention_layernorm.weight",),
        "attn.kv_down.weight": ("self_attn.kv_a_proj_with_mqa.weight",),
        "attn.kv_norm.weight": ("self_attn.kv_a_layernorm.weight",),
        "attn.kv_up.weight": ("self_attn.kv_b_proj.weight",),
        "attn.proj.weight": ("self_attn.o_proj.weight",),
    }
    if cfg.q_lora_rank is None:
        out["attn.q_up.weight"] = ("self_attn.q_proj.weight",)
    else:
        out["attn.q_down.weight"] = ("self_attn.q_a_proj.weight",)
        out["attn.q_norm.weight"] = ("self_attn.q_a_layernorm.weight",)
        out["attn.q_up.weight"] = ("self_attn.q_b_proj.weight",)
    if not cfg.is_moe(layer):
        out["ffn.fc1.weight"] = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
        out["ffn.fc2.weight"] = ("mlp.down_proj.weight",)
        return out
    out["ffn.router.weight"] = ("mlp.gate.weight",)
    out["ffn.router.bias"] = ("mlp.gate.e_score_correction_bias",)
    n = cfg.n_experts
    out["ffn.experts.w1"] = tuple(
        f"mlp.experts.{e}.{p}_proj.weight" for e in range(n) for p in ("gate", "up")
    )
    out["ffn.experts.w2"] = tuple(f"mlp.experts.{e}.down_proj.weight" for e in range(n))
    if cfg.n_shared_experts:
        out["ffn.shared.fc1.weight"] = (
            "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.up_proj.weight",
        )
        out["ffn.shared.fc2.weight"] = ("mlp.shared_experts.down_proj.weight",)
    return out


def _combine(cfg: DeepSeekV3Config, name: str):
    """How the HF tensors of our block-relative `name` make our tensor."""
    if name.endswith("fc1.weight"):
        return lambda t: torch.cat(t, dim=0)  # gate rows, then up rows
    if name == "ffn.experts.w1":
        return lambda t: torch.stack([torch.cat(t[i : i + 2], dim=0) for i in range(0, len(t), 2)])
    if name == "ffn.experts.w2":
        return lambda t: torch.stack(t)
    if name == "attn.q_up.weight":
        return lambda t: _rows(t[0], _q_rows(cfg))
    if name == "attn.kv_down.weight":
        return lambda t: _rows(t[0], _kv_down_rows(cfg))
    return None


def _source(cfg: DeepSeekV3Config, prefix: str, name: str, hf: tuple[str, ...]) -> Source:
    names = tuple(prefix + h for h in hf)
    combine = _combine(cfg, name)
    return Source(names) if combine is None else Source(names, combine)


def hf_mapping(cfg: DeepSeekV3Config) -> dict[str, Source]:
    """Our parameter (and persistent buffer) name -> its HF source, for a `DeepSeekV3(cfg)`."""
    mapping = {
        "embed.weight": Source(("model.embed_tokens.weight",)),
        "norm.weight": Source(("model.norm.weight",)),
        "head.weight": Source(("lm_head.weight",)),
    }
    for i in range(cfg.n_layers):
        for name, hf in _block_names(cfg, i).items():
            mapping[f"layers.{i}.{name}"] = _source(cfg, f"model.layers.{i}.", name, hf)
    for k in range(cfg.mtp_layers):
        layer = cfg.n_layers + k
        prefix, ours = f"model.layers.{layer}.", f"mtp.{k}."
        for a, b in (
            ("enorm", "enorm"),
            ("hnorm", "hnorm"),
            ("eh_proj", "eh_proj"),
            ("norm", "shared_head.norm"),
        ):
            mapping[ours + a + ".weight"] = Source((prefix + b + ".weight",))
        for name, hf in _block_names(cfg, layer).items():
            mapping[ours + "block." + name] = _source(cfg, prefix, name, hf)
    return mapping


def _split(cfg: DeepSeekV3Config, name: str, t: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `_combine`: our tensor -> the HF tensors, in `_block_names` order."""
    if name.endswith("fc1.weight"):
        return list(t.chunk(2, dim=0))
    if name == "ffn.experts.w1":
        return [part for e in t for part in e.chunk(2, dim=0)]
    if name == "ffn.experts.w2":
        return list(t.unbind(0))
    if name == "attn.q_up.weight":
        return [_rows(t, _q_rows(cfg, inverse=True))]
    if name == "attn.kv_down.weight":
        return [_rows(t, _kv_down_rows(cfg, inverse=True))]
    return [t]


def hf_export(state_dict: dict[str, torch.Tensor], cfg: DeepSeekV3Config) -> tuple[dict, dict]:
    """Our state dict -> (HF state dict in the DeepSeek-V3 layout, its `config.json`), loadable by our own
    `--init-checkpoint` and, for the main layers, by `DeepseekV3ForCausalLM.from_pretrained` (which ignores
    the MTP layer, as for the original checkpoint). The MTP layer carries copies of the embedding and head,
    as DeepSeek's checkpoint does."""
    out = {}
    for ours, src in hf_mapping(cfg).items():
        if ours.startswith(("layers.", "mtp.")):
            name = ours.split(".", 2)[2]
            if ours.startswith("mtp."):
                name = name.removeprefix("block.")
            parts = _split(cfg, name, state_dict[ours])
        else:
            parts = [state_dict[ours]]
        for hf, t in zip(src.hf_names, parts, strict=True):
            out[hf] = t.contiguous()
    for k in range(cfg.mtp_layers):
        prefix = f"model.layers.{cfg.n_layers + k}."
        out[prefix + "embed_tokens.weight"] = state_dict["embed.weight"].clone()
        out[prefix + "shared_head.head.weight"] = state_dict["head.weight"].clone()
    dtype = next(iter(state_dict.values())).dtype
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": str(dtype).removeprefix("torch."),
        **hf_config_kwargs(cfg),
    }
    return out, config
