"""The qwen3_5_moe family's tensor-parallel plan (`--parallel tp=T,ep=E[,fsdp=F]` or `tp=T,fsdp=F`,
`ModelFamily.tensor_parallel`), the design of the gpt_oss plan (models/gpt_oss/parallelize.py) with Qwen3.5's
two token mixers, whole heads per TP rank in both:

- gated full attention: the fused input `qkv` (rows [q+gate | k | v], per head) column-wise, each rank the
  r-th T-th of every part side by side (a stacked layout of unequal parts, train/tensor_parallel.py), so it
  holds whole KV groups with their query heads and gates (n_kv_heads must divide by T); the per-head QK-norms
  (one weight shared by the heads) read as cut along the heads, so their weight's gradient is a `Partial()`
  sum over the TP ranks (as gpt_oss's); `o_proj` row-wise;
- Gated DeltaNet: its fused input projection (rows [q | k | v | z | b | a]) column-wise, stacked the same
  way, so a rank holds lin_k_heads / T key heads with the lin_v_heads / T value heads they serve (key head j
  serves value heads j*G .. j*G + G - 1, G = lin_v_heads / lin_k_heads: the r-th T-th of each are the same
  groups), their output gates and their write-strength and decay logits; the depthwise short convolution's
  channels ([q | k | v], one filter each) and the per-value-head `dt_bias` and `A_log` sharded alike, so
  the convolution and the delta rule run locally on whole heads; the gated per-head output norm's weight
  (shared by the value heads) replicated with its inputs read as cut along the heads (its gradient a
  `Partial()` sum); `out_proj` row-wise. The model reads the convolution and decay parameters as plain
  tensors: during the DeltaNet's forward they are this rank's local shards (`_local_parameters`), whose
  gradients autograd hands back to the sharded parameters;
- the MoE's softmax router and routed experts are NOT cut by TP: its input is all-gathered along the
  sequence (`moe_gathered`), every TP rank routes the same whole tokens the same way, expert parallelism
  splits the routed experts over the data-parallel ranks, one expert-parallel group per TP index. The gated
  shared expert's SwiGLU is cut as a dense one (`shared_expert_cut`: shared_ffn_dim must divide by T), its
  output summed over the TP ranks; its gate (`[dim] -> 1`, a sigmoid per token) stays replicated: it reads
  the whole tokens and scales the summed output, so its gradient is whole and equal on the TP ranks, as
  the router's;
- the block norms sequence-parallel, the residual stream cut along the sequence between blocks; the
  embedding whole, its output cut, the final norm gathering it (models/common/sequence_parallel.py).

Training only: decoding (generate.py, GRPO's rollouts) and context parallelism's DeltaNet forward
(train/context_parallel_deltanet.py) are not planned under TP.
"""

from __future__ import annotations

from torch import nn

from timetotrain.models.family import TP_STACKED_OVER, TP_STACKED_PARTS, check_divides

# The DeltaNet's own parameters, indexed by channel or value head: sharded along dim 0, read locally.
_DELTANET_SHARDED = ("conv_weight", "dt_bias", "A_log")


def check_shape(cfg, tp: int) -> None:
    """One line naming what does not divide: the full attention's KV heads, the DeltaNet's key heads
    (their value heads then divide too) and the shared expert's width (the routed experts are not cut by
    TP)."""
    check_divides(
        tp,
        [
            ("n_kv_heads", cfg.n_kv_heads, "layers.*.attn.qkv.weight"),
            ("lin_k_heads", cfg.lin_k_heads, "layers.*.attn.in_proj.weight"),
            ("shared_ffn_dim", cfg.shared_ffn_dim, "layers.*.ffn.shared.ffn.fc1.weight"),
        ],
    )


def tensor_parallel(model: nn.Module, tp_mesh, colwise=None, rowwise=None) -> None:
    """Parallelise `model` (a `Qwen35Moe`) over the 1-D `tp_mesh`, in place; works on the meta device.
    `colwise` / `rowwise`: the parallel style classes of the cut linears when the harness swapped them
    (float8's); torch's ColwiseParallel / RowwiseParallel by default."""
    # heavy (0.5 s): only --parallel tp
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from timetotrain.models.common.sequence_parallel import (
        gathered,
        moe_gathered,
        sequence_parallel_ends,
        shared_expert_cut,
    )

    colwise, rowwise = colwise or ColwiseParallel, rowwise or RowwiseParallel
    tp = tp_mesh.size()
    check_shape(model.cfg, tp)
    sequence_parallel_ends(model, tp_mesh)
    for block in model.layers:
        attn = block.attn
        plan = {
            "attn_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "ffn": moe_gathered(),
            **shared_expert_cut(block.ffn.shared.ffn, "ffn.shared.ffn", tp, colwise, rowwise),
        }
        if block.full_attention:  # attn(x, cos, sin, cache, mask)
            plan["attn"] = gathered(5)
            plan["attn.qkv"] = colwise()
            plan["attn.o_proj"] = rowwise(output_layouts=Shard(1), use_local_output=False)
            # [B, T, heads, head_dim]: this rank's heads (dim 2)
            plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            _stack(attn.qkv, tp, weight=attn.qkv_sizes)
        else:  # attn(x, state, valid)
            plan["attn"] = gathered(3)
            plan["attn.in_proj"] = colwise()
            plan["attn.out_proj"] = rowwise(output_layouts=Shard(1), use_local_output=False)
            key, value = attn.k_heads * attn.k_dim, attn.v_heads * attn.v_dim
            _stack(attn.in_proj, tp, weight=(key, key, value, value, attn.v_heads, attn.v_heads))
            _stack(attn, tp, conv_weight=(key, key, value))
        parallelize_module(block, tp_mesh, plan)
        if block.full_attention:
            attn.n_heads //= tp
            attn.n_kv_heads //= tp
            attn.qkv_sizes = [rows // tp for rows in attn.qkv_sizes]
        else:
            _deltanet(attn, tp_mesh)


def _stack(module: nn.Module, tp: int, **parts) -> None:
    """Mark `module`'s parameters as stacked sub-tensors of these rows (train/tensor_parallel.py)."""
    setattr(module, TP_STACKED_OVER, tp)
    setattr(module, TP_STACKED_PARTS, {name: tuple(rows) for name, rows in parts.items()})


def _deltanet(attn: nn.Module, tp_mesh) -> None:
    """The DeltaNet's own parameters sharded by channel / value head and read locally, its gated norm's weight
    replicated over inputs cut along the heads (module docstring); its sizes this rank's."""
    from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor

    tp = tp_mesh.size()
    for name in _DELTANET_SHARDED:
        p = attn._parameters[name]
        attn.register_parameter(
            name, nn.Parameter(distribute_tensor(p, tp_mesh, [Shard(0)]), p.requires_grad)
        )

    def heads_cut(module, inputs, mesh):  # GatedRMSNorm(x, gate), both [B, T, value heads, v_dim]
        return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in inputs)

    distribute_module(
        attn.norm, tp_mesh, input_fn=heads_cut, output_fn=lambda module, out, mesh: out.to_local()
    )
    attn.register_forward_pre_hook(_local_parameters)
    attn.register_forward_hook(_sharded_parameters)
    attn.k_heads //= tp
    attn.v_heads //= tp
    attn.in_sizes = [rows // tp for rows in attn.in_sizes]


def _local_parameters(module: nn.Module, inputs) -> None:
    """Before the DeltaNet's forward: its sharded parameters read as this rank's local tensors (an instance
    attribute shadows the registered parameter; `to_local` is differentiable, so the gradients reach the
    DTensors), as the model computes on plain tensors."""
    for name in _DELTANET_SHARDED:
        module.__dict__[name] = module._parameters[name].to_local()


def _sharded_parameters(module: nn.Module, inputs, output) -> None:
    for name in _DELTANET_SHARDED:
        module.__dict__.pop(name, None)
