"""HSTU, the dlrmv4 reference's DlrmHSTU (modules/dlrm_hstu.py) as configs.py's "yambda" branch and
yambda_5b.gin configure it, on PyTorch alone: the tables (embedding.py), the contextual preprocessor and
positional encoder (preprocess.py), the STU stack (stu.py, attention.py), the timestamp layer-norm
postprocessor, the item MLP and the prediction head (head.py). Jagged sequences: jagged.py. Free of
parallelism and logging; the tables are sharded and the dense part data-parallel from outside.

`forward(batch)` returns one logit per candidate; `labels(batch)` their targets; `loss` the reference's
masked BCE. Sources with lines, and the choices: docs/benchmarks/dlrmv4.md ("Model")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from timetotrain.fakes import real_host
from timetotrain.models.common.embedding import FusedEmbedding
from timetotrain.models.family import EmbeddingTables, ModelFamily
from timetotrain.models.hstu.batch import HSTUBatch
from timetotrain.models.hstu.config import HSTUConfig
from timetotrain.models.hstu.head import TimestampLayerNorm, masked_bce
from timetotrain.models.hstu.jagged import SequenceLayout, place
from timetotrain.models.hstu.layers import reset_mlp, swish_mlp
from timetotrain.models.hstu.preprocess import ContextualPreprocessor, PositionalEncoder
from timetotrain.models.hstu.stu import STULayer


class HSTU(nn.Module):
    def __init__(self, cfg: HSTUConfig):
        super().__init__()
        self.cfg = cfg
        f = cfg.features
        n_seq = len(f.sequence)
        self.embedding = FusedEmbedding(cfg.table_sizes, cfg.table_dim)
        self.contextual_tables = tuple(cfg.table_index(n) for n in f.contextual)
        self.sequence_tables = tuple(cfg.table_index(t) for _, _, t in f.sequence)
        self.preprocessor = ContextualPreprocessor(
            cfg.table_dim, cfg.preprocessor_hidden, cfg.dim, cfg.contextual_len, n_seq - 1,
            cfg.action_weights, cfg.action_dim, cfg.action_init_std,
        )  # fmt: skip
        self.positional = PositionalEncoder(
            cfg.dim, cfg.position_buckets, cfg.time_buckets, cfg.contextual_len
        )
        # The repeated blocks, for activation checkpointing and FSDP applied from outside.
        self.layers = nn.ModuleList(
            STULayer(cfg.dim, cfg.heads, cfg.linear_dim, cfg.qk_dim, cfg.linear_dropout, cfg.attention_block)
            for _ in range(cfg.layers)
        )
        self.postprocessor = TimestampLayerNorm(cfg.dim)
        self.item_mlp = swish_mlp(cfg.table_dim * n_seq, cfg.mlp_hidden, cfg.dim, norm_out=True)
        self.head = swish_mlp(cfg.dim, cfg.mlp_hidden, 1, norm_out=False)

    def embed(self, batch: HSTUBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One lookup for the batch (one sparse gradient): contextual [B, ctx, E], history [T_u, ids, E],
        candidates [T_c, ids, E]."""
        parts = (
            self.embedding.rows(batch.contextual_ids, self.contextual_tables),
            self.embedding.rows(batch.uih_ids, self.sequence_tables),
            self.embedding.rows(batch.candidate_ids, self.sequence_tables),
        )
        flat = self.embedding(torch.cat([p.reshape(-1) for p in parts]))
        out, at = [], 0
        for p in parts:
            out.append(flat[at : at + p.numel()].view(*p.shape, -1))
            at += p.numel()
        return out[0], out[1], out[2]

    def user_embeddings(self, batch: HSTUBatch, layout: SequenceLayout, contextual, uih, candidates):
        """The STU stack's output at each candidate, postprocessed: [T_c, D] (HSTUTransducer)."""
        merged_len = uih.shape[0] + candidates.shape[0]
        merged = place(merged_len, [(layout.merged_uih, uih), (layout.merged_candidates, candidates)])
        x = self.preprocessor(merged, contextual, batch.uih_actions, layout)
        times = place(
            merged_len,
            [(layout.merged_uih, batch.uih_timestamps), (layout.merged_candidates, batch.query_times)],
        )
        zeros = times.new_zeros(layout.full_contextual.shape[0])
        times = place(layout.tokens, [(layout.full_contextual, zeros), (layout.full_merged, times)])
        x = self.positional(x, times, layout)
        x = F.dropout(x, p=self.cfg.input_dropout, training=self.training)
        for layer in self.layers:
            x = layer(x, layout)
        return self.postprocessor(x[layout.full_candidates], batch.query_times)

    def forward(self, batch: HSTUBatch) -> torch.Tensor:
        """One logit per candidate, [T_c]."""
        # Host bookkeeping read from the lengths: under `ttt plan --simulate` it runs on the real batch
        # outside the fake mode (timetotrain/fakes.py); otherwise a no-op.
        with real_host():
            layout = SequenceLayout.build(batch.uih_lengths, batch.num_candidates, self.cfg.contextual_len)
        contextual, uih, candidates = self.embed(batch)
        user = self.user_embeddings(batch, layout, contextual, uih, candidates)
        item = self.item_mlp(candidates.flatten(1))
        return self.head(user * item).squeeze(-1)

    def labels(self, batch: HSTUBatch) -> torch.Tensor:
        """(bitmask & task bit) > 0 per candidate (_get_supervision_labels_and_weights)."""
        return ((batch.candidate_actions & self.cfg.task_bit) > 0).float()

    def loss(self, logits: torch.Tensor, batch: HSTUBatch) -> torch.Tensor:
        return masked_bce(logits, self.labels(batch), None, self.cfg.loss_scale)


def table_parameters(model: HSTU) -> list[nn.Parameter]:
    """The embedding tables: row-wise Adagrad at the dense LR (yambda_5b.gin sparse_optimizer_factory...)."""
    return [model.embedding.weight]


def dense_parameters(model: HSTU) -> list[nn.Parameter]:
    """Everything else: Adam (0.95, 0.999), eps 1e-8, clipped at norm 1.0 (yambda_5b.gin)."""
    return [p for n, p in model.named_parameters() if not n.startswith("embedding.")]


@torch.no_grad()
def init(model: HSTU, generator: torch.Generator) -> None:
    """The reference's init (README.MD:457-489 and the code it names): tables U(+-sqrt(1/rows)); STU weights
    xavier_uniform_; the preprocessor MLPs and the postprocessor's combiner xavier_normal_ (HSTUTransducer
    re-draws every Linear outside the STU stack, hstu_transducer.py:82-91); the item MLP and the prediction
    head xavier_uniform_ (init_mlp_weights_optional_bias, common.py:509-513); zero biases, norms at ones."""
    model.embedding.reset_parameters(generator)
    model.preprocessor.reset_parameters(generator)
    model.positional.reset_parameters(generator)
    for layer in model.layers:
        layer.reset_parameters(generator)
    model.postprocessor.reset_parameters(generator)
    reset_mlp(model.item_mlp, nn.init.xavier_uniform_, generator)
    reset_mlp(model.head, nn.init.xavier_uniform_, generator)


def dense_param_count(cfg: HSTUConfig) -> int:
    with torch.device("meta"):
        model = HSTU(cfg)
    return sum(p.numel() for p in dense_parameters(model))


def param_count(cfg: HSTUConfig) -> int:
    return dense_param_count(cfg) + cfg.rows * cfg.table_dim


def lookups_per_sample(cfg: HSTUConfig) -> int:
    """Rows one full-length sample looks up: each contextual table once, each sequence table at every
    history event and candidate (max_seq_len less the contextual tokens)."""
    return cfg.contextual_len + (cfg.max_seq_len - cfg.contextual_len) * len(cfg.features.sequence)


def active_param_count(cfg: HSTUConfig) -> int:
    return dense_param_count(cfg) + lookups_per_sample(cfg) * cfg.table_dim


def block_params(cfg: HSTUConfig) -> int:
    """One STU layer."""
    width = (2 * cfg.linear_dim + 2 * cfg.qk_dim) * cfg.heads
    hv = cfg.heads * cfg.linear_dim
    return cfg.dim * width + width + 2 * cfg.dim + 3 * hv * cfg.dim + 2 * hv


# The reference's FLOP accounting (modules/dlrm_hstu.py:292-445, README.MD:528-575): per STU layer, 2 FLOPs
# per multiply-add; x3 forward+backward on the UVQK and output projections; x3.5 on the attention's two
# matmuls (its backward needs about 5), over S^2/2 pairs (causal). Embedding lookups, norms, gating, the
# preprocessor, item MLP and head are left out, except the head's last Linear(D, tasks).
FLOPS_PER_MAC, GEMM_FWD_BWD, ATTN_FWD_BWD = 2.0, 3.0, 3.5


def _layer_flops(cfg: HSTUConfig, tokens: float, tokens_sq: float) -> float:
    h, dv, dqk, d = cfg.heads, cfg.linear_dim, cfg.qk_dim, cfg.dim
    gemm, attn = FLOPS_PER_MAC * GEMM_FWD_BWD, FLOPS_PER_MAC * ATTN_FWD_BWD
    uvqk = gemm * tokens * d * (2 * dv + 2 * dqk) * h
    attention = attn * (tokens_sq / 2) * h * (dqk + dv)
    out = gemm * tokens * (3 * h * dv) * d
    return uvqk + attention + out


def flops_per_sample(cfg: HSTUConfig, seq_len: int | None = None, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) of one sample of `seq_len` tokens (default max_seq_len), as
    DlrmHSTU.get_num_flops_per_sample counts them: 315.7 GFLOP at the reference shape. `causal=False`
    counts the full S^2 score matrix (what the padded PyTorch path computes)."""
    s = float(cfg.max_seq_len if seq_len is None else seq_len)
    sq = s * s if causal else 2 * s * s
    return cfg.layers * _layer_flops(cfg, s, sq) + FLOPS_PER_MAC * GEMM_FWD_BWD * 1 * cfg.dim


def jagged_flops_per_sample(cfg: HSTUConfig, lengths: torch.Tensor) -> float:
    """The same for a batch's real sequence lengths (contextual + history + candidates), averaged per
    sample: mean(s) for the projections, mean(s^2) for attention (_compute_jagged_flops_per_sample)."""
    s = lengths.double()
    flops = cfg.layers * _layer_flops(cfg, float(s.mean()), float((s * s).mean()))
    return flops + FLOPS_PER_MAC * GEMM_FWD_BWD * 1 * cfg.dim


def activation_elements(cfg: HSTUConfig) -> float:
    """Elements one STU layer keeps per token for the backward (an estimate): x, its norm, uvqk, SiLU(u),
    the attention output, its norm and the product, the concatenation, and the padded path's scores at
    max_seq_len (scores, SiLU and masked: 3 H N)."""
    width = (2 * cfg.linear_dim + 2 * cfg.qk_dim) * cfg.heads
    hv = cfg.heads * cfg.linear_dim
    return 2 * cfg.dim + width + hv * 4 + 3 * hv + 3 * cfg.heads * cfg.max_seq_len


def embedding_tables(cfg: HSTUConfig) -> EmbeddingTables:
    seq_tables = {cfg.table_index(t) for _, _, t in cfg.features.sequence}
    per_table = cfg.max_seq_len - cfg.contextual_len
    hots = tuple(per_table if t in seq_tables else 1 for t in range(len(cfg.tables)))
    kept = cfg.layers * activation_elements(cfg) * cfg.max_seq_len + lookups_per_sample(cfg) * cfg.table_dim
    return EmbeddingTables(
        cfg.table_sizes, hots, cfg.table_dim, float(kept), pooled=False, dense_params=dense_param_count(cfg),
        rowwise=True,  # the reference's RowWiseAdagrad on the tables, Adam on the rest
    )  # fmt: skip


FAMILY = ModelFamily(
    name="hstu",
    build=HSTU,
    init=init,
    param_count=param_count,
    active_param_count=active_param_count,
    flops_per_token=flops_per_sample,
    block_params=block_params,
    activation_elements=activation_elements,
    embedding_tables=embedding_tables,
    table_parameters=table_parameters,
)
