"""Context parallelism, `--parallel cp=N`: the N ranks of a CP group read the same samples and each computes
a part of every sequence, exactly as one process computes the whole.

Load balancing (head-tail): the sequence of T positions is cut into 2N chunks of T / 2N, and CP rank c
holds chunks c and 2N - 1 - c. Under a causal mask query i attends i + 1 keys, so the early chunks are cheap
and the late ones dear; a pair from both ends gives every rank the same share of the causal triangle (the
layout of Megatron-Core's and torchtitan's CP).

How it reaches the model (the least invasive way found; the model knows no process group): the model's
`forward(tokens, labels, reduction, shard=...)` takes a `models.common.sequence_shard.SequenceShard`. This
module wraps the parallelised model in `ContextParallel`, which calls it with the whole `[B, T]` tokens and
labels and a `_Shard` for this rank. The model keeps its own positions, reads RoPE at the global ones,
shifts DeepSeek's MTP tokens in the global order before keeping its part, and hands each attention layer
the shard's kernel in place of a mask. That kernel all-gathers K and V over the CP group (an
autograd-aware gather: its backward sums each rank's key and value gradients into the rank that holds
them) and attends this rank's queries to all T keys with the mask `key <= query` (and `key >= query - W`
for a sliding window) built from GLOBAL positions: the same scores, the same softmax rows, only computed
on another rank. DeepSeek's sequence-wise aux loss needs the whole sequence's expert counts: the routers'
`sequence_sum` hook sums them over the group (no gradient; the loss is linear in the part that has one).

The loss: the model returns its share of the one-process value (sums over its tokens divided by the
sequence's counts, summed over the group), and the wrapper sums the shares over the group with an
all-reduce whose backward is an all-reduce too. Every CP rank therefore reports exactly the loss one
process reports for those samples (so the step's loss average, the eval sums and the token counts are one
process's), and each rank's backward carries N x its share, which the data-parallel gradient average
over all dp x cp ranks (DDP over every rank, or FSDP2 sharding over the flattened (fsdp, cp) ranks, as
torchtitan does) divides back: the summed gradient is the one-process gradient of the global mean.

qwen3_5_moe's Gated DeltaNet layers run `context_parallel_deltanet`'s forward (swapped in here): the same
head-tail chunks, the recurrence's state handed on in sequence order.

With tp (`tp=T,cp=C`): the (fsdp, cp, tp) mesh of `parallel.apply`; each TP rank computes its heads of
its CP rank's part, gathering K/V of those heads over the CP group only (the mesh's cp slice), and TP's
sequence parallelism cuts that part again along the sequence between blocks. With pp (`pp=P,cp=C`): every
stage computes its CP rank's part (train/pipeline.py `Stage`), the last sums the loss shares. Both only for
the llama family's dense decoders (`check`); FSDP2 then shards over the flattened (fsdp, cp) ranks even at
fsdp=1 (`Plan.shard_ranks`), which averages the CP ranks' gradients.

With ep (`cp=C,ep=E[,fsdp=N]`, train/parallel.py): the experts split over groups of E consecutive ranks of the
flattened (data, cp) ranks; a MoE layer routes the tokens of this rank's part like any other tokens. What is
sequence-wide stays exact as without ep: the sequence-wise aux loss sums its counts over this CP group, MTP
shifts in the global order, the router loads of the bias update are summed over every rank.

GRPO (tasks/grpo.py): every rank of a CP group decodes its data rank's rollouts whole and the group keeps
its first rank's (`SequenceGroup.from_first`); the logprob check and the loss read per-token
log-probabilities of this rank's positions (`ContextParallel.per_token`, the batch padded to 2N chunks),
their row statistics and loss shares summed over the group (`SequenceParts`).

Not built: CP with ep and tp or pp (refused by `parallel.parse`), a ring exchange that overlaps the K/V transfer with the attention (the all-gather holds the whole
sequence's K/V of one layer at a time), a GQA- or MLA-latent gather (K/V are gathered after the head
expansion), and a fused kernel: the attention is SDPA with a boolean mask.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from timetotrain.errors import UserError
from timetotrain.models.common.sequence_shard import SequenceShard
from timetotrain.models.qwen3_5_moe.deltanet import GatedDeltaNet
from timetotrain.train import context_parallel_deltanet


def head_tail_positions(seq_len: int, cp: int, c: int) -> torch.Tensor:
    """The global positions CP rank `c` of `cp` holds: chunks c and 2cp - 1 - c of 2cp equal chunks."""
    n = seq_len // (2 * cp)
    first = torch.arange(c * n, (c + 1) * n)
    return torch.cat([first, torch.arange((2 * cp - 1 - c) * n, (2 * cp - c) * n)])


def check(bench, tier, plan, spec: str | None) -> None:
    """One line for what CP cannot run: other kinds it does not compose with, a family without the
    `shard` argument, data without token sequences, a window that does not cut into 2cp chunks."""
    if plan.cp == 1:
        return
    family = bench.family
    if plan.ep > 1 and not hasattr(getattr(tier, "model", None), "n_experts"):
        raise UserError(
            f"--parallel {spec}: expert parallelism needs a mixture-of-experts model ({bench.name} has none): "
            "leave ep out"
        )
    if plan.ep > 1 and getattr(bench.task, "on_policy", False):
        # GRPO under cp is proven without ep (tests/test_grpo_cp.py), cp with ep for pretraining only
        # (tests/test_layouts_cp_ep.py): the two together are not checked.
        raise UserError(
            f"--parallel {spec}: cp with ep is not built for {bench.name}'s rollouts; use cp with fsdp, or ep "
            "without cp"
        )
    if (plan.tp > 1 or plan.pp > 1) and family.name != "llama":
        # The compositions are proven for the dense decoders only (tests/test_layouts_cp_compose.py); the MoE
        # families' TP plans and the stacks pp does not split are not checked under cp.
        raise UserError(
            f"--parallel {spec}: cp with tp or pp is built for the llama family's dense decoders, not "
            f"{family.name}: use cp with fsdp (or dp_replicate,fsdp) only"
        )
    forward = getattr(family.build, "forward", None)
    if forward is None or "shard" not in inspect.signature(forward).parameters:
        raise UserError(
            f"--parallel {spec}: the {family.name} family has no context-parallel attention; leave cp out"
        )
    seq = getattr(getattr(tier, "data", None), "seq_len", None)
    if seq is None:  # (llama2_70b_lora: its blocks and LoRA dropout are not checked under cp)
        raise UserError(
            f"--parallel {spec}: cp splits the token windows of causal-LM pretraining and GRPO's rollouts; "
            "this benchmark's data has none: leave cp out"
        )
    # GRPO's rollouts (on-policy) vary in length: `ContextParallel.per_token` pads each batch to 2cp chunks.
    if seq % (2 * plan.cp) and not getattr(bench.task, "on_policy", False):
        raise UserError(
            f"--parallel {spec}: cp={plan.cp} cuts each sequence into {2 * plan.cp} equal chunks, and the "
            f"sequence length {seq} does not divide; choose a cp that divides seq_len / 2"
        )


def cp_group(plan, rank: int):
    """This rank's CP group: the ranks that differ from it in the cp coordinate only (consecutive after
    tp, `Plan.coords`). Every rank creates every group, in one order, as `new_group` requires."""
    mine = None
    stride = plan.tp
    for base in range(plan.world):
        if (base // stride) % plan.cp:
            continue
        ranks = [base + c * stride for c in range(plan.cp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (the sequence of `[B, heads, T, D]`), in CP-rank order; backward: the sum of
    every rank's gradient for this rank's part."""

    @staticmethod
    def forward(ctx, x, group, ranks: int, index: int):
        ctx.group, ctx.ranks, ctx.index = group, ranks, index
        parts = [torch.empty_like(x) for _ in range(ranks)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        # A reduce-scatter over the sequence, which it splits along dim 0: this rank's part, summed.
        whole = grad.movedim(2, 0).contiguous()
        part = whole.new_empty((whole.shape[0] // ctx.ranks, *whole.shape[1:]))
        dist.reduce_scatter_tensor(part, whole, group=ctx.group)
        return part.movedim(0, 2).contiguous(), None, None, None


class _SumShares(torch.autograd.Function):
    """Sum over the group; backward sums too (module docstring: each rank's backward carries N shares)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Shard(SequenceShard):
    def __init__(self, seq_len: int, cp: int, index: int, group, device: torch.device):
        self.cp, self.index, self.group = cp, index, group
        self.positions = head_tail_positions(seq_len, cp, index).to(device)
        # The keys after the gather, in CP-rank order.
        self.key_positions = torch.cat([head_tail_positions(seq_len, cp, c) for c in range(cp)]).to(device)
        self._masks: dict[int | None, torch.Tensor] = {}

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self._masks:
            q, k = self.positions.unsqueeze(1), self.key_positions.unsqueeze(0)
            m = k <= q
            self._masks[window] = m if window is None else m & (k >= q - window)
        return self._masks[window]

    def attention(self, q, k, v, window, scale):
        k = _GatherSequence.apply(k, self.group, self.cp, self.index)
        v = _GatherSequence.apply(v, self.group, self.cp, self.index)
        group = q.shape[1] // k.shape[1]
        if group > 1:  # GQA: repeated, as the one-process masked path does
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(window), scale=scale)

    def total(self, t: torch.Tensor) -> torch.Tensor:
        return _summed(t, self.group)


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    """`t`, no gradient, summed over `group` (a copy)."""
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


class SequenceGroup:
    """This rank's place in its CP group: its head-tail shard of a sequence length (`shard`) and the sum of
    the ranks' loss shares (`total`). `ContextParallel` holds one; so does each pipeline stage under
    `pp=P,cp=C` (train/pipeline.py), whose first stage keeps its part of the tokens and whose last sums the
    shares of its loss."""

    def __init__(self, plan, rank: int, group=None):
        self.cp, self.index = plan.cp, plan.coords(rank)["cp"]
        # The mesh's cp slice where the caller built one (tp, pp), else the groups made here.
        self.group = group if group is not None else cp_group(plan, rank)
        self._shards: dict[tuple[int, torch.device], _Shard] = {}

    def shard(self, seq_len: int, device: torch.device) -> _Shard:
        key = (seq_len, device)
        if key not in self._shards:
            if seq_len % (2 * self.cp):
                raise ValueError(f"sequence length {seq_len} does not cut into {2 * self.cp} chunks")
            self._shards[key] = _Shard(seq_len, self.cp, self.index, self.group, device)
        return self._shards[key]

    def total(self, share: torch.Tensor) -> torch.Tensor:
        """The one-process value from this rank's `share` (module docstring): summed over the group, and
        summed again in the backward."""
        return _SumShares.apply(share, self.group)

    def from_first(self, *tensors: torch.Tensor) -> None:
        """Every rank of the group gets the first rank's `tensors`, in place (GRPO's rollouts: the group
        trains on one copy of them, whatever its ranks' decodes drew)."""
        for t in tensors:
            dist.broadcast(t, group=self.group, group_src=0)


class ContextParallel(nn.Module):
    """The module the harness calls under `cp`: `forward(tokens, labels, reduction)` as a causal LM's, with
    the result one process computes, on every CP rank (module docstring)."""

    def __init__(self, module: nn.Module, plan, rank: int, group=None):
        super().__init__()
        self.module = module
        self.sequence = SequenceGroup(plan, rank, group)
        self.cp, self.index, self.group = self.sequence.cp, self.sequence.index, self.sequence.group
        if hasattr(
            module, "no_sync"
        ):  # DDP: `parallel.grad_sync` skips the all-reduce of early micro-batches
            self.no_sync = module.no_sync
        bare = getattr(module, "module", module)
        for m in bare.modules():
            if hasattr(m, "sequence_sum"):  # routers with a sequence-wise aux loss
                m.sequence_sum = self._sum_counts
            if isinstance(m, GatedDeltaNet):  # the recurrence handed on in sequence order
                context_parallel_deltanet.context_parallel(m, self.group)

    def _sum_counts(self, t: torch.Tensor) -> torch.Tensor:
        return _summed(t, self.group)

    def shard(self, seq_len: int, device: torch.device) -> _Shard:
        return self.sequence.shard(seq_len, device)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean"):
        if labels is None:
            raise NotImplementedError("context parallelism computes losses only (pass labels)")
        share = self.module(
            tokens, labels=labels, reduction=reduction, shard=self.shard(tokens.shape[1], tokens.device)
        )
        return self.sequence.total(share)

    def per_token(
        self, tokens: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
    ) -> tuple[torch.Tensor, SequenceParts]:
        """The module's `reduction="none"` values (GRPO's negated log-probabilities at `temperature`) of
        `tokens` `[B, T]` against `labels`, computed in parts: this rank's `[B, T_local]` and the
        `SequenceParts` that place them. A length that does not cut into 2cp chunks is padded on the right
        (any id, label ignored): under a causal mask nothing before it changes."""
        T = tokens.shape[1]
        padded = -(-T // (2 * self.cp)) * 2 * self.cp
        tokens = F.pad(tokens, (0, padded - T), value=0)
        labels = F.pad(labels, (0, padded - T), value=-100)
        shard = self.shard(padded, tokens.device)
        values = self.module(tokens, labels=labels, reduction="none", temperature=temperature, shard=shard)
        return values, SequenceParts(shard, self.sequence)


class SequenceParts:
    """Per-token values of a batch of sequences held in parts by the CP group (`ContextParallel.per_token`):
    this rank's positions, and the sums over the group a loss of whole sequences needs. `first`: the group's
    first rank (it alone counts what every rank of the group holds alike, so that a sum over all ranks
    counts each sample once)."""

    def __init__(self, shard: _Shard, sequence: SequenceGroup):
        self.shard, self.sequence = shard, sequence
        self.first = sequence.index == 0

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a `[B, T]` per-position tensor (zeros at the padding)."""
        padded = self.shard.positions.numel() * self.sequence.cp
        return F.pad(t, (0, padded - t.shape[1])).index_select(1, self.shard.positions)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """Per-row sums `[B]` over the parts (no gradient): a whole sequence's statistic."""
        return _summed(t, self.sequence.group)

    def total(self, share: torch.Tensor) -> torch.Tensor:
        """The one-process value of a loss from this rank's share (`SequenceGroup.total`)."""
        return self.sequence.total(share)
