"""DLRM-DCNv2 sizes: the MLPerf reference's (recommendation_v2/torchrec_dlrm/README.MD run command, the
materialized multi-hot dataset) and the tiers' scaled-down ones. No model code here."""

from __future__ import annotations

from dataclasses import dataclass

# Rows of the 26 categorical tables (--num_embeddings_per_feature of the reference run, README.MD:159) and
# the fixed number of ids per sample of each (--multi_hot_sizes, materialize_synthetic_multihot_dataset.py:92).
CRITEO_TABLE_SIZES = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282, 10,
    2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36,
)  # fmt: skip
CRITEO_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
DENSE_FEATURES = 13  # torchrec.datasets.criteo.DEFAULT_INT_NAMES


@dataclass(frozen=True)
class DLRMConfig:
    table_sizes: tuple[int, ...] = CRITEO_TABLE_SIZES
    multi_hot: tuple[int, ...] = CRITEO_MULTI_HOT
    dim: int = 128  # --embedding_dim
    dense_in: int = DENSE_FEATURES
    bottom: tuple[int, ...] = (512, 256, 128)  # --dense_arch_layer_sizes; the last equals `dim`
    top: tuple[int, ...] = (1024, 1024, 512, 256, 1)  # --over_arch_layer_sizes
    dcn_layers: int = 3  # --dcn_num_layers
    dcn_rank: int = 512  # --dcn_low_rank_dim

    def __post_init__(self) -> None:
        if len(self.table_sizes) != len(self.multi_hot):
            raise ValueError("one multi-hot size per table")
        if self.bottom[-1] != self.dim:
            raise ValueError("the bottom MLP must end at the embedding dim (the interaction stacks them)")
        if self.top[-1] != 1:
            raise ValueError("the top MLP ends in one logit")

    @property
    def tables(self) -> int:
        return len(self.table_sizes)

    @property
    def rows(self) -> int:
        return sum(self.table_sizes)

    @property
    def hots(self) -> int:
        """Ids one sample looks up, over all tables."""
        return sum(self.multi_hot)

    @property
    def interaction_dim(self) -> int:
        return (self.tables + 1) * self.dim
