"""HSTU sizes: the dlrmv4 reference's DlrmHSTU on Yambda-5B (mlcommons/training PR #889,
recommendation_v4/generative_recommenders/dlrm_v4/configs.py with train/gin/yambda_5b.gin) and small shapes
for tests and the tiny tier. No model code here. Sources with lines: docs/benchmarks/dlrmv4.md ("Model")."""

from __future__ import annotations

from dataclasses import dataclass, field

# (table, rows): configs.py:761-802 (item, artist, album, uid) and YAMBDA_5B_CROSS_SPECS (configs.py:44-52).
YAMBDA_TABLES: tuple[tuple[str, int], ...] = (
    ("item_id", 9_390_624),
    ("artist_id", 1_293_395),
    ("album_id", 3_367_692),
    ("uid", 1_000_001),
    ("user_x_artist", 100_000_000),
    ("user_x_album", 40_000_000),
    ("user_x_hour", 24_000_000),
    ("item_x_hour", 40_000_000),
    ("artist_x_hour", 32_000_000),
    ("user_x_is_organic", 2_000_000),
    ("user_x_artist_x_hour", 40_000_000),
)
CROSS_NAMES = tuple(name for name, _ in YAMBDA_TABLES[4:])


@dataclass(frozen=True)
class Features:
    """Which input feature is what (configs.py:350-429, the "yambda" branch of get_hstu_configs).

    `contextual`: one id per sample each, in the order of `contextual_feature_to_max_length` (its own table
    each); `sequence`: the history's id features (uih name, candidate name, table), merged with the
    candidate's; `action`/`candidate_action`: the action bitmask of each history event / the label bitmask
    of each candidate; `timestamp`/`query_time`: seconds, history / candidate."""

    contextual: tuple[str, ...] = ("uid", *CROSS_NAMES)
    sequence: tuple[tuple[str, str, str], ...] = (
        ("item_id", "item_candidate_id", "item_id"),
        ("artist_id", "item_candidate_artist_id", "artist_id"),
        ("album_id", "item_candidate_album_id", "album_id"),
    )
    action: str = "action_weight"
    timestamp: str = "action_timestamp"
    candidate_action: str = "item_action_weight"
    query_time: str = "item_query_time"


@dataclass(frozen=True)
class HSTUConfig:
    tables: tuple[tuple[str, int], ...] = YAMBDA_TABLES
    table_dim: int = 512  # hstu_embedding_table_dim (HSTU_EMBEDDING_DIM, configs.py:37)
    dim: int = 512  # hstu_transducer_embedding_dim: the STU width D
    heads: int = 4  # hstu_num_heads
    linear_dim: int = 128  # hstu_attn_linear_dim: per-head U and V width
    qk_dim: int = 128  # hstu_attn_qk_dim: per-head Q and K width
    layers: int = 3  # hstu_attn_num_layers (yambda_5b.gin HSTU_NUM_LAYERS default 3)
    preprocessor_hidden: int = 256  # hstu_preprocessor_hidden_dim
    max_seq_len: int = 4096  # yambda_5b.gin MAX_SEQ_LEN: contextual + history + candidates
    input_dropout: float = 0.2  # hstu_input_dropout_ratio
    linear_dropout: float = 0.1  # hstu_linear_dropout_rate (the STU output dropout)
    action_weights: tuple[int, ...] = (1, 2, 4)  # listen_plus, like, skip bits
    action_dim: int = 8  # ContextualPreprocessor action_embedding_dim (dlrm_hstu.py)
    action_init_std: float = 0.1  # action_embedding_init_std (DlrmHSTUConfig default)
    position_buckets: int = 8192  # HSTUPositionalEncoder num_position_buckets (dlrm_hstu.py)
    time_buckets: int = 2048  # num_time_buckets
    mlp_hidden: int = 512  # the item MLP's and the prediction head's hidden width (fixed in dlrm_hstu.py)
    task_bit: int = 1  # listen_plus: TaskConfig.task_weight, the label is (bitmask & 1) > 0
    loss_scale: float = 0.2  # causal_multitask_weights
    # 0: attention as one pair of matmuls over the padded batch (the reference's PyTorch path, B H N N scores
    # kept for the backward); > 0: by query blocks of that many positions, recomputed in the backward (the
    # same function; memory B H block N, the causal upper triangle skipped). Not a reference hyperparameter.
    attention_block: int = 0
    features: Features = field(default_factory=Features)

    def __post_init__(self) -> None:
        names = [n for n, _ in self.tables]
        need = set(self.features.contextual) | {t for _, _, t in self.features.sequence}
        if len(set(names)) != len(names) or not need <= set(names):
            raise ValueError(f"tables {names} must be unique and hold every feature's table {sorted(need)}")
        if self.heads * self.linear_dim <= 0 or self.heads * self.qk_dim <= 0:
            raise ValueError("heads, linear_dim and qk_dim must be positive")

    @property
    def table_sizes(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.tables)

    @property
    def rows(self) -> int:
        return sum(self.table_sizes)

    @property
    def contextual_len(self) -> int:
        """Leading tokens of every sequence: one per contextual feature (each has max length 1)."""
        return len(self.features.contextual)

    def table_index(self, name: str) -> int:
        return [n for n, _ in self.tables].index(name)


def tiny_tables(rows: int = 64, cross_rows: int = 32) -> tuple[tuple[str, int], ...]:
    """The reference's 11 tables by name, at a few rows each (tests, the tiny tier)."""
    return tuple((name, rows if i < 4 else cross_rows) for i, (name, _) in enumerate(YAMBDA_TABLES))
