"""Hugging Face `LlamaForCausalLM` interchange for the llama family: the equivalent `transformers` config,
whole state dicts both ways, and the per-parameter `Source` mapping the streamed checkpoint loader uses
(`train/checkpoint.load_hf_checkpoint`). The per-parameter mapping produces exactly what
`from_hf_state_dict` does for the whole dict (tested).

Two checkpoint layouts of the attention input projection are read:

- stock HF (`meta-llama/Llama-2-70b-hf`, Llama 3.x): `self_attn.{q,k,v}_proj.weight`, three tensors;
- fused (MLCommons `Llama2-70b-fused-qkv-mlperf`, the base of the `llama2_70b_lora` benchmark):
  one `self_attn.qkv_proj.weight` holding all q rows, then all k rows, then all v rows.

Both are HF's q|k|v row order; ours groups the rows per KV head (`common/layers.py`). `qkv_permutation` is that
reordering, written once and used for weights and for anything else with one row per qkv output (a LoRA B
trained on HF's `qkv_proj`, a gradient).
"""

from __future__ import annotations

import torch

from timetotrain.models.family import Source
from timetotrain.models.llama.config import LlamaConfig


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


def qkv_permutation(cfg) -> torch.Tensor:
    """Row indices `perm` such that `ours = hf[perm]`: row `i` of our fused qkv is row `perm[i]` of HF's
    concatenation [q rows (all heads); k rows; v rows]. `cfg` needs `n_heads`, `n_kv_heads`, `head_dim`."""
    hd, kv, g = cfg.head_dim, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    q = torch.arange(cfg.n_heads * hd).view(kv, g, hd)  # query head j*g+m sits in KV group j
    k = cfg.n_heads * hd + torch.arange(kv * hd).view(kv, 1, hd)
    v = k + kv * hd
    return torch.cat((q, k, v), dim=1).reshape(-1)


def _check_qkv_rows(t: torch.Tensor, perm: torch.Tensor, cfg) -> None:
    # index_select would happily pick a subset of a larger tensor: a checkpoint of another shape must fail.
    # RuntimeError, as a failing view would raise, so that the loader reports it as a config mismatch.
    if t.shape[0] != perm.numel():
        raise RuntimeError(
            f"expected {perm.numel()} qkv rows ({cfg.n_heads} query + 2 x {cfg.n_kv_heads} key/value heads "
            f"of {cfg.head_dim}), got {t.shape[0]}"
        )


def qkv_from_hf(t: torch.Tensor, cfg) -> torch.Tensor:
    """HF's q|k|v row order (dim 0 of `t`, any trailing shape) -> our grouped order."""
    perm = qkv_permutation(cfg)
    _check_qkv_rows(t, perm, cfg)
    return t.index_select(0, perm.to(t.device))


def qkv_to_hf(t: torch.Tensor, cfg) -> torch.Tensor:
    """Our grouped row order -> HF's q|k|v concatenation (the inverse of `qkv_from_hf`)."""
    perm = qkv_permutation(cfg)
    _check_qkv_rows(t, perm, cfg)
    return t.index_select(0, perm.argsort().to(t.device))


def _hf_attn_names(prefix: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the stock q, k, v names, the fused name) of one layer's attention input projection."""
    return tuple(prefix + f"self_attn.{p}_proj.weight" for p in "qkv"), (
        prefix + "self_attn.qkv_proj.weight",
    )


_HF_SAME = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.fc2.weight": "mlp.down_proj.weight",
}


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], cfg: LlamaConfig, fused_qkv: bool = False
) -> dict[str, torch.Tensor]:
    """Our state dict -> HF `LlamaForCausalLM` state dict (fc1 split into gate/up; QKV split into q/k/v, or
    with `fused_qkv` one `qkv_proj` in the MLCommons layout)."""
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {
        "model.embed_tokens.weight": state_dict["embed.weight"],
        "model.norm.weight": state_dict["norm.weight"],
        "lm_head.weight": state_dict["head.weight"],
    }
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _HF_SAME.items():
            out[hf + b] = state_dict[ours + a]
        qkv = qkv_to_hf(state_dict[ours + "attn.qkv.weight"], cfg)
        separate, fused = _hf_attn_names(hf)
        if fused_qkv:
            out[fused[0]] = qkv
        else:
            for name, part in zip(separate, qkv.split([q_rows, kv_rows, kv_rows]), strict=True):
                out[name] = part
        gate, up = state_dict[ours + "ffn.fc1.weight"].chunk(2, dim=0)
        out[hf + "mlp.gate_proj.weight"] = gate.contiguous()
        out[hf + "mlp.up_proj.weight"] = up.contiguous()
    return out


def hf_export(state_dict: dict[str, torch.Tensor], cfg: LlamaConfig) -> tuple[dict, dict]:
    """Our state dict -> (HF `LlamaForCausalLM` state dict, its `config.json`), loadable by
    `LlamaForCausalLM.from_pretrained` and by our own `--init-checkpoint`."""
    dtype = next(iter(state_dict.values())).dtype
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": str(dtype).removeprefix("torch."),
        **hf_config_kwargs(cfg),
    }
    return {k: v.contiguous() for k, v in to_hf_state_dict(state_dict, cfg).items()}, config


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF `LlamaForCausalLM` state dict, either attention layout -> ours (inverse of `to_hf_state_dict`)."""
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
        separate, fused = _hf_attn_names(hf)
        if fused[0] in state_dict:
            qkv = state_dict[fused[0]]
        else:
            qkv = torch.cat([state_dict[name] for name in separate])
        out[ours + "attn.qkv.weight"] = qkv_from_hf(qkv, cfg)
        out[ours + "ffn.fc1.weight"] = torch.cat(
            (state_dict[hf + "mlp.gate_proj.weight"], state_dict[hf + "mlp.up_proj.weight"]), dim=0
        )
    return out


def hf_mapping(cfg: LlamaConfig, fused_qkv: bool | None = None) -> dict[str, Source]:
    """Our parameter name -> its HF source, for a `Llama(cfg)`.

    `fused_qkv`: False reads the stock `{q,k,v}_proj`, True the MLCommons fused `qkv_proj`; None (what the
    family's `hf_mapping(cfg)` gives) reads whichever the checkpoint holds, the loader choosing per layer
    (`Source.otherwise`), and names both when it holds neither."""
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def fuse_qkv(t: list[torch.Tensor]) -> torch.Tensor:
        rows = [x.shape[0] for x in t]
        if rows != [q_rows, kv_rows, kv_rows]:  # the total alone could match with q and k/v traded
            raise RuntimeError(f"expected q, k, v rows {[q_rows, kv_rows, kv_rows]}, got {rows}")
        return qkv_from_hf(torch.cat(t), cfg)

    def reorder_qkv(t: list[torch.Tensor]) -> torch.Tensor:
        return qkv_from_hf(t[0], cfg)

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
        separate, fused = _hf_attn_names(hf)
        if fused_qkv is None:
            qkv = Source(separate, fuse_qkv, otherwise=Source(fused, reorder_qkv))
        else:
            qkv = Source(fused, reorder_qkv) if fused_qkv else Source(separate, fuse_qkv)
        mapping[ours + "attn.qkv.weight"] = qkv
        mapping[ours + "ffn.fc1.weight"] = Source(
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), fuse_fc1
        )
    return mapping
