"""LoRA (low-rank adapters, Hu et al. 2021) applied from outside the model, as parallelism is: the model
families stay free of it, and `apply_lora` swaps targeted `nn.Linear`s of every block `model.layers[i]`
for a `LoRALinear`:

    y = base(x) + (alpha / rank) * B(A(dropout(x)))

`A` `[rank, in]` is Kaiming-uniform (a = sqrt(5)) and `B` `[out, rank]` zero, PEFT's default, so the
adapted model starts equal to its base. Every parameter of the model is frozen; only the adapters train.
Names stay readable: `layers.0.attn.qkv.lora_A.weight`, `layers.0.attn.qkv.lora_B.weight`, and the base
weight under `layers.0.attn.qkv.base.weight`.

Order of operations, unsharded: build (meta) -> `to_empty` -> load the base weights (`load_hf_checkpoint`,
whose mapping names the unwrapped model) -> `apply_lora` -> activation checkpointing / `torch.compile` /
DDP, as `train/parallel.apply` does them. Sharded (FSDP2, `step.build_training`): build (meta) ->
`apply_lora` on the meta device (the adapters must exist before `fully_shard` groups a block's parameters)
-> `fully_shard` per block -> `to_empty` (each rank allocates its shards) -> load the base through
`base_names` and draw the adapters with `init_lora` (`shards.full_init`: the same values as unsharded).
The wrapper is a plain module inside the block, so none of those needs to know about it: FSDP2 shards the
adapters with the block and keeps no gradient for the frozen base; checkpointing replays dropout with the
saved RNG state.

Why not PEFT at runtime (it is the reference `tests/test_lora.py` compares against, at fp32 tolerance):
- the benchmark's base, MLCommons `Llama2-70b-fused-qkv-mlperf`, ships custom modeling code that HF only
  runs with `trust_remote_code`; we read its weights into our own Llama and execute no downloaded code;
- our attention has its own fused layout (one `qkv` Linear with rows grouped per KV head, `layers.py`);
  PEFT targets HF module names and would give us HF's row order and a `PeftModel` with renamed parameters
  (`base_model.model....lora_A.default.weight`) around the whole model;
- sharding, checkpointing and compilation are applied here per block from outside; an adapter that is an
  ordinary submodule of the block composes with them without PEFT's model-level wrapping and hooks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn

DEFAULT_TARGETS = ("attn.qkv", "attn.proj")

# Levels that activation checkpointing and torch.compile insert into module names; dropped from the names
# `lora_state_dict` returns so that they do not depend on how the blocks were wrapped.
_WRAPPER_LEVELS = {"_checkpoint_wrapped_module", "_orig_mod"}


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update `(alpha / rank) * B @ A` (a base bias, if any,
    stays frozen in `base`, PEFT's `bias="none"`).

    The adapters are fp32 whatever the base's dtype: they are the optimizer's master weights, and under
    autocast (or FSDP2's `param_dtype`) they compute in bf16 like the base."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        self.base = base
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        device = base.weight.device
        # Built on meta and then materialised, so that nn.Linear's own init does not draw from the global
        # RNG (the caller's seed would shift); `reset_parameters` fills them.
        with torch.device("meta"):
            lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=torch.float32)
            lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=torch.float32)
        self.lora_A = lora_A.to_empty(device=device)
        self.lora_B = lora_B.to_empty(device=device)
        # PEFT applies dropout to the adapter's input only; the base sees x unchanged.
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_parameters()

    @property
    def weight(self) -> torch.Tensor:
        """The base weight, so code that reads `attn.qkv.weight` (shape counts, init) still finds it."""
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's initialisation: A Kaiming-uniform with a = sqrt(5) (bound 1 / sqrt(in)), B zeros."""
        if self.lora_A.weight.is_meta:
            return
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same operation order as PEFT (scale applied to B's output), so fp32 results agree to rounding.
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    def extra_repr(self) -> str:
        p = self.dropout.p if isinstance(self.dropout, nn.Dropout) else 0.0
        return f"rank={self.rank}, alpha={self.alpha}, dropout={p}"


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_LEVELS)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name without wrapper levels, module) of every `LoRALinear` in `model`, in registration order."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield _clean(name), module


def apply_lora(
    model: nn.Module,
    targets: Sequence[str] = DEFAULT_TARGETS,
    rank: int = 16,
    alpha: float = 32.0,
    dropout: float = 0.1,
    generator: torch.Generator | None = None,
    base_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Freeze every parameter of `model` and wrap the `nn.Linear` at each of `targets` (paths inside a
    block, e.g. "attn.qkv") of every `model.layers[i]` in a `LoRALinear`. Returns `model`, changed in place.

    `generator` draws the A matrices (layer by layer, targets in the order given; B is zero).
    `base_dtype` (e.g. torch.bfloat16) casts the frozen weight matrices and the embedding (every frozen
    parameter of 2+ dims) to halve the base's memory; norm weights keep their dtype, as the reference keeps
    norms in fp32, and the adapters stay fp32. A bf16 base is meant for bf16 autocast or FSDP2's bf16
    `param_dtype`. Call before activation checkpointing, compile and sharding (see the module docstring).
    """
    if not isinstance(getattr(model, "layers", None), nn.ModuleList):
        raise ValueError("apply_lora expects a model exposing its blocks as model.layers (an nn.ModuleList)")
    sites = []  # (parent module, attribute), all checked before anything changes
    for i, block in enumerate(model.layers):
        for target in targets:
            parent_path, _, attr = target.rpartition(".")
            try:
                parent = block.get_submodule(parent_path) if parent_path else block
            except AttributeError:
                raise ValueError(
                    f"layers.{i} has no submodule {parent_path!r} for LoRA target {target!r}; apply LoRA "
                    "before activation checkpointing or compile wrap the blocks"
                ) from None
            base = getattr(parent, attr, None)
            if isinstance(base, LoRALinear):
                raise ValueError(f"layers.{i}.{target} already has a LoRA adapter")
            if not isinstance(base, nn.Linear):
                raise ValueError(
                    f"LoRA target layers.{i}.{target} is {type(base).__name__}, not an nn.Linear"
                )
            sites.append((parent, attr))
    for p in model.parameters():
        p.requires_grad_(False)
    if base_dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2 and p.is_floating_point():
                    p.data = p.data.to(base_dtype)  # in place of the Parameter, as nn.Module.to does
    for parent, attr in sites:
        setattr(parent, attr, LoRALinear(getattr(parent, attr), rank, alpha, dropout))
    init_lora(model, generator)
    return model


def init_lora(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """(Re)initialise every adapter of `model` (A Kaiming-uniform, B zero), e.g. from the run seed after
    a warm-up, or after `to_empty` when LoRA was applied on the meta device."""
    for _, module in lora_modules(model):
        module.reset_parameters(generator)


def base_names(model: nn.Module) -> dict[str, str | None]:
    """Where a checkpoint of the model without adapters keeps each LoRA-wrapped parameter: `{"layers.0.attn.
    qkv.base.weight": "layers.0.attn.qkv.weight", "layers.0.attn.qkv.lora_A.weight": None, ...}` (None: not
    in such a checkpoint). Names are without wrapper levels; other parameters keep their names, so they are
    not listed. For loading a base after LoRA was applied, as the sharded build must (`checkpoint.init_from`)."""
    out: dict[str, str | None] = {}
    for name, module in lora_modules(model):
        for p_name, _ in module.base.named_parameters():
            out[f"{name}.base.{p_name}"] = f"{name}.{p_name}"
        for adapter in ("lora_A", "lora_B"):
            for p_name, _ in getattr(module, adapter).named_parameters():
                out[f"{name}.{adapter}.{p_name}"] = None
    return out


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (what the optimizer and gradient clipping see)."""
    return [p for _, m in lora_modules(model) for p in (m.lora_A.weight, m.lora_B.weight)]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only, `{"layers.0.attn.qkv.lora_A.weight": tensor, ...}`, detached (no wrapper levels
    in the names). Under FSDP2 the values are this rank's DTensor shards (`.full_tensor()` gathers)."""
    out = {}
    for name, module in lora_modules(model):
        out[f"{name}.lora_A.weight"] = module.lora_A.weight.detach()
        out[f"{name}.lora_B.weight"] = module.lora_B.weight.detach()
    return out


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (`W += scale * B @ A`, computed in fp32, stored in the
    base's dtype) and put the plain `nn.Linear` back; the model then has its original parameter names.
    For unsharded, unwrapped models (e.g. exporting, or evaluating without the adapter's extra matmuls)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                w = child.base.weight
                delta = child.lora_B.weight.float() @ child.lora_A.weight.float()
                w.copy_((w.float() + child.scale * delta).to(w.dtype))
                setattr(module, child_name, child.base)
    return model


def _target_shape(cfg, target: str) -> tuple[int, int]:
    """(in, out) features of a block's Linear at `target`, from a decoder config (models/decoder.py)."""
    hd = cfg.head_dim
    if target == "attn.qkv":
        return cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    if target == "attn.proj":
        return cfg.n_heads * hd, cfg.dim
    if target == "ffn.fc1":
        return cfg.dim, 2 * cfg.ffn_dim
    if target == "ffn.fc2":
        return cfg.ffn_dim, cfg.dim
    raise ValueError(f"unknown LoRA target {target!r}: choose from attn.qkv, attn.proj, ffn.fc1, ffn.fc2")


def lora_param_count(cfg, rank: int, targets: Sequence[str] = DEFAULT_TARGETS) -> int:
    """Trainable parameters of `apply_lora(Llama(cfg), targets, rank)`, without building anything:
    `n_layers * sum(rank * (in + out))` over the targets (A is `[rank, in]`, B `[out, rank]`)."""
    return cfg.n_layers * sum(rank * sum(_target_shape(cfg, t)) for t in targets)
