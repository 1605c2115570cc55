"""The llama family's tensor-parallel plan (`--parallel tp=T[,fsdp=F]`, `ModelFamily.tensor_parallel`),
Megatron-style as torchtitan applies it, with PyTorch's DTensor `parallelize_module`:

- per block: the fused QKV and the fused SwiGLU input (`fc1`) column-wise, the attention output (`proj`) and
  the FFN output (`fc2`) row-wise; the two block norms sequence-parallel, so the residual stream between
  the row-wise outputs and the next column-wise inputs is a DTensor cut along the sequence (`Shard(1)`):
  a reduce-scatter after each row-wise layer and an all-gather before each column-wise one;
- the embedding stays whole on every TP rank and its output is cut along the sequence; the final norm
  gathers the sequence back, so the head and its fused loss (models/common/head_loss.py) see plain tensors.

Layouts. The fused QKV rows are grouped per KV head (models/common/layers.py), so a column-wise cut into T
contiguous parts gives each rank whole KV groups (n_kv_heads must divide by T) and the attention runs
locally on n_heads / T query heads. `fc1` holds all gate rows, then all up rows: its module is marked
`TP_STACKED_OVER` so that the harness reads its DTensor as [gate_0, up_0, gate_1, up_1, ...], each rank's
local rows [gate_r; up_r], which the model's SwiGLU splits in halves as it does unsharded
(train/tensor_parallel.py fills and gathers that layout).
"""

from __future__ import annotations

from torch import nn

from timetotrain.errors import UserError
from timetotrain.models.common.lora import is_adapted
from timetotrain.models.family import TP_STACKED_OVER, check_divides


def check_shape(cfg, tp: int) -> None:
    """One line naming what does not divide: heads and FFN width must split evenly over the TP ranks."""
    check_divides(
        tp,
        [
            ("n_kv_heads", cfg.n_kv_heads, "layers.*.attn.qkv.weight"),
            ("ffn_dim", cfg.ffn_dim, "layers.*.ffn.fc1.weight"),
        ],
    )


def tensor_parallel(model: nn.Module, tp_mesh, colwise=None, rowwise=None) -> None:
    """Parallelise `model` (a `models.common.decoder.Decoder` with dense FFNs) over the 1-D `tp_mesh`, in place;
    works on the meta device (before `to_empty`). `colwise` / `rowwise`: the parallel style classes of the
    block linears when the harness swapped them for others (float8's, which scale a sharded input by its
    global amax); torch's ColwiseParallel / RowwiseParallel by default."""
    # heavy (0.5 s): only --parallel tp, and every command that names a llama benchmark imports this family
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from timetotrain.models.common.lora_parallel import parallelize_adapted
    from timetotrain.models.common.sequence_parallel import gathered, sequence_parallel_ends

    colwise, rowwise = colwise or ColwiseParallel, rowwise or RowwiseParallel
    tp = tp_mesh.size()
    check_shape(model.cfg, tp)
    # The embedding's whole output cut along the sequence for the first block, the final norm's gathered.
    sequence_parallel_ends(model, tp_mesh)
    for block in model.layers:
        if not hasattr(block.ffn, "fc1"):
            raise UserError("--parallel tp: only dense (SwiGLU) blocks have a tensor-parallel plan, not MoE")
        plan = {
            "attn_norm": SequenceParallel(),
            "attn": gathered(4),  # (x, cos, sin, mask)
            "ffn_norm": SequenceParallel(),
            "ffn": gathered(),
        }
        linears = {
            "attn.qkv": colwise(),
            "attn.proj": rowwise(output_layouts=Shard(1), use_local_output=False),
            "ffn.fc1": colwise(),
            "ffn.fc2": rowwise(output_layouts=Shard(1), use_local_output=False),
        }
        # The modules whose weights `ffn.fc1`'s column cut splits: the linear, or its base and the adapters'
        # B under LoRA (whose B rows hold gate then up rows as the base's do).
        fc1_rows = [block.ffn.fc1]
        for name, style in linears.items():
            module = block.get_submodule(name)
            if is_adapted(module):  # LoRA: the base cut as a plain linear, the adapters placed beside it
                rows = parallelize_adapted(module, tp_mesh, style)
                fc1_rows = rows if name == "ffn.fc1" else fc1_rows
            else:
                plan[name] = style
        parallelize_module(block, tp_mesh, plan)
        # Gate and up rows side by side per rank (module docstring); on the module: FSDP2 and to_empty
        # replace the parameter.
        for module in fc1_rows:
            setattr(module, TP_STACKED_OVER, tp)
        # The attention computes on this rank's heads (whole KV groups, see the module docstring).
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
        if block.attn.q_norm is not None:
            raise UserError("--parallel tp: attention with QK-norm has no tensor-parallel plan yet")
