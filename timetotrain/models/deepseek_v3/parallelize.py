"""The deepseek_v3 family's tensor-parallel plan (`--parallel tp=T,ep=E[,fsdp=F]` or `tp=T,fsdp=F`,
`ModelFamily.tensor_parallel`), the design of the gpt_oss plan (models/gpt_oss/parallelize.py) with MLA, the
dense-first layers and MTP:

- Multi-head Latent Attention, cut by heads as Megatron and torchtitan cut it: the down-projections to the
  latents (`q_down`, `kv_down`) and their norms are replicated (plain tensors, the same on every TP rank:
  they map the whole hidden state to a small latent every head reads); the up-projections (`q_up`,
  `kv_up`) column-wise, whole heads per rank (their rows are grouped per head, so n_heads must divide by
  T); the output `proj` row-wise. The column-wise inputs' gradients are all-reduced by their style, so the
  replicated down-projections and norms get whole gradients, equal on the TP ranks. One thing bypasses an
  up-projection: the last `qk_rope_dim` outputs of `kv_down`, ONE rotary key every head reads. This rank's
  heads give only their part of its gradient, so its gradient is summed over the TP ranks in the backward
  (`grad_summed`, a hook on `kv_down`; without it the replicated `kv_down` would train on 1/T of it);
- the dense-first layers' SwiGLU as the llama plan cuts it (`fc1` column-wise, gate and up rows stacked per
  rank, `fc2` row-wise: ffn_dim must divide by T);
- the MoE blocks' router (group-limited, with its balancing bias) and routed experts are NOT cut by TP:
  their input is all-gathered along the sequence (`moe_gathered`), so every TP rank routes the same whole
  tokens the same way, and expert parallelism splits the routed experts over the data-parallel ranks, one
  expert-parallel group per TP index. The shared expert is cut as the dense SwiGLU (`shared_expert_cut`,
  Megatron's TP SharedExpertMLP: its width must divide by T) on those whole tokens, its output summed over
  the TP ranks before it joins the routed output. The routers' loads, summed
  over all ranks for the auxiliary-loss-free bias step, count each token T times: the step is the sign of
  (mean load - load), the same for any common factor; the sequence aux loss is computed on whole tokens;
- the block norms sequence-parallel, the residual stream cut along the sequence between blocks; the
  embedding whole, its output cut, the final norm gathering it (models/common/sequence_parallel.py);
- MTP: each depth's `enorm` / `hnorm` / `eh_proj` run replicated on the whole sequence (the embedding of the
  tokens ahead gathered back to whole tokens; the trunk's normed output is whole already), `eh_proj`'s
  output is cut along the sequence for the depth's block, which is planned as a trunk block, and the depth's
  norm gathers it back for the shared head.
"""

from __future__ import annotations

import torch
from torch import nn

from timetotrain.models.common.moe import MoE
from timetotrain.models.family import TP_STACKED_OVER, check_divides


def check_shape(cfg, tp: int) -> None:
    """One line naming what does not divide: MLA's heads, the dense-first layers' FFN width and the shared
    experts' width (the routed experts are not cut by TP)."""
    sizes = [("n_heads", cfg.n_heads, "layers.*.attn.q_up.weight")]
    if cfg.first_dense:
        sizes.append(("ffn_dim", cfg.ffn_dim, "layers.0.ffn.fc1.weight"))
    if cfg.n_shared_experts:
        shared = cfg.n_shared_experts * cfg.expert_ffn_dim
        sizes.append(("the shared experts' width", shared, "layers.*.ffn.shared.fc1.weight"))
    check_divides(tp, sizes)


def tensor_parallel(model: nn.Module, tp_mesh, colwise=None, rowwise=None) -> None:
    """Parallelise `model` (a `DeepSeekV3`) over the 1-D `tp_mesh`, in place; works on the meta device.
    `colwise` / `rowwise`: the parallel style classes of the cut linears when the harness swapped them
    (float8's); torch's ColwiseParallel / RowwiseParallel by default."""
    # heavy (0.5 s): only --parallel tp
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    from timetotrain.models.common.sequence_parallel import gathered, sequence_parallel_ends

    colwise, rowwise = colwise or ColwiseParallel, rowwise or RowwiseParallel
    check_shape(model.cfg, tp_mesh.size())
    sequence_parallel_ends(model, tp_mesh)
    for block in model.layers:
        _block(block, tp_mesh, colwise, rowwise)
    for depth in model.mtp:  # forward(h, next_embed, cos, sin, mask)
        parallelize_module(
            depth,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(None, Shard(1), None, None, None),
                desired_input_layouts=(None, Replicate(), None, None, None),
                use_local_output=True,
            ),
        )
        cut = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        )
        parallelize_module(depth, tp_mesh, {"eh_proj": cut, "norm": gathered()})
        _block(depth.block, tp_mesh, colwise, rowwise)


def _block(block: nn.Module, tp_mesh, colwise, rowwise) -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from timetotrain.models.common.sequence_parallel import (
        gathered,
        grad_summed,
        moe_gathered,
        shared_expert_cut,
    )

    tp = tp_mesh.size()
    plan = {
        "attn_norm": SequenceParallel(),
        "attn": gathered(4),  # (x, cos, sin, mask)
        "attn.q_up": colwise(),
        "attn.kv_up": colwise(),
        "attn.proj": rowwise(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
    }
    if isinstance(block.ffn, MoE):
        plan["ffn"] = moe_gathered()
        if block.ffn.shared is not None:
            plan.update(shared_expert_cut(block.ffn.shared, "ffn.shared", tp, colwise, rowwise))
    else:
        plan["ffn"] = gathered()
        plan["ffn.fc1"] = colwise()
        plan["ffn.fc2"] = rowwise(output_layouts=Shard(1), use_local_output=False)
        setattr(block.ffn.fc1, TP_STACKED_OVER, tp)  # gate and up rows side by side per rank
    parallelize_module(block, tp_mesh, plan)
    attn = block.attn
    rope = attn.rope

    def rotary_key_grad_summed(module, inputs, out):
        latent, key = out.split([out.shape[-1] - rope, rope], dim=-1)
        return torch.cat((latent, grad_summed(key, tp_mesh)), dim=-1)

    attn.kv_down.register_forward_hook(rotary_key_grad_summed)
    attn.n_heads //= tp
