"""When a pipeline stage's FSDP2 wraps reduce their gradients and reshard their parameters (`--set
pp_reduce=`, train/pipeline.py).

torch's schedule (torch/distributed/pipelining/stage.py, `backward_maybe_with_nosync`) turns FSDP2's
gradient reduction and resharding off on every FSDP2 module of a stage before each micro-batch's backward,
and turns them back on only in `perform_reduce_grad` after the step's last one: through the step a rank
holds each wrap's gradient whole in fp32 and its parameters gathered (compute precision), one
reduce-scatter per wrap and step. For a stage's expert slices sharded over their holders
(`pp=P,ep=E,fsdp=N`, E < N: `expert_parallel.shard_expert_replicas`) that is every slice gathered and its
gradient whole: DeepSeek-V3's published `pp=4,ep=32,fsdp=64` on 80 GiB GPUs simulated 98.0 GiB
(docs/scale.md, "Pipeline: expert slices reduced per micro-batch").

`pp_reduce` chooses the wraps that instead reshard after each micro-batch's backward and reduce-scatter its
gradient there, into the shard's accumulated gradient (FSDP2's own accumulation without no-sync):
- `experts` (default): the expert slices' wraps, whose collectives run over a slice's N / E holders only;
  each micro-batch then gathers the slice again;
- `stage`: every wrap of the stage (its blocks and the stage root too): the blocks' gradients and gathered
  weights shrink to shards as well, for a reduce-scatter and two all-gathers (forward, backward) of every
  block over all N ranks of the stage per micro-batch, not one reduce-scatter per step;
- `step`: torch's schedule as it is.
Measured (docs/scale.md): at the published DeepSeek-V3 layout `experts` lowers the simulated peak from
98.0 to 80.9 GiB, `stage` to 55.9, the only one under the 72 GiB line. `stage` is not the default because it
multiplies the stage's N-rank collectives by the micro-batch count (256 a step at the reference GBS on 256
GPUs), which a layout that fits without it should not pay; `ttt plan --set pp_reduce=stage` counts it.

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
