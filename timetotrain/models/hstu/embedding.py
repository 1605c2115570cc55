"""HSTU's embedding tables: `models/common/embedding.FusedEmbedding` (unpooled, one row per id). It lives in
common so that the harness can shard it by module type (train/embedding_parallel.py) without naming a
family."""

from timetotrain.models.common.embedding import FusedEmbedding

__all__ = ["FusedEmbedding"]
