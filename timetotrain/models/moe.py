"""GPT-OSS-20B-shaped mixture-of-experts decoder (the MLPerf `gpt_oss_20b` model, spec §7.1).

This is the Megatron/Primus reference configuration, not Hugging Face's GPT-OSS: Llama 3.1 vocabulary, plain
RoPE (theta 150k, no YaRN), no biases, no attention sinks, no shared expert, a plain SwiGLU (no clamp),
RMSNorm on per-head Q and K, and a router that takes the top-k logits and softmaxes over those k only.

Block: RMSNorm -> GQA attention (QK-norm, RoPE, causal; every other layer a 128-token sliding window) ->
residual, RMSNorm -> MoE (router + top-k of E SwiGLU experts, dropless) -> residual. Final RMSNorm, untied
head.

Readings of the reference that are not spelled out in the spec table:

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

MoE dispatch is split into steps that expert parallelism can later separate with all-to-alls:
`Router` (route) -> `permute` (group token copies by expert, per-expert counts) -> `GroupedExperts`
(compute on the contiguous grouped layout) -> `unpermute` (back to token order, sum the k slots). Expert
weights are stacked `[n_experts, ...]` so they can be sharded along dim 0.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.models.fused import swiglu
from timetotrain.models.head_loss import logits_or_loss
from timetotrain.models.llama import RMSNorm, apply_rope, rope_tables


@dataclass
class MoEConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    # Explicit: the reference has 64 heads of 64 on a 2880-wide model (Q projection 2880 -> 4096).
    head_dim: int
    n_experts: int
    top_k: int
    expert_ffn_dim: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float = 1e-6
    rope_theta: float = 150_000.0
    sliding_window: int = 128
    # Megatron `window_attn_skip_freq` list semantics (1 = windowed), applied cyclically from layer 0.
    window_pattern: tuple[int, ...] = (1, 0)
    qk_norm: bool = True
    init_std: float = 0.008

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, n_experts={self.n_experts}]")
        if not self.window_pattern:
            raise ValueError("window_pattern must not be empty")
        self.window_pattern = tuple(int(bool(w)) for w in self.window_pattern)

    @property
    def rope_scaling(self) -> None:
        # Plain RoPE (spec §7.1); lets `llama.rope_tables` build our tables unchanged.
        return None

    def is_window_layer(self, layer: int) -> bool:
        """Whether 0-indexed `layer` uses the sliding window."""
        return bool(self.window_pattern[layer % len(self.window_pattern)])


GPT_OSS_20B = MoEConfig(
    dim=2880,
    n_layers=24,
    n_heads=64,
    n_kv_heads=8,
    head_dim=64,
    n_experts=32,
    top_k=4,
    expert_ffn_dim=2880,
    vocab_size=128_256,
    max_seq_len=8192,
    norm_eps=1e-6,
    rope_theta=150_000.0,
    sliding_window=128,
    window_pattern=(1, 0),
    qk_norm=True,
    init_std=0.008,
)


# --- attention ---------------------------------------------------------------------------------------------


def sliding_window_mask(seq_len: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean `[T, T]` SDPA mask, True = attend: the band `i - window <= j <= i` (Megatron `(window, 0)`)."""
    i = torch.arange(seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)
    return (j <= i) & (j >= i - window)


class Attention(nn.Module):
    """GQA with the fused QKV layout of `llama.Attention` (rows per KV head: g queries, key, value)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.qkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`mask` None: full causal attention; else a boolean `[T, T]` mask (True = attend)."""
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_kv_heads, self.group + 2, self.head_dim)
        q, k, v = qkv.split([self.group, 1, 1], dim=3)
        q, k, v = q.reshape(B, T, self.n_heads, self.head_dim), k.squeeze(3), v.squeeze(3)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            # Repeat KV rather than `enable_gqa`: on CUDA the memory-efficient kernel takes an arbitrary mask
            # but not GQA; SDPA would otherwise fall back to the math kernel and materialise B*H*T*T scores.
            k = k.repeat_interleave(self.group, dim=1)
            v = v.repeat_interleave(self.group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


# --- MoE: route -> permute -> expert compute -> unpermute ---------------------------------------------------


class Router(nn.Module):
    """Linear `dim -> n_experts` (no bias) in fp32; top-k over the logits, then softmax over those k."""

    def __init__(self, dim: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # A bare Parameter, not nn.Linear: module-swapping tools (float8 training, TP plans) target nn.Linear,
        # and the router must stay a full-precision matmul (Megatron `moe_router_dtype: fp32`).
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[N, dim]` -> (probs `[N, k]` fp32 (fp64 for fp64 inputs), expert ids `[N, k]` int64)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        # Autocast would run the linear in bf16; near-tied logits would then pick different experts.
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
        top_logits, experts = logits.topk(self.top_k, dim=-1)
        # `moe_router_pre_softmax: false`: the k selected weights sum to 1; scaling factor 1.0.
        return top_logits.softmax(dim=-1), experts


def permute(
    x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the `N * k` (token, slot) copies by expert.

    Returns (tokens `[N*k, dim]` ordered by expert, their probs `[N*k]`, counts `[n_experts]` int64,
    order `[N*k]`: position p holds the flat (token * k + slot) index of grouped row p). Within an expert the
    copies keep token order (stable sort), as Megatron's permutation does. No host synchronisation.
    """
    n, k = experts.shape
    sorted_experts, order = torch.sort(experts.reshape(-1), stable=True)
    # Replicate by expand + reshape (backward: a fixed-order sum over the k copies) instead of indexing with
    # repeated token ids, whose backward accumulates with atomics on GPUs.
    replicated = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, x.shape[-1])
    grouped = replicated.index_select(0, order)
    grouped_probs = probs.reshape(-1).index_select(0, order)
    # Counts from the sorted ids: `bincount` would sync with the host on CUDA to size its output.
    ends = torch.searchsorted(sorted_experts, torch.arange(n_experts, device=x.device), right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return grouped, grouped_probs, counts, order


def unpermute(y: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Inverse of `permute` for the expert outputs `[N*k, dim]` -> `[N, dim]` (sum over the k slots)."""
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    # Gather back to (token, slot) order and sum the slots in a fixed order: a scatter-add combine would add
    # in atomic order on GPUs and make runs non-reproducible.
    return y.index_select(0, inverse).view(-1, top_k, y.shape[-1]).sum(dim=1)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: `_grouped_mm`'s backward rejects the stride-0
    gradients that e.g. `.sum()` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _swiglu(h: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    a = swiglu(h)  # silu(gate) * up with a copy-free backward
    if probs is None:
        return a
    # Megatron's `activation_func_with_probs`: weight in the probs' dtype (fp32), round back once.
    return (a * probs.unsqueeze(-1)).to(a.dtype)


def _experts_grouped_mm(x, counts, w1, w2, probs):
    if torch.is_autocast_enabled(x.device.type):
        # `_grouped_mm` is not an autocast op; cast as autocast would cast a linear.
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    offsets = counts.cumsum(0).to(torch.int32)
    h = _ContiguousGrad.apply(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    a = _swiglu(h, probs)
    return _ContiguousGrad.apply(torch._grouped_mm(a, w2.transpose(-2, -1), offs=offsets))


def _experts_loop(x, counts, w1, w2, probs):
    # One matmul pair per expert over its contiguous slice; `tolist` is the only host sync of the MoE layer.
    sizes = counts.tolist()
    xs = x.split(sizes)
    ps = probs.split(sizes) if probs is not None else [None] * len(sizes)
    outs = [
        F.linear(_swiglu(F.linear(xe, w1[e]), ps[e]), w2[e]) for e, xe in enumerate(xs) if xe.shape[0] > 0
    ]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype, dim: int, ffn_dim: int) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward correctly here (probed once per key).

    Support differs by build and device (CUDA builds have wanted sm90+, bf16 and 16-byte-aligned rows; this
    CPU build takes fp32/bf16 but not fp64), so probing beats encoding the rules. The probe forces grad mode:
    a first call from an eval under `no_grad`/`inference_mode` must not cache a spurious False.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with (
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autocast(device_type=device.type, enabled=False),
        ):
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(4, dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
            w1 = torch.randn(3, 2 * ffn_dim, dim, device=device, dtype=dtype, generator=gen)
            w2 = torch.randn(3, dim, ffn_dim, device=device, dtype=dtype, generator=gen)
            w1.requires_grad_(True)
            w2.requires_grad_(True)
            counts = torch.tensor([1, 0, 3], device=device)  # an empty group on purpose
            out = _experts_grouped_mm(x, counts, w1, w2, None)
            out.backward(torch.ones_like(out))
            ref = _experts_loop(x.detach(), counts, w1.detach(), w2.detach(), None)
            tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
            ok = torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
            return bool(ok and w1.grad[1].abs().max().item() == 0)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU FFNs, stacked: `w1` `[E, 2*ffn, dim]` (gate rows, then up), `w2` `[E, dim, ffn]`.

    `forward(tokens grouped by expert, counts per expert, probs)`: the layout an expert-parallel all-to-all
    produces, so this module can run on a shard of experts unchanged.
    """

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        # None: use `torch._grouped_mm` when the probe says it works for this device/dtype; True/False forces.
        self.use_grouped_mm: bool | None = None

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        use = self.use_grouped_mm
        if use is None:
            dtype = (
                torch.get_autocast_dtype(x.device.type)
                if torch.is_autocast_enabled(x.device.type)
                else x.dtype
            )
            use = grouped_mm_supported(x.device, dtype, self.w1.shape[2], self.w2.shape[2])
        fn = _experts_grouped_mm if use else _experts_loop
        return fn(x, counts, self.w1, self.w2, probs)


class MoE(nn.Module):
    """Dropless top-k MoE layer; `tokens_per_expert` holds the last forward's counts (on device, no sync)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.top_k
        self.router = Router(cfg.dim, cfg.n_experts, cfg.top_k)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
        # Telemetry for the training loop to read at eval time; not a checkpointed state.
        self.register_buffer(
            "tokens_per_expert", torch.zeros(cfg.n_experts, dtype=torch.long), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, experts = self.router(x)
        grouped, grouped_probs, counts, order = permute(x, experts, probs, self.n_experts)
        with torch.no_grad():
            self.tokens_per_expert.copy_(counts)
        y = self.experts(grouped, counts, grouped_probs)
        return unpermute(y, order, self.top_k).view(shape)


# --- model -------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, sliding: bool):
        super().__init__()
        self.sliding = sliding
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return h + self.moe(self.ffn_norm(h))


class GptOss(nn.Module):
    """Built initialised (`init_weights` with the global RNG); on the meta device nothing is computed."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, cfg.is_window_layer(i)) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        # One mask per (length, device), shared by all windowed layers and kept across steps.
        self._window_masks: dict[tuple[int, torch.device], torch.Tensor] = {}
        init_weights(self)

    def reset_rope(self) -> None:
        """Fill the RoPE tables; needed after `to_empty` when weights are loaded instead of initialised."""
        if self.rope_cos.is_meta:
            return
        cos, sin = rope_tables(self.cfg)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def window_mask(self, seq_len: int, device: torch.device) -> torch.Tensor:
        key = (seq_len, device)
        if key not in self._window_masks:
            self._window_masks[key] = sliding_window_mask(seq_len, self.cfg.sliding_window, device)
        return self._window_masks[key]

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states `[B, T, dim]`; lets a loss apply the head in chunks."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos = self.rope_cos[:T].unsqueeze(1)
        sin = self.rope_sin[:T].unsqueeze(1)
        # Up to window + 1 tokens the band is the whole causal triangle: no mask, the causal kernel.
        mask = self.window_mask(T, tokens.device) if T > self.cfg.sliding_window + 1 else None
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, cos, sin, mask if block.sliding else None)
        return self.norm(x)

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """`tokens` `[B, T]` (int64) -> logits `[B, T, vocab_size]`; with `labels` `[B, T]` (-100 = ignored)
        -> their token cross-entropy instead, computed by `head_loss` without materialising the logits."""
        return logits_or_loss(self.hidden(tokens), self.head, labels, reduction)

    def tokens_per_expert(self) -> torch.Tensor:
        """`[n_layers, n_experts]` token copies routed to each expert in the last forward (on device)."""
        return torch.stack([block.moe.tokens_per_expert for block in self.layers])


@torch.no_grad()
def init_weights(model: GptOss, generator: torch.Generator | None = None) -> None:
    """Megatron initialisation with `init_method_std` (spec §7.1), in place; also (re)computes RoPE tables.

    N(0, std) for the embedding, QKV, router, expert w1 and LM head; N(0, std / sqrt(2 * n_layers)) for the
    projections that write into the residual stream (attention output, expert w2); norm weights 1.
    Works on a model built on the meta device after `to_empty(device=...)`.
    """
    cfg = model.cfg
    std = cfg.init_std
    residual_std = std / math.sqrt(2 * cfg.n_layers)

    def normal(t: torch.Tensor, s: float) -> None:
        nn.init.normal_(t, mean=0.0, std=s, generator=generator)

    normal(model.embed.weight, std)
    for block in model.layers:
        normal(block.attn.qkv.weight, std)
        normal(block.attn.proj.weight, residual_std)
        normal(block.moe.router.weight, std)
        normal(block.moe.experts.w1, std)
        normal(block.moe.experts.w2, residual_std)
        for norm in (block.attn_norm, block.ffn_norm, block.attn.q_norm, block.attn.k_norm):
            if norm is not None:
                nn.init.ones_(norm.weight)
        block.moe.tokens_per_expert.zero_()
    nn.init.ones_(model.norm.weight)
    normal(model.head.weight, std)
    model.reset_rope()


# --- sizes and FLOPs ---------------------------------------------------------------------------------------


def _layer_matmul_params(cfg: MoEConfig, experts: int) -> int:
    qkv = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    proj = cfg.n_heads * cfg.head_dim * cfg.dim
    router = cfg.dim * cfg.n_experts
    return qkv + proj + router + experts * 3 * cfg.dim * cfg.expert_ffn_dim


def _norm_params(cfg: MoEConfig) -> int:
    per_layer = 2 * cfg.dim + (2 * cfg.head_dim if cfg.qk_norm else 0)
    return cfg.n_layers * per_layer + cfg.dim


def param_count(cfg: MoEConfig) -> int:
    """All trainable parameters: embedding + head + per layer (attention, router, all experts, norms)."""
    layers = cfg.n_layers * _layer_matmul_params(cfg, cfg.n_experts)
    return layers + 2 * cfg.vocab_size * cfg.dim + _norm_params(cfg)


def active_param_count(cfg: MoEConfig) -> int:
    """Parameters one token touches: as `param_count` but `top_k` experts per layer instead of all."""
    layers = cfg.n_layers * _layer_matmul_params(cfg, cfg.top_k)
    return layers + 2 * cfg.vocab_size * cfg.dim + _norm_params(cfg)


def flops_per_token(cfg: MoEConfig, seq_len: int, causal: bool = True) -> float:
    """Training (forward + backward) FLOPs per token over the ACTIVE weights, as `llama.flops_per_token`.

    6 * (attention, router, `top_k` experts per layer, LM head matmul weights) + attention scores/weighted sum
    at 12 * H * hd FLOPs per (query, key) pair a layer computes, averaged per query:
    - full layers: `T` keys over the full square, or `T / 2` with `causal` (the llama convention);
    - window layers (W = `sliding_window`): only the band a windowed kernel computes: `min(W, T)` keys, or
      with `causal` the band's area per query, `W - W^2 / (2T)` for `T > W` (else `T / 2`, the full triangle).
    Router softmax/top-k, permutation, norms, RoPE and element-wise work are left out.
    """
    T, W = seq_len, cfg.sliding_window
    if causal:
        full_keys = T / 2
        window_keys = W - W * W / (2 * T) if T > W else T / 2
    else:
        full_keys = T
        window_keys = min(W, T)
    n_window = sum(cfg.is_window_layer(i) for i in range(cfg.n_layers))
    keys = (cfg.n_layers - n_window) * full_keys + n_window * window_keys
    matmul = cfg.n_layers * _layer_matmul_params(cfg, cfg.top_k) + cfg.dim * cfg.vocab_size
    return 6 * matmul + 12 * cfg.n_heads * cfg.head_dim * keys
