"""Context parallelism for the Gated DeltaNet layers of qwen3_5_moe (models/qwen3_5_moe/deltanet.py).

Layout (the one CP uses for every family): each sample's sequence is cut into 2N equal chunks for a CP group of
N ranks, and rank c holds chunks c and 2N-1-c (head-tail load balancing), side by side in time, so its local
tensors are `[B, 2 * T_c, .]`. A DeltaNet layer is per-token work except for two things that run along the
sequence, and both must cross chunk borders in SEQUENCE order (chunk 0 -> 1 -> ... -> 2N-1, i.e. rank 0 -> 1
-> ... -> N-1 -> N-1 -> ... -> 0):

1. The depthwise causal conv1d over time reads the K-1 conv inputs before each token (K = `conv_kernel`). Every
   rank all-gathers the last K-1 conv inputs of its two chunks (the halo); chunk j's window is then the tail
   of chunks < j (zeros before chunk 0, the causal padding, and several chunks when T_c < K-1), exactly the
   window a decoding `LinearState` carries, so the layer's own `_conv` runs on it unchanged.

2. The recurrence `S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`, `o_t = S_t^T q_t`, is affine
   in the state, and each of the d_v columns of S evolves alone under the same d_k x d_k matrix. So over one
   chunk, from an incoming state S_in,

       S_out = A S_in + B,      o = o_0 + J S_in,

   where B and o_0 are the chunk's final state and outputs from a zero state, A `[d_k, d_k]` is the product
   of the chunk's per-token transitions, and J `[T_c, d_k]` (row t: `(A_t^T q_t)^T`, A_t the product up to
   t) maps the incoming state to the outputs. All four come from ONE call of the model's own
   `chunk_gated_delta_rule`: append d_k zero columns to v and start from the state `[0 | I]`; the zero-v
   columns, started at the identity, evolve into A (final state) and J (outputs), the others into B and o_0.
   No rule math is repeated here. Each rank does this for its two chunks at once (independently of every other
   rank: no waiting), the group all-gathers the small (A, B) pairs (`[B, H_v, d_k, d_k + d_v]` each), and every
   rank runs the scan S_0 = 0, S_{j+1} = A_j S_j + B_j (2N-1 small matmuls at most) to get the incoming states
   of its chunks, then adds J S_in to its outputs.

Why it is exact: the chunked form is exact for any chunking (chunk_gated_delta_rule's docstring: it is the
unrolled rule, and padding leaves the state unchanged), so cutting the sequence at the CP chunk borders instead
of every DELTANET_CHUNK tokens from the start changes nothing but rounding; the decomposition above is an
identity of an affine map, not an approximation; and the conv window is the same inputs the single-process conv
reads. The backward is exact because every cross-rank step is an all-gather whose adjoint is implemented as
its transpose (`_AllGather`: a reduce-scatter of the gathered gradient, summing what every rank's scan or conv
sent back to a chunk's pair or tail), and everything else is ordinary autograd through the layer's own
code, so the gradient of each chunk's A, B and tail is the sum over every later chunk that depends on it, as
in one process. The two all-gathers' backward passes cannot run out of order across ranks: the halo feeds the
(A, B) pairs, so its gradient is complete only after the pairs' reduce-scatter.

Entry points: `deltanet_cp_forward(layer, x, group)` (the layer's output for the rank's two chunks),
`context_parallel(layer, group)` (swaps the layer's forward for it, so that its block calls it unchanged; a
call with a decoding state, GRPO's rollouts, runs the layer's own forward on whole sequences), and
`gated_delta_rule_cp` (the bare rule). No padding mask.

Cost: the rule runs d_k extra value columns (v-side work about (d_k + d_v) / d_v times one process's), plus
an all-gather of 2N pairs per layer (Qwen3.5-397B, cp=8, one sample: 16 x 8 MiB fp32) and of the halos.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from timetotrain.models.qwen3_5_moe.deltanet import (
    DELTANET_CHUNK,
    GatedDeltaNet,
    LinearState,
    chunk_gated_delta_rule,
)

# `all_gather_into_tensor` / `reduce_scatter_tensor` are deprecated in recent torch for the `_single` names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """`x` from every rank of `group`, stacked `[N, *x.shape]`; backward: the gradient's reduce-scatter (each
    rank's x gets the sum of what every rank's gathered copy received)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.shape = group, x.shape
        n = dist.get_world_size(group)
        out = x.new_empty(n * x.numel())
        _all_gather(out, x.contiguous().view(-1), group=group)
        return out.view(n, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(math.prod(ctx.shape))
        _reduce_scatter(out, grad.contiguous().view(-1), group=ctx.group)
        return out.view(ctx.shape), None


def _sequence_order(gathered: torch.Tensor) -> list[torch.Tensor]:
    """`[N, B, 2, ...]` (rank, sample, local chunk) -> the 2N chunks' `[B, ...]` in sequence order."""
    n = gathered.shape[0]
    return [gathered[j, :, 0] for j in range(n)] + [gathered[n - 1 - j, :, 1] for j in range(n)]


def _local_chunks(rank: int, n: int) -> tuple[int, int]:
    return rank, 2 * n - 1 - rank


def _halos(tails: torch.Tensor, width: int, group) -> torch.Tensor:
    """Each local chunk's conv window: the `width` conv inputs before it in the sequence. `tails` `[B, 2, C, L]`
    (the last L = min(T_c, width) inputs of each local chunk) -> `[B, 2, C, width]`."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    chunks = _sequence_order(_AllGather.apply(tails, group))
    zeros = tails.new_zeros(*tails.shape[:1], tails.shape[2], width)
    reach = -(-width // tails.shape[-1])  # chunks a window can span when T_c < width
    windows = [
        torch.cat([zeros, *chunks[max(0, j - reach) : j]], dim=-1)[..., -width:]
        for j in _local_chunks(rank, n)
    ]
    return torch.stack(windows, dim=1)


def _incoming_states(pairs: torch.Tensor, group) -> torch.Tensor:
    """Each local chunk's incoming state from the (A, B) pairs of the group: `[B, 2, H, d_k, d_k + d_v]` (A in
    the last d_k columns, B before them) -> `[B, 2, H, d_k, d_v]`, by the scan in sequence order from zero."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    chunks = _sequence_order(_AllGather.apply(pairs, group))
    dk = pairs.shape[-2]
    first, second = _local_chunks(rank, n)
    # fp32 whatever autocast says: 2N-1 chained products, and o = o_0 + J S_in only as exact as S_in.
    with torch.autocast(pairs.device.type, enabled=False):
        chunks = [c.float() for c in chunks]
        state = chunks[0].new_zeros(*pairs.shape[:1], *pairs.shape[2:-1], pairs.shape[-1] - dk)
        incoming = {}
        for j in range(second + 1):
            incoming[j] = state
            if j < second:
                b, a = chunks[j].split([state.shape[-1], dk], dim=-1)
                state = a @ state + b
    return torch.stack([incoming[first], incoming[second]], dim=1)


def _rule_two_chunks(q, k, v, g, beta, group, chunk: int) -> torch.Tensor:
    """`chunk_gated_delta_rule` over the group's sequence for this rank's two chunks, stacked on the batch
    dimension (row 2b + i: sample b, local chunk i): q, k `[2B, H, T_c, d_k]`, v `[2B, H, T_c, d_v]`, g, beta
    `[2B, H, T_c]` -> outputs `[2B, H, T_c, d_v]` (module docstring, 2)."""
    rows, H, _, dk = k.shape
    dv = v.shape[-1]
    eye = torch.eye(dk, device=v.device, dtype=v.dtype).expand(rows, H, dk, dk)
    start = torch.cat([v.new_zeros(rows, H, dk, dv), eye], dim=-1)
    wide = torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], dim=-1)
    out, final = chunk_gated_delta_rule(q, k, wide, g, beta, start, chunk)
    o_0, jac = out.split([dv, dk], dim=-1)
    incoming = _incoming_states(final.reshape(rows // 2, 2, *final.shape[1:]), group)
    return o_0 + jac @ incoming.reshape(rows, H, dk, dv)


def _two_rows(x: torch.Tensor) -> torch.Tensor:
    """`[B, 2 T_c, ...]` (the rank's two chunks side by side in time) -> `[2B, T_c, ...]` (row 2b + i)."""
    B, T = x.shape[:2]
    if T % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks, got {T} positions")
    return x.reshape(2 * B, T // 2, *x.shape[2:])


def gated_delta_rule_cp(q, k, v, g, beta, group=None, chunk: int = DELTANET_CHUNK) -> torch.Tensor:
    """The bare rule under context parallelism: this rank's q, k, v `[B, H, 2 T_c, d]`, g, beta `[B, H, 2 T_c]`
    (chunks c and 2N-1-c side by side in time) -> its outputs `[B, H, 2 T_c, d_v]`, as `chunk_gated_delta_rule`
    over the whole sequence from a zero state would give them."""
    B, H = k.shape[:2]
    rows = [_two_rows(t.transpose(1, 2)).transpose(1, 2) for t in (q, k, v, g, beta)]
    out = _rule_two_chunks(*rows, group, chunk)
    return out.transpose(1, 2).reshape(B, -1, H, out.shape[-1]).transpose(1, 2)


def deltanet_cp_forward(layer: GatedDeltaNet, x: torch.Tensor, group=None) -> torch.Tensor:
    """`layer(x)` under context parallelism over `group` (None: the default group): `x` `[B, 2 T_c, dim]` holds
    this rank's chunks c and 2N-1-c of each sample side by side in time; returns the layer's output for them,
    equal to the matching positions of the single-process `layer(whole sequence)` (module docstring)."""
    B = x.shape[0]
    mixed, z, b, a = layer.project(_two_rows(x))
    width = layer.kernel - 1
    window = None
    if width:
        tails = mixed[:, -width:].transpose(1, 2)  # [2B, C, L]
        halo = _halos(tails.reshape(B, 2, *tails.shape[1:]), width, group)
        window = LinearState(halo.reshape(2 * B, *halo.shape[2:]))
    q, k, v, g, beta = layer.rule_inputs(mixed, b, a, window)
    out = _rule_two_chunks(q, k, v, g, beta, group, layer.chunk)
    return layer.output(out, z, x.dtype).reshape(B, -1, x.shape[-1])


def context_parallel(layer: GatedDeltaNet, group=None) -> None:
    """From now on `layer` (as its block calls it: `layer(x, state, valid)`) computes under context parallelism
    over `group`, `x` being the rank's two chunks (`deltanet_cp_forward`); with a decoding state, as before."""

    def forward(x: torch.Tensor, state: LinearState | None = None, valid: torch.Tensor | None = None):
        if state is not None:
            # Decoding (GRPO's rollouts under cp): every rank decodes whole sequences, never a part.
            return type(layer).forward(layer, x, state, valid)
        if valid is not None:
            raise ValueError("a context-parallel DeltaNet layer takes no padding mask outside decoding")
        return deltanet_cp_forward(layer, x, group)

    layer.forward = forward
