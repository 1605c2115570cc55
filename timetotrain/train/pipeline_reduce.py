"""When a pipeline stage's FSDP2 wraps reduce their gradients and reshard their parameters (`--set
pp_reduce=`, train/pipeline.py).

torch's schedule (torch/distributed/pipelining/stage.py, `backward_maybe_with_nosync`) turns FSDP2's gradient
reduction and resharding off on every FSDP2 module of a stage before each micro-batch's backward, and turns them
back on only in `perform_reduce_grad` after the step's last one: through the step a rank holds each wrap's
gradient whole in fp32 and its parameters gathered (compute precision), one reduce-scatter and no all-gather
per wrap and step. For a stage's expert slices sharded over their holders (`pp=P,ep=E,fsdp=N`, E < N:
`expert_parallel.shard_expert_replicas`) that is the whole slice twice over: DeepSeek-V3's published
`pp=4,ep=32,fsdp=64` on 80 GiB GPUs simulated 98.0 GiB (docs/scale.md, "Pipeline: expert slices reduced per
micro-batch").

`pp_reduce` chooses the wraps that instead reshard after each micro-batch's backward and reduce-scatter its
gradient there, into the shard's accumulated gradient (FSDP2's own accumulation without no-sync):
- `experts` (default): the expert slices' wraps. Their reduce-scatter runs over the N / E holders of a slice
  only (2 ranks, within a node, at the published layout), and each micro-batch gathers the slice again;
- `stage`: every wrap of the stage (its blocks and the stage root too): the blocks' gradients and gathered
  weights shrink to shards as well, for a reduce-scatter over all N ranks of the stage and two more
  all-gathers (forward, backward) per block and micro-batch;
- `step`: torch's schedule as it is.
The measured peaks (docs/scale.md) are why `experts` is the default: it brings the published layout under
the 72 GiB line, and `stage` lowers the peak further for N-rank collectives per micro-batch.

Gradients come out the same: each micro-batch's reduce-scatter divides by the wrap's factor, the sum of the
micro-batches' shares is the share of the sum, and `perform_reduce_grad` then finds those wraps' gradients
reduced already (its `post_backward` has nothing left to reduce, so nothing is reduced twice) before the
schedule's `scale_grads` divides every parameter's gradient, the shards included, by the micro-batch count
once.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward

from timetotrain.models.common.moe import MoE


def per_micro_batch(stage: nn.Module, choice: str) -> list[FSDPModule]:
    """The FSDP2 wraps of `stage` that `choice` reduces and reshards per micro-batch (module docstring)."""
    if choice == "stage":
        return [m for m in stage.modules() if isinstance(m, FSDPModule)]
    if choice == "experts":
        return [
            m.experts for m in stage.modules() if isinstance(m, MoE) and isinstance(m.experts, FSDPModule)
        ]
    return []


class ReducingStage(PipelineStage):
    """A `PipelineStage` whose `per_micro` FSDP2 wraps reduce and reshard after every micro-batch's backward
    (module docstring); with none it is torch's stage."""

    def __init__(self, *args, per_micro: list[FSDPModule], **kwargs):
        super().__init__(*args, **kwargs)
        self.per_micro = per_micro

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        # The split backward types (zero-bubble schedules, which ttt does not run) stay torch's.
        if not self.per_micro or backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # torch 2.13's FSDP branch of this method, with the chosen wraps turned back on between its setters
        # (which recurse into every wrap of the stage) and the backward that reads them.
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(False)
        self.submod.set_requires_gradient_sync(False)
        for wrap in self.per_micro:
            wrap.set_reshard_after_backward(True, recurse=False)
            wrap.set_requires_gradient_sync(True, recurse=False)
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None
