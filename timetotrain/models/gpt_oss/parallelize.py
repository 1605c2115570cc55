"""The gpt_oss family's tensor-parallel plan (`--parallel tp=T,ep=E[,fsdp=F]` or `tp=T,fsdp=F`,
`ModelFamily.tensor_parallel`): attention cut Megatron-style, the MoE block whole on every TP rank.

- per block: the fused QKV column-wise (whole KV groups per rank: n_kv_heads must divide by T), the
  attention output row-wise; the two block norms sequence-parallel, so the residual stream is a DTensor
  cut along the sequence (`Shard(1)`) between blocks, as in the llama plan (models/llama/parallelize.py);
- the per-head QK-norms (one weight shared by every head) see this rank's heads only: their weight is a
  replicated DTensor and their input is read as cut along the heads (`Shard(2)`), so the weight's gradient
  is a `Partial()` sum over the TP ranks that FSDP2, or `tensor_parallel.replicate_partial_grads`, sums;
- the MoE block (router and routed experts) is NOT cut by TP. Its input is all-gathered along the sequence
  (the boundary: the MoE norm's output, `Shard(1)` -> whole), so every TP rank of a group holds the same
  tokens, bit for bit: the router (fp32, plain tensor) computes the same logits on each and picks the same
  experts; the experts are plain tensors that expert parallelism slices over the data-parallel ranks
  (train/expert_parallel.py), one expert-parallel group per TP index. The output, whole and equal on the TP
  ranks, is cut back along the sequence (a local slice; its backward all-gathers the gradient, so the
  router and expert gradients are whole and equal on the TP ranks too, and need no TP collective).

Why the router is not cut: a column cut of the router would give each TP rank the logits of E/T experts
only, and top-k needs all of them (an all-gather of `[tokens, E]` logits per layer, the same bytes as the
all-gather of the input it saves, plus a second place where ranks could disagree). Cutting the experts by
TP as well (Megatron's expert-tensor parallelism) would cut each expert's matmuls to 1/T; real gpt-oss
submissions run experts with ETP 1, as here. The price: the TP ranks of a group compute the same MoE.

The embedding stays whole and its output is cut along the sequence; the final norm gathers it back, so
the head and its fused loss see plain tensors.
"""

from __future__ import annotations

from torch import nn

from timetotrain.models.family import check_divides


def check_shape(cfg, tp: int) -> None:
    """One line naming what does not divide: the attention's KV heads must split evenly over the TP ranks
    (the experts are not cut by TP)."""
    check_divides(tp, [("n_kv_heads", cfg.n_kv_heads, "layers.*.attn.qkv.weight")])


def tensor_parallel(model: nn.Module, tp_mesh, colwise=None, rowwise=None) -> None:
    """Parallelise `model` (a `GptOss`) over the 1-D `tp_mesh`, in place; works on the meta device.
    `colwise` / `rowwise`: the parallel style classes of the attention linears when the harness swapped
    them (float8's); torch's ColwiseParallel / RowwiseParallel by default."""
    # heavy (0.5 s): only --parallel tp
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from timetotrain.models.common.sequence_parallel import gathered, moe_gathered, sequence_parallel_ends

    colwise, rowwise = colwise or ColwiseParallel, rowwise or RowwiseParallel
    tp = tp_mesh.size()
    check_shape(model.cfg, tp)
    sequence_parallel_ends(model, tp_mesh)
    for block in model.layers:
        plan = {
            "attn_norm": SequenceParallel(),
            "attn": gathered(4),  # (x, cos, sin, mask)
            "attn.qkv": colwise(),
            "attn.proj": rowwise(output_layouts=Shard(1), use_local_output=False),
            "ffn_norm": SequenceParallel(),
            # The MoE's boundary (module docstring): whole tokens in, the sequence cut again out.
            "ffn": moe_gathered(),
        }
        if block.attn.q_norm is not None:  # [B, T, heads, head_dim]: this rank's heads (dim 2)
            plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
