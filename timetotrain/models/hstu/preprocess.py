"""Before the STU stack: the contextual preprocessor (modules/preprocessors.py:108-334, ContextualPreprocessor,
with modules/action_encoder.py's ActionEncoder) and the positional encoder (modules/positional_encoder.py,
ops/pytorch/pt_position.py:36-142). Built as the reference builds them at modules/dlrm_hstu.py:193-215."""

from __future__ import annotations

import math

import torch
from torch import nn

from timetotrain.models.hstu.jagged import SequenceLayout, place
from timetotrain.models.hstu.layers import reset_mlp, swish_mlp

TIME_BUCKET_SECONDS = 60.0  # time_bucket_increments (pt_position.py:99)


class ContextualPreprocessor(nn.Module):
    """Each history/candidate token: content MLP of its item embedding + MLP of its other id embeddings
    (artist, album: `additional_embedding_features`) + MLP of its action embedding; in front of each
    sequence, one token per contextual feature, each through its own linear map (a batched matmul)."""

    def __init__(self, table_dim: int, hidden: int, dim: int, contextual: int, others: int,
                 action_weights: tuple[int, ...], action_dim: int, action_init_std: float):  # fmt: skip
        super().__init__()
        self.table_dim, self.dim, self.contextual = table_dim, dim, contextual
        self.action_init_std = action_init_std
        self.contextual_weight = nn.Parameter(torch.empty(contextual, table_dim, dim))
        self.contextual_bias = nn.Parameter(torch.empty(contextual, dim))
        self.content_mlp = swish_mlp(table_dim, hidden, dim, norm_out=True)
        # None without other id features (the reference skips the branch then, preprocessors.py:230-239).
        self.additional_mlp = swish_mlp(table_dim * others, hidden, dim, norm_out=True) if others else None
        self.action_bits = tuple(action_weights)
        # Refilled by reset_parameters: a meta build's to_empty leaves buffers unset.
        self.register_buffer(
            "action_weights", torch.tensor(action_weights, dtype=torch.long), persistent=False
        )
        n_actions = len(action_weights)
        self.action_table = nn.Parameter(torch.empty(n_actions, action_dim))
        self.target_action_table = nn.Parameter(torch.empty(1, n_actions * action_dim))
        self.action_mlp = swish_mlp(n_actions * action_dim, hidden, dim, norm_out=True)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Contextual maps N(0, sqrt(2 / (in + out))) with zero bias (preprocessors.py:137-153); action tables
        N(0, action_embedding_init_std) (action_encoder.py:58-67); the MLPs' Linears xavier_normal_ with zero
        bias: built with xavier_uniform_ (init_mlp_weights_optional_bias) and then re-drawn xavier_normal_
        by HSTUTransducer.__init__ for every Linear outside the STU stack (modules/hstu_transducer.py:82-91)."""
        self.action_weights.copy_(torch.tensor(self.action_bits, dtype=torch.long))
        std = math.sqrt(2.0 / float(self.table_dim + self.dim))
        self.contextual_weight.normal_(0.0, std, generator=generator)
        self.contextual_bias.zero_()
        self.action_table.normal_(0.0, self.action_init_std, generator=generator)
        self.target_action_table.normal_(0.0, self.action_init_std, generator=generator)
        for mlp in (self.content_mlp, self.additional_mlp, self.action_mlp):
            if mlp is not None:
                reset_mlp(mlp, nn.init.xavier_normal_, generator)

    def forward(self, merged: torch.Tensor, contextual: torch.Tensor, uih_actions: torch.Tensor,
                layout: SequenceLayout) -> torch.Tensor:  # fmt: skip
        """merged [T_u + T_c, ids, table_dim] (each token's item embedding first), contextual
        [B, contextual, table_dim], uih_actions [T_u] -> the full sequences [T, dim]."""
        out = self.content_mlp(merged[:, 0])
        if self.additional_mlp is not None:
            out = out + self.additional_mlp(merged[:, 1:].flatten(1))
        exploded = (uih_actions.unsqueeze(-1) & self.action_weights.unsqueeze(0)) > 0
        actions = (exploded.unsqueeze(-1) * self.action_table.unsqueeze(0)).flatten(1)
        targets = self.target_action_table.expand(layout.merged_candidates.shape[0], -1)
        actions = place(merged.shape[0], [(layout.merged_uih, actions), (layout.merged_candidates, targets)])
        out = out + self.action_mlp(actions)
        ctx = torch.baddbmm(
            self.contextual_bias.view(-1, 1, self.dim).to(contextual.dtype),
            contextual.transpose(0, 1),
            self.contextual_weight.to(contextual.dtype),
        ).transpose(0, 1)  # [B, contextual, dim]
        return place(
            layout.tokens, [(layout.full_contextual, ctx.reshape(-1, self.dim)), (layout.full_merged, out)]
        )


class PositionalEncoder(nn.Module):
    """x * sqrt(D) + position embedding + time embedding (add_timestamp_positional_embeddings, alpha
    sqrt(D), ops/position.py and pt_position.py). Position: counted back from the first candidate (every
    candidate gets the first candidate's position), after the contextual tokens, which take 0..ctx-1.
    Time: bucket sqrt((t_query - t) / 60 s), t_query the sequence's last token's time, clamped to
    [0, time_buckets]."""

    def __init__(self, dim: int, position_buckets: int, time_buckets: int, contextual: int):
        super().__init__()
        self.dim, self.contextual = dim, contextual
        self.position = nn.Parameter(torch.empty(position_buckets, dim))
        self.time = nn.Parameter(torch.empty(time_buckets + 1, dim))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """U(-sqrt(1/buckets), sqrt(1/buckets)), the time table by its bucket count without the extra row
        (modules/positional_encoder.py:39-50)."""
        p, t = self.position.shape[0], self.time.shape[0] - 1
        self.position.uniform_(-math.sqrt(1.0 / p), math.sqrt(1.0 / p), generator=generator)
        self.time.uniform_(-math.sqrt(1.0 / t), math.sqrt(1.0 / t), generator=generator)

    def indices(self, timestamps: torch.Tensor, layout: SequenceLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's position bucket and time bucket."""
        s = layout.lengths[layout.sample]
        high = s - layout.num_targets[layout.sample]
        t = layout.position
        pos = high - torch.minimum(t, high) + self.contextual
        pos = torch.where(t < self.contextual, t, pos.clamp(max=self.position.shape[0] - 1))
        last = torch.cumsum(layout.lengths, 0) - 1
        query = timestamps[last][layout.sample]
        # int64 difference, then float32 as the reference's clamp(min=1e-6) promotes it (pt_position.py:108-113)
        ts = (query - timestamps).clamp(min=1e-6) / TIME_BUCKET_SECONDS
        ts = torch.sqrt(ts).clamp(min=0).int().clamp(0, self.time.shape[0] - 1)
        return pos, ts.long()

    def forward(self, x: torch.Tensor, timestamps: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        pos, ts = self.indices(timestamps, layout)
        x = x * self.dim**0.5
        return x + (self.time[ts] + self.position[pos]).to(x.dtype)
