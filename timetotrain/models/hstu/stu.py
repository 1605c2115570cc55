"""The STU layer (modules/stu.py:176-363, STULayer, with ops/hstu_compute.py's uqvk and ops/pytorch/
pt_hstu_linear.py's output, as the reference configures them at modules/dlrm_hstu.py:240-264):

    n = LayerNorm(x) (eps 1e-6);  u, v, q, k = split(n W_uvqk + b);  u = SiLU(u)
    a = attention(q, k, v)  (attention.py)
    y = dropout([u, a, u * LayerNorm(a)])  (eps 1e-6; concat_u and concat_x: the `x` concatenated there is
        the attention output, pt_hstu_linear.py:23-82)
    out = x + y W_out

There is no separate FFN: the 3 H d_v-wide output projection and the SiLU gate are the layer's MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.models.hstu.attention import hstu_attention
from timetotrain.models.hstu.jagged import SequenceLayout

NORM_EPS = 1e-6  # norm_eps of both STU norms (modules/stu.py:307, 343)


class STULayer(nn.Module):
    def __init__(
        self, dim: int, heads: int, linear_dim: int, qk_dim: int, dropout: float, attention_block: int = 0
    ):
        super().__init__()
        self.heads, self.linear_dim, self.qk_dim, self.dropout = heads, linear_dim, qk_dim, dropout
        self.attention_block = attention_block
        self.alpha = 1.0 / qk_dim**0.5  # attn_alpha default (modules/stu.py:199)
        width = (2 * linear_dim + 2 * qk_dim) * heads
        # The reference's own parameter shapes (in x out, applied as x @ W): uvqk [D, 2H(dv+dqk)], output
        # [3 H dv, D] (modules/stu.py:207-241).
        self.uvqk_weight = nn.Parameter(torch.empty(dim, width))
        self.uvqk_bias = nn.Parameter(torch.empty(width))
        self.input_norm_weight = nn.Parameter(torch.empty(dim))
        self.input_norm_bias = nn.Parameter(torch.empty(dim))
        self.output_weight = nn.Parameter(torch.empty(3 * heads * linear_dim, dim))
        self.output_norm_weight = nn.Parameter(torch.empty(heads * linear_dim))
        self.output_norm_bias = nn.Parameter(torch.empty(heads * linear_dim))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """xavier_uniform_ on both weights, zero uvqk bias, norms at ones and zeros (modules/stu.py:207-241)."""
        nn.init.xavier_uniform_(self.uvqk_weight, generator=generator)
        nn.init.xavier_uniform_(self.output_weight, generator=generator)
        self.uvqk_bias.zero_()
        self.input_norm_weight.fill_(1.0)
        self.input_norm_bias.zero_()
        self.output_norm_weight.fill_(1.0)
        self.output_norm_bias.zero_()

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        """x [T, D] jagged -> [T, D]."""
        h, dv, dqk = self.heads, self.linear_dim, self.qk_dim
        normed = F.layer_norm(x, (x.shape[-1],), self.input_norm_weight, self.input_norm_bias, NORM_EPS)
        uvqk = torch.addmm(self.uvqk_bias, normed, self.uvqk_weight)
        u, v, q, k = torch.split(uvqk, [h * dv, h * dv, h * dqk, h * dqk], dim=1)
        u = F.silu(u)
        attn = hstu_attention(
            q.reshape(-1, h, dqk),
            k.reshape(-1, h, dqk),
            v.reshape(-1, h, dv),
            layout,
            self.alpha,
            self.attention_block,
        ).reshape(-1, h * dv)
        y = u * F.layer_norm(attn, (h * dv,), self.output_norm_weight, self.output_norm_bias, NORM_EPS)
        y = F.dropout(torch.cat([u, attn, y], dim=1), p=self.dropout, training=self.training)
        return torch.addmm(x, y, self.output_weight)
