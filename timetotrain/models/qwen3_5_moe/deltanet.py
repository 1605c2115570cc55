"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024), the linear attention of three in four Qwen3.5 layers, in plain
PyTorch: the chunked form for training and prefill, the recurrent form for decoding, and the layer around them.

The rule, per value head, with a state `S` of `[d_k, d_v]`, decay `a_t = exp(g_t)` (g <= 0) and write strength
`beta_t` in (0, 1), for L2-normalised `q_t`, `k_t` (q also scaled by `d_k ** -0.5`):

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

(the delta rule: write only what the decayed state does not already predict for `k_t`).

Chunked form, over chunks of C tokens with state S at the chunk's start and the in-chunk cumulative log-decay
`G_t = g_1 + ... + g_t`: unrolling the rule inside the chunk gives the lower-triangular system

    u_t + beta_t sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s = beta_t v_t - beta_t exp(G_t) S^T k_t

so `U = W_v - W_k S` with `W_v = T^{-1} (beta v)`, `W_k = T^{-1} (beta exp(G) k)` and T unit lower triangular
(solved once for all chunks, `torch.linalg.solve_triangular`), then

    o_t = exp(G_t) S^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s,
    S'  = exp(G_C) S + sum_s exp(G_C - G_s) k_s u_s^T.

Only the S-dependent part runs chunk by chunk. Decays are formed as differences `G_t - G_s` (masked above the
diagonal before the exp), so nothing overflows however strong the decay. A sequence not a multiple of C is padded
with g = 0, k = v = beta = 0, which leaves the state unchanged. Both forms compute in fp32 whatever the input dtype.

The layer (`GatedDeltaNet`, HF `Qwen3_5MoeGatedDeltaNet`'s weights, its four input projections fused into one
`in_proj`): `in_proj_qkv` -> a depthwise causal conv1d of
width `conv_kernel` over time -> SiLU -> q, k, v; `beta = sigmoid(in_proj_b x)`,
`g = -exp(A_log) * softplus(in_proj_a x + dt_bias)`; each key head serves `lin_v_heads / lin_k_heads` consecutive
value heads; the output is RMS-normalised per value head (a plain 1-initialised weight), gated by
`silu(in_proj_z x)`, and projected by `out_proj`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain import fakes

DELTANET_CHUNK = 64  # tokens per chunk of the chunked form (FLA's and HF's default)
L2_EPS = 1e-6  # FLA's and HF's l2norm epsilon: x * rsqrt(sum x^2 + eps)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over a whole sequence (module docstring). `q`, `k` `[B, H, T, d_k]` (normalised and scaled),
    `v` `[B, H, T, d_v]`, `g`, `beta` `[B, H, T]`, `state` `[B, H, d_k, d_v]` or None (zeros), all fp32.
    Returns (outputs `[B, H, T, d_v]`, the final state)."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    if state is None:
        state = q.new_zeros(B, H, dk, dv)
    chunk = min(chunk, T)  # a short sequence (a prompt) is one chunk of its own length, not padded to 64
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)

    G = g.cumsum(dim=-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # [.., t, s]
    kb = k * beta.unsqueeze(-1)
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, device=q.device, dtype=q.dtype)
    w_v = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, kb * G.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * G.exp().unsqueeze(-1)
    k_to_end = k * (G[..., -1:] - G).exp().unsqueeze(-1)
    end_decay = G[..., -1].exp()[..., None, None]

    if fakes.shapes_only():  # `ttt plan --simulate`: what the loop below allocates, in a few ops
        return _chunk_scan_shapes(w_v, w_k, q_decayed, attn, k_to_end, end_decay, state, T)
    outs = []
    for c in range(n):
        u = w_v[:, :, c] - w_k[:, :, c] @ state
        outs.append(q_decayed[:, :, c] @ state + attn[:, :, c] @ u)
        state = state * end_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(B, H, n * chunk, dv)[:, :, :T]
    return out, state


def _chunk_scan_shapes(w_v, w_k, q_decayed, attn, k_to_end, end_decay, state, T: int):
    """The chunk loop of `chunk_gated_delta_rule` for fake tensors (no values): its n steps batched, with the
    tensors autograd keeps being the loop's: a state `[B, H, d_k, d_v]` per chunk (each step makes one and
    its matmuls keep it) and a `u` `[B, H, C, d_v]` per chunk, the outputs' stack, and the same inputs
    (views of w_k, q_decayed, attn, k_to_end, end_decay). Run op by op, the loop is ~30 fake ops a chunk
    forward and backward, 1,024 chunks a layer at 65,536 tokens: the simulation of qwen35_397b_grpo's
    reference took hours. The backward differs by the loop's per-chunk temporaries: one slice-sized gradient
    at a time there, the whole stacked gradients here (tests/test_simulate.py compares the two)."""
    B, H, n, C, dv = w_v.shape
    states = state.unsqueeze(2) * end_decay  # [B, H, n, d_k, d_v]: the state each chunk starts from
    u = w_v - w_k @ states
    out = q_decayed @ states + attn @ u
    final = states[:, :, -1] * end_decay[:, :, -1] + k_to_end[:, :, -1].transpose(-1, -2) @ u[:, :, -1]
    return out.reshape(B, H, n * C, dv)[:, :, :T], final


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule token by token (decoding: T = 1); same arguments and results as `chunk_gated_delta_rule`."""
    B, H, T, dk = k.shape
    if state is None:
        state = q.new_zeros(B, H, dk, v.shape[-1])
    outs = []
    for t in range(T):
        k_t = k[:, :, t]
        state = state * g[:, :, t].exp()[..., None, None]
        u = beta[:, :, t].unsqueeze(-1) * (v[:, :, t] - (state * k_t.unsqueeze(-1)).sum(dim=-2))
        state = state + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append((state * q[:, :, t].unsqueeze(-1)).sum(dim=-2))
    return torch.stack(outs, dim=2), state


class LinearState:
    """One linear-attention layer's decoding state: the last `conv_kernel - 1` conv inputs `[B, C, K-1]` and the
    recurrent state `[B, H_v, d_k, d_v]` (fp32)."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor | None = None):
        self.conv = conv
        self.recurrent = recurrent

    def keep(self, rows: torch.Tensor) -> None:
        self.conv = self.conv.index_select(0, rows)
        if self.recurrent is not None:
            self.recurrent = self.recurrent.index_select(0, rows)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times `silu(gate)` (HF `Qwen3_5MoeRMSNormGated`; 1-initialised)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        return (y * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer (module docstring), no biases."""

    def __init__(self, cfg, chunk: int = DELTANET_CHUNK):
        super().__init__()
        self.k_heads, self.v_heads = cfg.lin_k_heads, cfg.lin_v_heads
        self.k_dim, self.v_dim = cfg.lin_k_dim, cfg.lin_v_dim
        self.kernel = cfg.conv_kernel
        self.chunk = chunk
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        # HF's four input projections as one matmul, rows [qkv | z | b | a] (`hf.py` concatenates them).
        self.in_sizes = [2 * key + value, value, self.v_heads, self.v_heads]
        self.in_proj = nn.Linear(cfg.dim, sum(self.in_sizes), bias=False)
        # Depthwise: one `kernel`-tap filter per channel, HF's `conv1d.weight` layout `[C, 1, K]`.
        self.conv_weight = nn.Parameter(torch.empty(2 * key + value, 1, cfg.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(value, cfg.dim, bias=False)

    def new_state(self, batch: int, device) -> LinearState:
        # fp32 zeros: the conv window is cast to the compute dtype where it is used.
        return LinearState(torch.zeros(batch, self.conv_weight.shape[0], self.kernel - 1, device=device))

    def _conv(self, x: torch.Tensor, state: LinearState | None) -> torch.Tensor:
        """Causal depthwise conv + SiLU over `x` `[B, C, T]`; the inputs before the first are the state's (zeros
        without one, the causal padding), and the state keeps the last K-1."""
        B, C, _ = x.shape
        past = state.conv.to(x.dtype) if state is not None else x.new_zeros(B, C, self.kernel - 1)
        full = torch.cat((past, x), dim=-1)
        if state is not None:
            state.conv = full[:, :, full.shape[-1] - (self.kernel - 1) :].detach().clone()
        w = self.conv_weight.to(x.dtype)
        if full.shape[-1] == self.kernel:  # one new step (decoding): a dot product per channel
            return F.silu((full * w.squeeze(1)).sum(dim=-1, keepdim=True))
        return F.silu(F.conv1d(full, w, groups=C))

    def forward(
        self, x: torch.Tensor, state: LinearState | None = None, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x` `[B, T, dim]` -> `[B, T, dim]`. `state`: continue from it and update it (decoding); `valid` `[B, T]`
        (False: a padding position): its input is zeroed, so it adds nothing to the conv window or the state."""
        mixed, z, b, a = self.project(x, valid)
        q, k, v, g, beta = self.rule_inputs(mixed, b, a, state)
        initial = state.recurrent if state is not None else None
        if state is not None and x.shape[1] == 1:
            out, final = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
        else:
            out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial, self.chunk)
        if state is not None:
            state.recurrent = final.detach()
        return self.output(out, z, x.dtype)

    # The three stages of `forward`, apart so that a context-parallel harness (train/context_parallel_deltanet.py)
    # can exchange the conv window and the recurrent state between them.
    def project(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The per-token input projections of `x` `[B, T, dim]`: the conv's input (q, k, v side by side), the
        output gate z, and the write-strength and decay logits b, a, each `[B, T, .]`."""
        if valid is not None:
            x = x * valid.unsqueeze(-1).to(x.dtype)
        return self.in_proj(x).split(self.in_sizes, dim=-1)

    def rule_inputs(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state: LinearState | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The conv over time (after `state`'s window, updated) and the heads: q, k `[B, H_v, T, d_k]`
        (normalised, q scaled), v `[B, H_v, T, d_v]`, g, beta `[B, H_v, T]`, all fp32."""
        B, T, _ = mixed.shape
        mixed = self._conv(mixed.transpose(1, 2), state).transpose(1, 2)
        key = self.k_heads * self.k_dim
        q, k, v = mixed.split([key, key, self.v_heads * self.v_dim], dim=-1)
        group = self.v_heads // self.k_heads

        def heads(t: torch.Tensor, n: int, d: int) -> torch.Tensor:  # [B, T, n*d] -> [B, H_v, T, d] fp32
            t = t.reshape(B, T, n, d).float()
            if n != self.v_heads:
                t = t.repeat_interleave(group, dim=2)
            return t.transpose(1, 2)

        q = l2_normalize(heads(q, self.k_heads, self.k_dim)) * self.k_dim**-0.5
        k = l2_normalize(heads(k, self.k_heads, self.k_dim))
        v = heads(v, self.v_heads, self.v_dim)
        beta = b.float().sigmoid().transpose(1, 2)
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())).transpose(1, 2)
        return q, k, v, g, beta

    def output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rule's output `[B, H_v, T, d_v]` (cast to the layer input's `dtype`), normalised per value head,
        gated by z and projected: `[B, T, dim]`."""
        B, _, T, _ = out.shape
        out = out.transpose(1, 2).to(dtype)  # [B, T, H_v, d_v]
        z = z.reshape(B, T, self.v_heads, self.v_dim)
        return self.out_proj(self.norm(out, z).reshape(B, T, -1))

    @torch.no_grad()
    def init_weights(self, normal, std: float, residual_std: float, generator=None) -> None:
        normal(self.in_proj.weight, std)
        normal(self.out_proj.weight, residual_std)
        # PyTorch's default for a depthwise conv (fan-in = K): U(-1/sqrt(K), 1/sqrt(K)).
        bound = self.kernel**-0.5
        self.conv_weight.uniform_(-bound, bound, generator=generator)
        # HF's initialisation: dt_bias 1, A = exp(A_log) ~ U(0.01, 16).
        self.dt_bias.fill_(1.0)
        # In place, so that the sharded build's `full_init` sees the draw.
        self.A_log.uniform_(0.01, 16.0, generator=generator)
        self.A_log.log_()
        nn.init.ones_(self.norm.weight)
