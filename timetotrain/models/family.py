"""What the harness may ask of a model family, as one record of functions, so that the timed loop,
`ttt synth` and `ttt plan` never import a family by name.

All of them take the family's config dataclass (a tier's `model`):
- `build(cfg)`: the module, called under a meta-device context by the harness (must not touch weights);
- `init(model, generator)`: the benchmark's own initialisation, in place, after `to_empty`;
- `param_count(cfg)` / `active_param_count(cfg)`: all trainable parameters / those one token touches
  (equal for dense models; MoE models count `top_k` experts);
- `flops_per_token(cfg, seq_len, causal)`: training FLOPs per token (forward + backward);
- `block_params(cfg)` and `activation_elements(cfg)`: one repeated block's parameters, and the elements
  autograd keeps per token for it, for `ttt plan`'s memory model;
- `telemetry(model)`: optional figures read at each eval point: ({log key: value}, short text), or None;
- `hf_mapping(cfg)`: optional, our parameter name -> `Source` (the Hugging Face tensors it is built from,
  with alternative checkpoint layouts), for `train/checkpoint.load_hf_checkpoint`;
- `hf_export(state_dict, cfg)`: optional, the other direction: (Hugging Face state dict, its config.json
  as a dict), for the bases `ttt base` writes (`train/base_model.py`).
- `activation_bytes(cfg, samples, act_bytes, ac)`: optional, the bytes autograd keeps for a micro-batch of
  `samples`, for a model that is not a decoder (blocks plus an LM head, which `ttt plan` counts from
  `activation_elements`); `ttt plan` uses it instead (flux);
- `with_layers(cfg, n)`: optional, the config with `n` blocks at the same width, for `ttt synth --layers`
  where replacing an `n_layers` field is not the meaning (flux: double and single blocks in proportion);
- `tensor_parallel(model, tp_mesh, colwise=None, rowwise=None)`: optional, the family's tensor-parallel
  plan: parallelise the model (built on the meta device) over the 1-D `tp_mesh` in place, with
  torch.distributed APIs only (`colwise`/`rowwise`: other style classes for the block linears, e.g.
  float8's, which the harness passes), setting
  `TP_STACKED_OVER` on modules whose weight stacks two sub-tensors (train/tensor_parallel.py); None means
  `--parallel tp` is refused for the family;
- `tensor_parallel_check(cfg, tp)`: optional, the plan's own shape check without a model (a UserError
  naming what does not divide), which `ttt plan` asks before it estimates a TP layout;
- `tensor_parallel_elements(cfg, tp)`: optional, `activation_elements` per token on one rank under the
  family's TP plan, for a plan that does not cut the whole block (gpt_oss: the MoE runs whole on every TP
  rank; deepseek_v3, qwen3_5_moe: all of it but the shared experts); None: the memory model's Megatron count
  (1/tp, the column-wise inputs whole);
- `tensor_parallel_whole(cfg)`: optional, (the model's parameters besides the routed experts that the family's
  TP plan leaves whole on every TP rank, so that FSDP2 shards them over its ranks only: the embedding, head
  and final norm, the routers, and DeepSeek-V3's MLA down-projections, latent norms and MTP projections,
  qwen3_5_moe's shared-expert gates; those of one MoE block; the shared experts' SwiGLUs are cut), for `ttt plan`'s tp x ep count;
  None: the embedding, head and final norm (the total less `n_layers` blocks) and the routers (gpt_oss);
- `peak_block_elements(cfg)`: optional, for a stack of unlike blocks (qwen3_5_moe's hybrid layers), the
  largest block's `activation_elements`: activation checkpointing recomputes one block at a time, so the
  largest one is the peak (None: `activation_elements`, the blocks being alike);
- `decode_state_bytes(cfg, capacity, act_bytes)`: optional, the bytes one sequence's decode state holds at
  `capacity` tokens (KV cache, recurrent state), for `ttt plan` of a task that decodes (GRPO's rollouts);
- `root_params(cfg, experts)`: optional, the parameters outside `model.layers` (FSDP2's root group), for a
  family whose layers are not all `block_params` (DeepSeek-V3: dense-first layers, MTP blocks); None: the
  total less `n_layers` blocks.
- `stage_costs(cfg)`: optional, (each of `model.layers`' matmul parameters one token uses, those of the
  last stage's head and whatever else it holds) for a pipeline's split (train/pipeline.py), for a family
  whose layers differ (DeepSeek-V3: dense-first layers, top-k experts, MTP beside the head); None: every
  layer `block_params`, the head `dim x vocab`.
- `embedding_tables(cfg)`: optional, the family's embedding tables (an `EmbeddingTables`) held in a
  `models/common/embedding_bag.FusedEmbeddingBag` (pooled) or `models/common/embedding.FusedEmbedding`
  (one row per id), which the harness shards by rows over the
  data-parallel ranks (train/embedding_parallel.py) and `ttt plan` counts per rank
  (train/embedding_memory.py); None: no sharded tables, every layout of the decoders applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from timetotrain.errors import UserError

# Set by a `tensor_parallel` plan on a module to the TP degree: its `weight` DTensor stands for two stacked
# sub-tensors with each rank's slices side by side (train/tensor_parallel.py reads it).
TP_STACKED_OVER = "_ttt_tp_stacked_over"
# Set beside it where the module's stacked parameters are others, or of unequal parts: {parameter name: the
# rows of each sub-tensor along dim 0, in the model's layout} (without it: `weight`, two equal halves).
TP_STACKED_PARTS = "_ttt_tp_stacked_parts"


def check_divides(tp: int, sizes: list[tuple[str, int, str]]) -> None:
    """A TP plan's shape check (`tensor_parallel_check`): one line naming each of `sizes` (what, its size,
    the tensor a column cut would split unevenly) that `tp` does not divide."""
    problems = [f"{what} {n} ({where})" for what, n, where in sizes if n % tp]
    if problems:
        raise UserError(f"--parallel tp={tp}: {' and '.join(problems)} of the model do not divide by {tp}")


@dataclass(frozen=True)
class EmbeddingTables:
    """What the harness needs to know of a family's embedding tables, without importing the family."""

    sizes: tuple[int, ...]  # rows of each table
    hots: tuple[int, ...]  # ids one sample looks up in each table
    dim: int
    # Elements the rest of the model keeps per sample for the backward (the pooled rows included).
    sample_activation_elements: float
    # False: one row per id (hstu's models/common/embedding.FusedEmbedding), exchanged rows per id; True: bags
    # summed per sample (DLRM's FusedEmbeddingBag), exchanged as pooled rows.
    pooled: bool = True
    # The parameters outside the tables (data-parallel); None: the family's `block_params` (DLRM's whole
    # dense part is its one "block").
    dense_params: int | None = None
    # The tables' optimizer keeps one accumulator per row (row-wise Adagrad, whatever the benchmark's dense
    # optimizer); None: the benchmark's `Optimizer.rowwise` says.
    rowwise: bool | None = None


@dataclass(frozen=True)
class ModelFamily:
    name: str
    build: Callable[[Any], Any]
    init: Callable[[Any, Any], None]
    param_count: Callable[[Any], int]
    active_param_count: Callable[[Any], int]
    flops_per_token: Callable[..., float]
    block_params: Callable[[Any], int]
    activation_elements: Callable[[Any], float]
    telemetry: Callable[[Any], tuple[dict, str]] | None = None
    hf_mapping: Callable[[Any], dict] | None = None
    hf_export: Callable[[dict, Any], tuple[dict, dict]] | None = None
    activation_bytes: Callable[[Any, int, int, bool], float] | None = None
    with_layers: Callable[[Any, int], Any] | None = None
    tensor_parallel: Callable[[Any, Any], None] | None = None
    tensor_parallel_check: Callable[[Any, int], None] | None = None
    tensor_parallel_elements: Callable[[Any, int], float] | None = None
    tensor_parallel_whole: Callable[[Any], tuple[int, int]] | None = None
    peak_block_elements: Callable[[Any], float] | None = None
    decode_state_bytes: Callable[[Any, int, int], float] | None = None
    root_params: Callable[[Any, bool], int] | None = None
    embedding_tables: Callable[[Any], EmbeddingTables] | None = None
    # The model's embedding-table parameters, for a benchmark whose optimizer gives them their own
    # (`spec.benchmark.Optimizer.tables`); None: the family has no tables apart.
    table_parameters: Callable[[Any], list] | None = None
    stage_costs: Callable[[Any], tuple[list[float], float]] | None = None


def _single(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


@dataclass(frozen=True)
class Source:
    """Where one of our parameters comes from: the HF tensors it needs and how to combine them.

    `combine` receives the tensors in `hf_names` order and returns our full (unsharded) tensor; the default
    passes a single tensor through. A family's mapping is `dict[our parameter name, Source]`.

    `otherwise`: another checkpoint layout of the same tensor (e.g. one fused `qkv_proj` instead of
    `q/k/v_proj`), used when the checkpoint lacks one of `hf_names`; it may have an `otherwise` of its own.
    """

    hf_names: tuple[str, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] = _single
    otherwise: Source | None = None

    def __post_init__(self) -> None:
        # A bare string would be iterated character by character; duplicates would break the bookkeeping.
        if not isinstance(self.hf_names, tuple) or not self.hf_names:
            raise TypeError(f"Source.hf_names must be a non-empty tuple, got {self.hf_names!r}")
        if len(set(self.hf_names)) != len(self.hf_names):
            raise TypeError(f"Source.hf_names has duplicates: {self.hf_names}")
        if self.combine is _single and len(self.hf_names) != 1:
            raise TypeError(f"Source with several hf_names {self.hf_names} needs a combine function")
        if self.otherwise is not None and not isinstance(self.otherwise, Source):
            raise TypeError(f"Source.otherwise must be a Source or None, got {self.otherwise!r}")

    def layouts(self) -> list[Source]:
        """This source and its alternatives, in the order they are tried."""
        chain, src = [], self
        while src is not None:
            chain.append(src)
            src = src.otherwise
        return chain
