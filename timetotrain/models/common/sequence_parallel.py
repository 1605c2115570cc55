"""What every decoder family's tensor-parallel plan shares (models/llama/parallelize.py,
models/gpt_oss/parallelize.py): the residual stream between blocks is a DTensor cut along the sequence
(`Shard(1)`, Megatron's sequence parallelism); the embedding stays whole and its output is cut, the final
norm gathers the sequence back so the head and its fused loss see plain tensors, and a module that needs
whole tokens (attention's QKV, a dense FFN, an MoE) gathers its first input."""

from __future__ import annotations

from torch import nn

# torch's TP package is heavy (0.5 s): the plans import this module inside their function, under --parallel tp.
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    parallelize_module,
)

from timetotrain.models.family import TP_STACKED_OVER


def gathered(n_inputs: int = 1) -> PrepareModuleInput:
    """The style of a module whose first input arrives cut along the sequence and must be whole (an
    all-gather), the other `n_inputs - 1` passed through; the module sees plain tensors."""
    rest = (None,) * (n_inputs - 1)
    return PrepareModuleInput(
        input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest), use_local_output=True
    )


def moe_gathered() -> PrepareModuleInputOutput:
    """The style of an MoE block whose router and routed experts TP does not cut (models/gpt_oss/
    parallelize.py says why): its input all-gathered along the sequence, so that every TP rank of a group
    routes the same whole tokens the same way and runs the same routed experts on them; its output, whole
    and equal on the TP ranks, cut back along the sequence (a local slice, whose backward all-gathers the
    gradient: the router's and the experts' gradients are whole and equal on the TP ranks, with no TP
    collective of their own). A shared expert inside may be cut (`shared_expert_cut`)."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=False,
    )


def shared_expert_cut(ffn: nn.Module, path: str, tp: int, colwise, rowwise) -> dict:
    """The plan entries of an MoE's shared SwiGLU `ffn` (at `path` in the block) cut as a dense one, on the
    whole tokens `moe_gathered` hands the MoE (Megatron's TP SharedExpertMLP): `fc1` column-wise with this
    rank's gate and up rows side by side (a stacked layout, train/tensor_parallel.py), `fc2` row-wise with
    its partial outputs all-reduced, so the MoE adds a whole output, equal on the TP ranks, to the routed
    one. An all-reduce rather than a reduce-scatter into this rank's sequence part: the MoE's output is one
    whole tensor that `moe_gathered` slices, so the sum must be whole there. The column cut's input
    gradient is all-reduced by its style, so the tokens' gradient is whole, as the router's path needs."""
    setattr(ffn.fc1, TP_STACKED_OVER, tp)  # gate and up rows side by side per rank
    return {f"{path}.fc1": colwise(), f"{path}.fc2": rowwise()}


def sequence_parallel_ends(model: nn.Module, tp_mesh) -> None:
    """The embedding's whole output cut along the sequence for the first block; the final norm's input
    gathered back (module docstring)."""
    parallelize_module(
        model.embed,
        tp_mesh,
        PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        ),
    )
    parallelize_module(model.norm, tp_mesh, gathered())


def grad_summed(t, tp_mesh):
    """`t` (a plain tensor, the same on every TP rank) unchanged, its gradient summed over the TP ranks in
    the backward (Megatron's "copy to the tensor-parallel region"): for a whole tensor that this rank's
    heads alone read, so that each rank's gradient of it is only its heads' part (MLA's one rotary key)."""
    from torch.distributed.tensor import DTensor, Partial

    whole = DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
    return whole.to_local(grad_placements=[Partial()])
