"""LoRA (low-rank adapters, Hu et al. 2021) applied from outside the model, as parallelism is: the model
families stay free of it, and `apply_lora` swaps targeted `nn.Linear`s of every block `model.layers[i]`
for a `LoRALinear`:

    y = base(x) + (alpha / rank) * B(A(dropout(x)))

`A` `[rank, in]` is Kaiming-uniform (a = sqrt(5)) and `B` `[out, rank]` zero, PEFT's default, so the
adapted model starts equal to its base. Every parameter of the model is frozen; only the adapters train.
Names stay readable: `layers.0.attn.qkv.lora_A.weight`, `layers.0.attn.qkv.lora_B.weight`, and the base
weight under `layers.0.attn.qkv.base.weight`.

Targets "attn.q", "attn.k" and "attn.v" put separate adapters on the query, key and value parts of the fused
`attn.qkv` (`QKVLoRALinear`; names `layers.0.attn.qkv.lora_A.q.weight`, ...): what PEFT trains on a stock HF
Llama with `target_modules` q_proj, k_proj, v_proj (or the LoRA paper's q and v alone). The benchmark's
reference trains one adapter on the fused projection instead, "attn.qkv".

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


def _check_args(rank: int, dropout: float) -> None:
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")


def _adapter_pair(base: nn.Linear, rank: int, out_features: int) -> tuple[nn.Linear, nn.Linear]:
    """A `[rank, in]` and B `[out, rank]`, fp32, allocated on the base's device but not initialised. Built on
    meta with fresh empty weights assigned, so that nn.Linear's own init does not draw from the global RNG
    (the caller's seed would shift); `reset_parameters` fills them. Assigned, not `to_empty`: that swaps a
    fake tensor's parameters in place, which `ttt plan --simulate`'s fake tensors refuse."""
    device = base.weight.device

    def empty(in_features: int, out: int) -> nn.Linear:
        with torch.device("meta"):
            layer = nn.Linear(in_features, out, bias=False, dtype=torch.float32)
        layer.weight = nn.Parameter(torch.empty(out, in_features, dtype=torch.float32, device=device))
        return layer

    return empty(base.in_features, rank), empty(rank, out_features)


def _dropout(p: float) -> nn.Module:
    # PEFT applies dropout to the adapter's input only; the base sees x unchanged.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class _Adapted(nn.Module):
    """A frozen `nn.Linear` (`base`, a bias if any stays frozen there: PEFT's `bias="none"`) plus trainable
    low-rank adapters, each `(alpha / rank) * B @ A`. What `lora_modules` finds.

    The adapters are fp32 whatever the base's dtype: they are the optimizer's master weights, and under
    autocast (or FSDP2's `param_dtype`) they compute in bf16 like the base."""

    base: nn.Linear

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank

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

    def pairs(self) -> Iterator[tuple[str, nn.Linear, nn.Linear]]:
        """(name prefix inside this module, A, B) of each adapter, in initialisation order."""
        raise NotImplementedError

    def named_adapters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name inside this module, parameter) of every adapter weight: each adapter's A, then its B."""
        for suffix, lora_A, lora_B in self.pairs():
            yield f"lora_A{suffix}.weight", lora_A.weight
            yield f"lora_B{suffix}.weight", lora_B.weight

    def delta_weight(self) -> torch.Tensor:
        """The adapters' update of the base weight, `[out, in]` in fp32, scale included (`merge_lora`)."""
        raise NotImplementedError

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's init: each A Kaiming-uniform with a = sqrt(5) (bound 1 / sqrt(in)), each B zeros. On the
        meta device the draws are no-ops, unless a torch-function mode makes them (a pipeline rank draws and
        drops another stage's adapters so that its own draw the values of a one-process build)."""
        for _, lora_A, lora_B in self.pairs():
            nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(lora_B.weight)


class LoRALinear(_Adapted):
    """A frozen `nn.Linear` plus one trainable low-rank update `(alpha / rank) * B @ A`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        _check_args(rank, dropout)
        super().__init__(base, rank, alpha)
        self.lora_A, self.lora_B = _adapter_pair(base, rank, base.out_features)
        self.dropout = _dropout(dropout)
        self.reset_parameters()

    def pairs(self) -> Iterator[tuple[str, nn.Linear, nn.Linear]]:
        yield "", self.lora_A, self.lora_B

    def delta_weight(self) -> torch.Tensor:
        return self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same operation order as PEFT (scale applied to B's output), so fp32 results agree to rounding.
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    def extra_repr(self) -> str:
        p = self.dropout.p if isinstance(self.dropout, nn.Dropout) else 0.0
        return f"rank={self.rank}, alpha={self.alpha}, dropout={p}"


QKV_PARTS = {"attn.q": "q", "attn.k": "k", "attn.v": "v"}


class QKVLoRALinear(_Adapted):
    """A frozen fused qkv `nn.Linear` whose output rows are grouped per KV head (models/common/layers.py: KV group j
    holds its `group` query heads, then key head j, then value head j), with a separate adapter on each of
    `parts` ("q", "k", "v", or a subset): the adapters PEFT puts on HF's separate q_proj, k_proj and v_proj.

    Each adapter has its own dropout (PEFT draws one mask per module) and its B has HF's row order for its
    part (query heads in order, then their `head_dim` rows), so PEFT's weights copy over unchanged. The parts'
    updates are interleaved into the grouped layout by one concatenation; an absent part contributes zeros."""

    def __init__(
        self,
        base: nn.Linear,
        parts: Sequence[str],
        heads: tuple[int, int, int],
        rank: int,
        alpha: float,
        dropout: float,
    ):
        _check_args(rank, dropout)
        super().__init__(base, rank, alpha)
        n_kv, group, head_dim = heads
        if base.out_features != n_kv * (group + 2) * head_dim:
            raise ValueError(
                f"a qkv Linear of {base.out_features} outputs is not {n_kv} KV groups of {group} query, 1 "
                f"key and 1 value heads of {head_dim}"
            )
        self.heads = heads
        self.parts = tuple(p for p in "qkv" if p in parts)
        self.lora_A, self.lora_B, self.dropout = nn.ModuleDict(), nn.ModuleDict(), nn.ModuleDict()
        for p in self.parts:
            rows = n_kv * self._heads_of(p) * head_dim
            self.lora_A[p], self.lora_B[p] = _adapter_pair(base, rank, rows)
            self.dropout[p] = _dropout(dropout)
        self.reset_parameters()

    def _heads_of(self, part: str) -> int:
        """Heads per KV group of `part`."""
        return self.heads[1] if part == "q" else 1

    def pairs(self) -> Iterator[tuple[str, nn.Linear, nn.Linear]]:
        for p in self.parts:
            yield f".{p}", self.lora_A[p], self.lora_B[p]

    def _grouped(self, updates: dict[str, torch.Tensor], dim: int) -> torch.Tensor:
        """Per-part updates, each with its rows (HF's order: head, then `head_dim`) along `dim` -> one tensor
        with the fused projection's rows along `dim`, in the grouped order. `dim` >= 0."""
        n_kv, _, head_dim = self.heads
        ref = next(iter(updates.values()))
        chunks = []
        for p in "qkv":
            shape = (*ref.shape[:dim], n_kv, self._heads_of(p), head_dim, *ref.shape[dim + 1 :])
            chunks.append(updates[p].view(shape) if p in updates else ref.new_zeros(shape))
        out = torch.cat(chunks, dim=dim + 1)
        return out.reshape(*ref.shape[:dim], -1, *ref.shape[dim + 1 :])

    def delta_weight(self) -> torch.Tensor:
        updates = {
            p: self.scale * (self.lora_B[p].weight.float() @ self.lora_A[p].weight.float())
            for p in self.parts
        }
        return self._grouped(updates, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        updates = {p: self.lora_B[p](self.lora_A[p](self.dropout[p](x))) * self.scale for p in self.parts}
        return self.base(x) + self._grouped(updates, x.dim() - 1)

    def extra_repr(self) -> str:
        d = next(iter(self.dropout.values()))
        p = d.p if isinstance(d, nn.Dropout) else 0.0
        return f"parts={''.join(self.parts)}, rank={self.rank}, alpha={self.alpha}, dropout={p}"


def is_adapted(module: nn.Module) -> bool:
    """Whether `module` is a LoRA-wrapped Linear (`LoRALinear`, `QKVLoRALinear`): a tensor-parallel plan
    places its adapters (models/common/lora_parallel.py) instead of cutting it as an `nn.Linear`."""
    return isinstance(module, _Adapted)


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_LEVELS)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, _Adapted]]:
    """(name without wrapper levels, module) of every adapted Linear (`LoRALinear`, `QKVLoRALinear`) in
    `model`, in registration order."""
    for name, module in model.named_modules():
        if isinstance(module, _Adapted):
            yield _clean(name), module


def _site(block: nn.Module, i: int, target: str) -> tuple[nn.Module, str]:
    """(parent module, attribute) of the `nn.Linear` a target names in block `i`, checked."""
    parent_path, _, attr = target.rpartition(".")
    try:
        parent = block.get_submodule(parent_path) if parent_path else block
    except AttributeError:
        raise ValueError(
            f"layers.{i} has no submodule {parent_path!r} for LoRA target {target!r}; apply LoRA "
            "before activation checkpointing or compile wrap the blocks"
        ) from None
    base = getattr(parent, attr, None)
    if isinstance(base, _Adapted):
        raise ValueError(f"layers.{i}.{target} already has a LoRA adapter")
    if not isinstance(base, nn.Linear):
        raise ValueError(f"LoRA target layers.{i}.{target} is {type(base).__name__}, not an nn.Linear")
    return parent, attr


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
    "attn.q", "attn.k" and "attn.v" (any of them) instead wrap the block's fused `attn.qkv` in one
    `QKVLoRALinear` with an adapter per part; they exclude "attn.qkv".

    `generator` draws the A matrices (layer by layer, targets in the order given, q/k/v at the place of the
    first of them; B is zero).
    `base_dtype` (e.g. torch.bfloat16) casts the frozen weight matrices and the embedding (every frozen
    parameter of 2+ dims) to halve the base's memory; norm weights keep their dtype, as the reference keeps
    norms in fp32, and the adapters stay fp32. A bf16 base is meant for bf16 autocast or FSDP2's bf16
    `param_dtype`. Call before activation checkpointing, compile and sharding (see the module docstring).
    """
    if not isinstance(getattr(model, "layers", None), nn.ModuleList):
        raise ValueError("apply_lora expects a model exposing its blocks as model.layers (an nn.ModuleList)")
    parts = [QKV_PARTS[t] for t in targets if t in QKV_PARTS]
    if parts and "attn.qkv" in targets:
        raise ValueError(
            "LoRA targets attn.q/k/v are parts of attn.qkv: target either the parts or the whole"
        )
    if len(set(targets)) != len(targets):
        raise ValueError(f"LoRA targets {tuple(targets)} name a Linear twice")
    # (parent module, attribute, (n_kv_heads, group, head_dim) for a per-part qkv wrapper or None), all
    # checked before anything changes
    sites = []
    for i, block in enumerate(model.layers):
        for target in targets:
            heads = None
            if target in QKV_PARTS:
                if QKV_PARTS[target] != parts[0]:
                    continue  # one wrapper for all the parts, at the place of the first
                parent, attr = _site(block, i, "attn.qkv")
                heads = tuple(getattr(parent, a, None) for a in ("n_kv_heads", "group", "head_dim"))
                if None in heads:
                    raise ValueError(
                        f"LoRA targets attn.q/k/v need layers.{i}.attn to be our fused attention "
                        "(models/common/layers.py: n_kv_heads, group, head_dim)"
                    )
            else:
                parent, attr = _site(block, i, target)
            sites.append((parent, attr, heads))
    for p in model.parameters():
        p.requires_grad_(False)
    if base_dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2 and p.is_floating_point():
                    p.data = p.data.to(base_dtype)  # in place of the Parameter, as nn.Module.to does
    for parent, attr, heads in sites:
        base = getattr(parent, attr)
        if heads is None:
            wrapped = LoRALinear(base, rank, alpha, dropout)
        else:
            wrapped = QKVLoRALinear(base, parts, heads, rank, alpha, dropout)
        setattr(parent, attr, wrapped)
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
        for p_name, _ in module.named_adapters():
            out[f"{name}.{p_name}"] = None
    return out


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (what the optimizer and gradient clipping see)."""
    return [p for _, m in lora_modules(model) for _, p in m.named_adapters()]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only, `{"layers.0.attn.qkv.lora_A.weight": tensor, ...}`, detached (no wrapper levels
    in the names). Under FSDP2 the values are this rank's DTensor shards (`.full_tensor()` gathers)."""
    return {f"{name}.{n}": p.detach() for name, m in lora_modules(model) for n, p in m.named_adapters()}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (`W += scale * B @ A`, computed in fp32, stored in the
    base's dtype) and put the plain `nn.Linear` back; the model then has its original parameter names.
    For unsharded, unwrapped models (e.g. exporting, or evaluating without the adapter's extra matmuls)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _Adapted):
                w = child.base.weight
                w.copy_((w.float() + child.delta_weight()).to(w.dtype))
                setattr(module, child_name, child.base)
    return model


def _target_shape(cfg, target: str) -> tuple[int, int]:
    """(in, out) features of a block's Linear at `target`, from a decoder config (models/common/decoder.py)."""
    hd = cfg.head_dim
    if target == "attn.qkv":
        return cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    if target == "attn.q":
        return cfg.dim, cfg.n_heads * hd
    if target in ("attn.k", "attn.v"):
        return cfg.dim, cfg.n_kv_heads * hd
    if target == "attn.proj":
        return cfg.n_heads * hd, cfg.dim
    if target == "ffn.fc1":
        return cfg.dim, 2 * cfg.ffn_dim
    if target == "ffn.fc2":
        return cfg.ffn_dim, cfg.dim
    raise ValueError(
        f"unknown LoRA target {target!r}: choose from attn.qkv (or attn.q, attn.k, attn.v), attn.proj, "
        "ffn.fc1, ffn.fc2"
    )


def lora_param_count(cfg, rank: int, targets: Sequence[str] = DEFAULT_TARGETS) -> int:
    """Trainable parameters of `apply_lora(Llama(cfg), targets, rank)`, without building anything:
    `n_layers * sum(rank * (in + out))` over the targets (A is `[rank, in]`, B `[out, rank]`)."""
    return cfg.n_layers * sum(rank * sum(_target_shape(cfg, t)) for t in targets)
