"""DeepSeek-V3 (the MLPerf `deepseekv3_671b` model, docs/benchmarks/deepseekv3_671b.md).

Block: RMSNorm -> Multi-head Latent Attention -> residual, RMSNorm -> FFN -> residual; final RMSNorm and an
untied head, the shared decoder stack (`common/decoder.py`). The first `first_dense` layers have a dense SwiGLU FFN,
the others a mixture of experts (`common/moe/`): a group-limited sigmoid router with an auxiliary-loss-free
balancing bias (`moe.GroupLimitedRouter`), `n_experts` routed SwiGLU experts of which `top_k` are used,
plus `n_shared_experts` shared ones every token goes through (one SwiGLU of `n_shared * expert_ffn_dim`).

Multi-head Latent Attention (DeepSeek-V2/V3): queries through a low-rank bottleneck
(`q_down` d -> q_lora, RMSNorm, `q_up` -> H x (nope + rope)); keys and values from one compressed latent
(`kv_down` d -> kv_lora + rope; RMSNorm on the kv_lora part; `kv_up` -> H x (nope + v)). The last `rope`
dimensions of `kv_down` are ONE rotary key shared by all heads. Query/key heads are `nope + rope` wide,
value heads `v`. RoPE is YaRN-scaled and the softmax scale is `(nope + rope) ** -0.5` times the squared
YaRN mscale (`layers.YarnScaling`).

Rotary layout: DeepSeek's checkpoints rotate interleaved pairs `(x0, x1), (x2, x3), ...` of the rope
dimensions; ours, like every decoder here, rotates the two halves. The HF loader (`hf.py`)
permutes the rope rows of `q_up` and `kv_down` (evens first, then odds) so the same pairs rotate together:
the rotated vectors then equal HF's exactly (HF's interleaved RoPE also returns evens-then-odds).

Multi-token prediction (MTP, DeepSeek-V3 §2.2), `mtp_layers` sequential modules; module k (1-based) at
position i combines the previous depth's output `h_{k-1}` with the embedding of token i+k and predicts
token i+k+1:

    h_0    = norm(trunk output)                          (what the LM head sees)
    h_k    = norm_k( Block_k( eh_proj( cat[ enorm(embed(t_{i+k})), hnorm(h_{k-1}) ] ) ) )
    loss_k = CE( head(h_k), t_{i+k+1} )                  (positions without a target are ignored)

with the embedding and the output head shared with the main model. As megatron-core does it: with MTP its
decoder applies the final norm in its last layer, so the MTP module receives the NORMED hidden states (and
normalises them again with `hnorm`); each depth's output passes its own final norm (`shared_head.norm`)
before both the head and the next depth; the embedding comes first in the concatenation
(`_concat_embeddings`, and the HF checkpoint's `eh_proj`). In training the loss is
`LM + mtp_weight / mtp_layers * sum_k loss_k + sum over MoE layers of their sequence aux losses`; in eval
mode (the benchmark's metric) it is the LM loss alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.models.common.decoder import Block, Decoder
from timetotrain.models.common.layers import RMSNORM_SAVED, FeedForward, RMSNorm, apply_rope
from timetotrain.models.common.moe import GroupLimitedRouter, MoE
from timetotrain.models.common.moe.telemetry import expert_load
from timetotrain.models.common.sequence_shard import (
    SequenceShard,
    ShardAttention,
    check_length,
    head_loss,
    labelled,
    rope_at,
)
from timetotrain.models.deepseek_v3.config import DeepSeekV3Config
from timetotrain.models.deepseek_v3.hf import hf_export, hf_mapping
from timetotrain.models.deepseek_v3.parallelize import check_shape, tensor_parallel
from timetotrain.models.family import ModelFamily


class LatentAttention(nn.Module):
    """Causal Multi-head Latent Attention (module docstring), no biases."""

    def __init__(self, cfg: DeepSeekV3Config):
        super().__init__()
        self.n_heads, self.nope, self.rope, self.v_dim = (
            cfg.n_heads,
            cfg.qk_nope_dim,
            cfg.qk_rope_dim,
            cfg.v_head_dim,
        )
        self.kv_lora = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale()
        q_out = cfg.n_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_down, self.q_norm = None, None
            self.q_up = nn.Linear(cfg.dim, q_out, bias=False)
        else:
            self.q_down = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_up = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_down = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.kv_up = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_dim + cfg.v_head_dim), bias=False)
        self.proj = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.n_heads
        q_in = x if self.q_down is None else self.q_norm(self.q_down(x))
        q_nope, q_rope = (
            self.q_up(q_in).view(B, T, H, self.nope + self.rope).split([self.nope, self.rope], -1)
        )
        latent, k_rope = self.kv_down(x).split([self.kv_lora, self.rope], dim=-1)
        k_nope, v = (
            self.kv_up(self.kv_norm(latent))
            .view(B, T, H, self.nope + self.v_dim)
            .split([self.nope, self.v_dim], dim=-1)
        )
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin)  # one rotary key for all heads
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)
        k = torch.cat((k_nope, k_rope.expand(B, T, H, self.rope)), dim=-1).transpose(1, 2)
        if isinstance(mask, ShardAttention):  # context parallelism: against the whole sequence's keys
            out = mask(q, k, v.transpose(1, 2), scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=self.scale)
        return self.proj(out.transpose(1, 2).reshape(B, T, H * self.v_dim))

    def init_weights(self, normal, std: float, residual_std: float) -> None:
        for lin in (self.q_down, self.q_up, self.kv_down, self.kv_up):
            if lin is not None:
                normal(lin.weight, std)
        normal(self.proj.weight, residual_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                nn.init.ones_(norm.weight)


def make_ffn(cfg: DeepSeekV3Config, layer: int) -> nn.Module:
    if not cfg.is_moe(layer):
        return FeedForward(cfg.dim, cfg.ffn_dim)
    router = GroupLimitedRouter(
        cfg.dim, cfg.n_experts, cfg.top_k, cfg.n_groups, cfg.topk_groups, cfg.routed_scaling,
        bias_rate=cfg.bias_rate, aux_coeff=cfg.aux_loss_coeff,
    )  # fmt: skip
    shared = FeedForward(cfg.dim, cfg.n_shared_experts * cfg.expert_ffn_dim) if cfg.n_shared_experts else None
    return MoE(router, cfg.n_experts, cfg.top_k, cfg.dim, cfg.expert_ffn_dim, shared=shared)


class MultiTokenPrediction(nn.Module):
    """One MTP depth (module docstring); the embedding and output head are the main model's."""

    def __init__(self, cfg: DeepSeekV3Config, layer: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg.dim, cfg.norm_eps, LatentAttention(cfg), make_ffn(cfg, layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h: torch.Tensor, next_embed: torch.Tensor, cos, sin, mask=None) -> torch.Tensor:
        """The depth's normed output: what the head sees and the next depth's `h`."""
        x = self.eh_proj(torch.cat((self.enorm(next_embed), self.hnorm(h)), dim=-1))
        return self.norm(self.block(x, cos, sin, mask))

    def init_weights(self, normal, std: float, residual_std: float) -> None:
        normal(self.eh_proj.weight, std)
        self.block.init_weights(normal, std, residual_std)
        for norm in (self.enorm, self.hnorm, self.norm):
            nn.init.ones_(norm.weight)


def _shift(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """`t` `[B, T]` moved k positions left, the last k positions `fill`."""
    return torch.cat((t[:, k:], t.new_full((t.shape[0], k), fill)), dim=1)


class DeepSeekV3(Decoder):
    def __init__(self, cfg: DeepSeekV3Config):
        super().__init__(
            cfg, lambda layer: make_ffn(cfg, layer), make_attn=lambda layer: LatentAttention(cfg)
        )
        self.mtp = nn.ModuleList([MultiTokenPrediction(cfg, cfg.n_layers + k) for k in range(cfg.mtp_layers)])
        self.init_weights()  # again, now with the MTP modules (Decoder.__init__ ran before they existed)

    def routers(self) -> list[GroupLimitedRouter]:
        """Every MoE layer's router, main layers first, then the MTP blocks'."""
        blocks = list(self.layers) + [m.block for m in self.mtp]
        return [b.ffn.router for b in blocks if isinstance(b.ffn, MoE)]

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in list(self.layers) + [m.block for m in self.mtp] if isinstance(b.ffn, MoE)]

    def trunk(
        self, tokens: torch.Tensor, shard: SequenceShard | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden states before the final norm `[B, T, dim]`, cos, sin) of the main layers; under a `shard`
        (`sequence_shard.py`) `tokens` are the whole sequences and all three this part's."""
        check_length(tokens, self.cfg.max_seq_len)
        tokens, cos, sin = rope_at(self.rope_cos, self.rope_sin, tokens, shard)
        mask = None if shard is None else shard.attend(None)
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, cos, sin, mask)
        return x, cos, sin

    def hidden(self, tokens: torch.Tensor, shard: SequenceShard | None = None) -> torch.Tensor:
        return self.norm(self.trunk(tokens, shard)[0])

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        reduction: str = "mean",
        shard: SequenceShard | None = None,
    ) -> torch.Tensor:
        """As `Decoder.forward`; in training mode with `labels` the loss also carries the MTP and aux terms.
        Under a `shard`, this part's share of each (`sequence_shard.py`; the routers' aux loss is a share
        where context parallelism set their `sequence_sum`)."""
        h, cos, sin = self.trunk(tokens, shard)
        h = self.norm(h)
        out = head_loss(h, self.head, labels, reduction, shard)
        if labels is None or not self.training:
            return out
        extra = self.mtp_loss(tokens, labels, h, cos, sin, reduction, shard)
        aux = [r.aux_loss for r in self.routers() if r.aux_loss is not None]
        if aux:
            total = torch.stack(aux).sum()
            # The aux loss is a per-token mean already; a summed loss scales it by the labelled tokens.
            extra = extra + (total if reduction == "mean" else total * labelled(labels))
        return out + extra

    def mtp_inputs(self, tokens: torch.Tensor, shard: SequenceShard | None = None) -> list[torch.Tensor]:
        """The embedding of the tokens k ahead, for each MTP depth k = 1..D. Under a `shard` the whole
        sequences are shifted, then this part kept: position i reads token i + k wherever the part ends.
        (A pipeline computes them on its first stage, where the embedding is: train/pipeline_moe.py.)"""
        # Causal attention: the wrapped-around last k positions only see themselves and have no target.
        ahead = [_shift(tokens, k, 0) for k in range(1, len(self.mtp) + 1)]
        return [self.embed(a if shard is None else shard.local(a)) for a in ahead]

    def mtp_loss(
        self, tokens, labels, h, cos, sin, reduction: str = "mean", shard=None, inputs=None
    ) -> torch.Tensor:
        """`mtp_loss_weight / D * sum_k loss_k` over the D MTP depths (module docstring); 0 without MTP.
        `inputs`: `mtp_inputs(tokens, shard)` where already computed."""
        if not len(self.mtp):
            return h.new_zeros(())
        losses = []
        mask = None if shard is None else shard.attend(None)
        inputs = self.mtp_inputs(tokens, shard) if inputs is None else inputs
        for k, (module, ahead) in enumerate(zip(self.mtp, inputs, strict=True), start=1):
            h = module(h, ahead, cos, sin, mask)
            losses.append(head_loss(h, self.head, _shift(labels, k, -100), reduction, shard))
        return self.cfg.mtp_loss_weight / len(self.mtp) * torch.stack(losses).sum()

    def update_router_bias(self, reduce=None) -> None:
        """The auxiliary-loss-free balancing step, once per optimizer step: each router's bias moves towards
        balance by its selections since the last call. `reduce(tensor)`, in place, sums them over the
        data-parallel ranks (the harness passes an all-reduce); the model itself knows no process groups."""
        routers = self.routers()
        if not routers:
            return
        loads = torch.stack([r.load for r in routers])
        if reduce is not None:
            reduce(loads)
        for router, load in zip(routers, loads, strict=True):
            router.update_bias(load)

    def tokens_per_expert(self) -> torch.Tensor:
        """`[MoE layers, n_experts]` token copies routed to each expert in the last forward (on device)."""
        return torch.stack([m.tokens_per_expert for m in self.moe_layers()])

    def router_biases(self) -> torch.Tensor:
        """`[MoE layers, n_experts]` each router's balancing bias."""
        return torch.stack([r.bias for r in self.routers()])

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        super().init_weights(generator)
        if "mtp" not in self._modules:  # called from Decoder.__init__, before the MTP modules exist
            return
        std = self.cfg.init_std
        residual_std = std / (2 * self.cfg.n_layers) ** 0.5

        def normal(t: torch.Tensor, s: float) -> None:
            nn.init.normal_(t, mean=0.0, std=s, generator=generator)

        for module in self.mtp:
            module.init_weights(normal, std, residual_std)


def init_weights(model: DeepSeekV3, generator: torch.Generator | None = None) -> None:
    """Megatron initialisation with `init_method_std` (σ, σ/√(2L) on the residual-output projections);
    routing biases 0."""
    model.init_weights(generator)


# ---- sizes and FLOPs ----


def _attention_params(cfg: DeepSeekV3Config) -> int:
    q = (
        cfg.dim * cfg.n_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None
        else cfg.dim * cfg.q_lora_rank + cfg.q_lora_rank * cfg.n_heads * cfg.qk_head_dim
    )
    kv = cfg.dim * (cfg.kv_lora_rank + cfg.qk_rope_dim) + cfg.kv_lora_rank * cfg.n_heads * (
        cfg.qk_nope_dim + cfg.v_head_dim
    )
    return q + kv + cfg.n_heads * cfg.v_head_dim * cfg.dim


def _ffn_params(cfg: DeepSeekV3Config, layer: int, experts: int) -> int:
    """Matmul weights of layer `layer`'s FFN counting `experts` routed experts (all, or top_k)."""
    if not cfg.is_moe(layer):
        return 3 * cfg.dim * cfg.ffn_dim
    routed_and_shared = (experts + cfg.n_shared_experts) * 3 * cfg.dim * cfg.expert_ffn_dim
    return cfg.dim * cfg.n_experts + routed_and_shared


def _layer_norms(cfg: DeepSeekV3Config) -> int:
    return 2 * cfg.dim + (cfg.q_lora_rank or 0) + cfg.kv_lora_rank


def _all_layers(cfg: DeepSeekV3Config) -> range:
    return range(cfg.n_layers + cfg.mtp_layers)


def _count(cfg: DeepSeekV3Config, active: bool) -> int:
    def experts(layer: int) -> int:
        return cfg.top_k if active else cfg.n_experts

    layers = sum(
        _attention_params(cfg) + _ffn_params(cfg, i, experts(i)) + _layer_norms(cfg) for i in _all_layers(cfg)
    )
    mtp_extra = cfg.mtp_layers * (2 * cfg.dim * cfg.dim + 3 * cfg.dim)  # eh_proj, enorm, hnorm, norm
    return layers + mtp_extra + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def root_params(cfg: DeepSeekV3Config, experts: bool = True) -> int:
    """Parameters outside `model.layers`: embedding, head, final norm and the MTP modules (each a block of its
    own, a MoE one, with its projection and norms): what FSDP2's root group gathers whole. Without the MTP
    blocks' routed experts when `experts` is False (expert parallelism keeps them out of FSDP2)."""
    mtp = sum(
        _attention_params(cfg) + _ffn_params(cfg, i, cfg.n_experts if experts else 0) + _layer_norms(cfg)
        for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers)
    )
    mtp += cfg.mtp_layers * (2 * cfg.dim * cfg.dim + 3 * cfg.dim)  # eh_proj, enorm, hnorm, norm
    return mtp + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def param_count(cfg: DeepSeekV3Config) -> int:
    """All trainable parameters: embedding, head, final norm, every layer and MTP module with all experts."""
    return _count(cfg, active=False)


def active_param_count(cfg: DeepSeekV3Config) -> int:
    """Parameters one token touches: as `param_count` with `top_k` routed experts per MoE layer."""
    return _count(cfg, active=True)


def flops_per_token(cfg: DeepSeekV3Config, seq_len: int, causal: bool = True) -> float:
    """Training (forward + backward) FLOPs per token over the ACTIVE weights, MTP included (it runs in every
    training step).

    6 x the matmul weights one token uses: per layer (the trunk's and each MTP block) MLA's five projections,
    the router, `top_k` routed and the shared experts (or the dense FFN); per MTP depth `eh_proj`; the LM
    head once for the trunk and once per MTP depth. Attention: QK^T over query/key heads of nope + rope and
    PV over value heads of v: `6 H (qk + v)` FLOPs per (query, key) pair, `T / 2` keys per query with
    `causal` (the llama convention), for every layer incl. the MTP blocks. Router sigmoid/top-k,
    permutation, norms and RoPE are left out."""
    matmul = sum(_attention_params(cfg) + _ffn_params(cfg, i, cfg.top_k) for i in _all_layers(cfg))
    matmul += cfg.mtp_layers * 2 * cfg.dim * cfg.dim + (1 + cfg.mtp_layers) * cfg.dim * cfg.vocab_size
    keys = seq_len / 2 if causal else seq_len
    attention = len(_all_layers(cfg)) * 6 * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) * keys
    return 6 * matmul + attention


def activation_elements(cfg: DeepSeekV3Config) -> float:
    """Elements autograd keeps per token for one MoE block (train/memory.py): two RMSNorms (3h each) and the
    latent norms; MLA's q latent, kv latent, per-head q (H qk), k (H qk), v (H v), SDPA's output (H v) and the
    output projection's input (H v); the router's fp32 scores (2E) and top-k (2k); per routed copy the
    permuted input (h), fc1's output (2f), the weighted activation (f) and the expert output (h); the combine's
    input (k h); the shared expert's fc1 output and fc2 input (3 f_s)."""
    h, f, k, H = cfg.dim, cfg.expert_ffn_dim, cfg.top_k, cfg.n_heads
    latents = RMSNORM_SAVED * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_dim)
    attention = latents + H * (2 * cfg.qk_head_dim + 3 * cfg.v_head_dim)
    shared = 3 * cfg.n_shared_experts * f
    moe = 2 * cfg.n_experts + 2 * k + k * (h + 2 * f + f + h) + k * h + shared
    return 2 * RMSNORM_SAVED * h + attention + moe


def tensor_parallel_elements(cfg: DeepSeekV3Config, tp: int) -> float:
    """`activation_elements` per token on one rank under the TP plan (parallelize.py): the block norms 1/tp
    (sequence parallelism) and the per-head tensors 1/tp (heads split), but the attention's input gathered
    whole (h, kept by the replicated down-projections), the latents whole (every TP rank computes them), the
    router and routed experts whole (every TP rank of a group runs them on all the group's tokens) and the
    shared experts' 1/tp (their width cut; their input is the routed experts' whole one)."""
    h, f, k, H = cfg.dim, cfg.expert_ffn_dim, cfg.top_k, cfg.n_heads
    latents = RMSNORM_SAVED * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_dim)
    heads = H * (2 * cfg.qk_head_dim + 3 * cfg.v_head_dim)
    routed = 2 * cfg.n_experts + 2 * k + k * (h + 2 * f + f + h) + k * h
    shared = 3 * cfg.n_shared_experts * f
    return (2 * RMSNORM_SAVED * h + heads + shared) / tp + h + latents + routed


def tensor_parallel_whole(cfg: DeepSeekV3Config) -> tuple[int, int]:
    """(The model's parameters besides the routed experts that the TP plan keeps whole, those of one MoE
    block): the embedding, head and final norm, MTP's projections and norms; in every layer MLA's
    down-projections to the latents and their norms; in every MoE layer the router (the shared experts are
    cut)."""
    q = 0 if cfg.q_lora_rank is None else cfg.dim * cfg.q_lora_rank + cfg.q_lora_rank
    mla = q + cfg.dim * (cfg.kv_lora_rank + cfg.qk_rope_dim) + cfg.kv_lora_rank
    moe = cfg.dim * cfg.n_experts
    moe_layers = sum(cfg.is_moe(i) for i in _all_layers(cfg))
    outside = 2 * cfg.vocab_size * cfg.dim + cfg.dim + cfg.mtp_layers * (2 * cfg.dim * cfg.dim + 3 * cfg.dim)
    return outside + len(_all_layers(cfg)) * mla + moe_layers * moe, mla + moe


def telemetry(model: DeepSeekV3) -> tuple[dict, str]:
    """Tokens routed to each expert in the last training forward per MoE layer, the load spread, and each
    router's balancing bias."""
    figures, line = expert_load(model.tokens_per_expert().tolist())
    bias = model.router_biases().tolist()
    figures["ttt_router_bias"] = bias
    return figures, f"{line} bias spread {max(max(b) - min(b) for b in bias):.4f}"


def stage_costs(cfg: DeepSeekV3Config) -> tuple[list[float], float]:
    """A pipeline's split (train/pipeline.py): each layer's matmul parameters one token uses (a dense FFN, or
    the router, `top_k` routed and the shared experts: FLOPs, not memory), and the last stage's extra: the
    head once for the trunk and once per MTP depth, and the MTP depths' blocks and projections."""
    layers = [float(_attention_params(cfg) + _ffn_params(cfg, i, cfg.top_k)) for i in range(cfg.n_layers)]
    mtp = sum(
        _attention_params(cfg) + _ffn_params(cfg, i, cfg.top_k) + 2 * cfg.dim * cfg.dim
        for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers)
    )
    return layers, float((1 + cfg.mtp_layers) * cfg.dim * cfg.vocab_size + mtp)


FAMILY = ModelFamily(
    name="deepseek_v3",
    build=DeepSeekV3,
    init=init_weights,
    param_count=param_count,
    active_param_count=active_param_count,
    flops_per_token=flops_per_token,
    block_params=lambda cfg: (
        _attention_params(cfg) + _ffn_params(cfg, cfg.n_layers - 1, cfg.n_experts) + _layer_norms(cfg)
    ),
    activation_elements=activation_elements,
    root_params=root_params,
    stage_costs=stage_costs,
    telemetry=telemetry,
    hf_mapping=hf_mapping,
    hf_export=hf_export,
    tensor_parallel=tensor_parallel,
    tensor_parallel_check=check_shape,
    tensor_parallel_elements=tensor_parallel_elements,
    tensor_parallel_whole=tensor_parallel_whole,
)
