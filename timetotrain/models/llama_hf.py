"""Hugging Face `LlamaForCausalLM` interchange for the llama family: the equivalent `transformers` config,
whole state dicts both ways, and the per-parameter `Source` mapping the streamed checkpoint loader uses
(`train/checkpoint.load_hf_checkpoint`). The per-parameter mapping produces exactly what
`from_hf_state_dict` does for the whole dict (tested)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from timetotrain.models.family import Source

if TYPE_CHECKING:
    from timetotrain.models.llama import LlamaConfig


def hf_config_kwargs(cfg: LlamaConfig) -> dict:
    """Keyword arguments for `transformers.LlamaConfig` describing the same model."""
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
    )
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    return kwargs


_HF_SAME = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.fc2.weight": "mlp.down_proj.weight",
}


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> HF `LlamaForCausalLM` state dict (fused QKV / fc1 split into HF's projections)."""
    hd, g, kv = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, cfg.n_kv_heads
    out = {
        "model.embed_tokens.weight": state_dict["embed.weight"],
        "model.norm.weight": state_dict["norm.weight"],
        "lm_head.weight": state_dict["head.weight"],
    }
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _HF_SAME.items():
            out[hf + b] = state_dict[ours + a]
        qkv = state_dict[ours + "attn.qkv.weight"].view(kv, g + 2, hd, cfg.dim)
        out[hf + "self_attn.q_proj.weight"] = qkv[:, :g].reshape(cfg.n_heads * hd, cfg.dim)
        out[hf + "self_attn.k_proj.weight"] = qkv[:, g].reshape(kv * hd, cfg.dim)
        out[hf + "self_attn.v_proj.weight"] = qkv[:, g + 1].reshape(kv * hd, cfg.dim)
        gate, up = state_dict[ours + "ffn.fc1.weight"].chunk(2, dim=0)
        out[hf + "mlp.gate_proj.weight"] = gate.contiguous()
        out[hf + "mlp.up_proj.weight"] = up.contiguous()
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF `LlamaForCausalLM` state dict -> ours (inverse of `to_hf_state_dict`)."""
    hd, g, kv = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, cfg.n_kv_heads
    out = {
        "embed.weight": state_dict["model.embed_tokens.weight"],
        "norm.weight": state_dict["model.norm.weight"],
        # Checkpoints saved with tied embeddings carry no lm_head; Llama 3.1 8B is untied, so require it.
        "head.weight": state_dict["lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _HF_SAME.items():
            out[ours + a] = state_dict[hf + b]
        q = state_dict[hf + "self_attn.q_proj.weight"].view(kv, g, hd, cfg.dim)
        k = state_dict[hf + "self_attn.k_proj.weight"].view(kv, 1, hd, cfg.dim)
        v = state_dict[hf + "self_attn.v_proj.weight"].view(kv, 1, hd, cfg.dim)
        out[ours + "attn.qkv.weight"] = torch.cat((q, k, v), dim=1).reshape(-1, cfg.dim)
        out[ours + "ffn.fc1.weight"] = torch.cat(
            (state_dict[hf + "mlp.gate_proj.weight"], state_dict[hf + "mlp.up_proj.weight"]), dim=0
        )
    return out


def hf_mapping(cfg: LlamaConfig) -> dict[str, Source]:
    """Our parameter name -> its HF source, for a `Llama(cfg)`."""
    hd, g, kv, dim = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, cfg.n_kv_heads, cfg.dim

    def fuse_qkv(t: list[torch.Tensor]) -> torch.Tensor:
        # Rows grouped per KV head: its g query heads, then its key head, then its value head.
        q, k, v = t[0].view(kv, g, hd, dim), t[1].view(kv, 1, hd, dim), t[2].view(kv, 1, hd, dim)
        return torch.cat((q, k, v), dim=1).reshape(-1, dim)

    def fuse_fc1(t: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(t, dim=0)  # gate rows, then up rows

    mapping = {
        "embed.weight": Source(("model.embed_tokens.weight",)),
        "norm.weight": Source(("model.norm.weight",)),
        "head.weight": Source(("lm_head.weight",)),  # Llama 3.1 is untied: the checkpoint has its own head
    }
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _HF_SAME.items():
            mapping[ours + a] = Source((hf + b,))
        attn = tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv")
        mapping[ours + "attn.qkv.weight"] = Source(attn, fuse_qkv)
        mapping[ours + "ffn.fc1.weight"] = Source(
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), fuse_fc1
        )
    return mapping
