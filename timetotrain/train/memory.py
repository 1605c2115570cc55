"""`ttt plan`: per-GPU memory of a tier under a parallel configuration, estimated before launching.

Where the numbers come from (an estimate, not a measurement):
- Model states, per trainable parameter: fp32 weights 4 B + fp32 gradients 4 B + AdamW moments 8 B = 16 B;
  per frozen parameter (a LoRA base: `Task.param_counts`) the weight alone, in the dtype the task stores
  it in (`Task.frozen_bytes`: 4 B fp32, or 2 B for a LoRA base kept in bf16 under bf16 compute; its fp32
  norm weights, 0.002% of 70B, are counted at 2 B too); divided by the shard count under FSDP, whole under
  DDP. bf16 compute adds the bf16 copies: under FSDP2 the unsharded bf16 parameters of about two blocks at
  a time (the one computing and the one prefetched) and of the root group (embedding, head, final norm:
  gathered whole for the forward and the backward, in fp32 too; found by `ttt plan --simulate`); under DDP
  autocast's cached bf16 copy of every fp32 weight (2 B per parameter; none for a base already stored in
  bf16). Every FSDP2 row (fsdp, HSDP, the ep hybrids, cp or tp with FSDP2) counts besides, through the
  backward, the unsharded fp32 gradients of the block it reduce-scatters (`reduce_dtype` fp32, train/
  parallel.py; FSDP2 keeps one block's reduce-scatter input while the next block computes its gradients):
  4 B per trained parameter of what the block's wrap gathers (no experts under `ep=N,fsdp=N`, HSDP x EP or
  cp with ep, whose slices FSDP2 ignores; one sharded slice under the hybrid `ep=E,fsdp=N`, whose slices
  have their own wrap; a LoRA block's adapters only; 1/T of it under tp). Found by `ttt plan --simulate`:
  qwen35_397b_grpo `fsdp=128,cp=8` on 1,024 GPUs simulated 27.5 GiB over the formula without them (a
  6.6 B-parameter block: 24.5 GiB), llama31_405b `fsdp=64` with AC 14.7 (11.9); the TP rows counted them
  already. DDP reduces its own buckets (counted with the states).
- Activations: the model family's count of the elements autograd keeps per token for one block
  (`ModelFamily.activation_elements`; for a Llama block: RMSNorm keeps its input, the normalised values and
  the weighted output (3h, twice per block); SDPA keeps rotated q, k, v and its output (q h, k and v
  h*kv/heads each, out h); the output projection its input (h); SwiGLU keeps fc1's output (2f,
  `fused.swiglu`) and fc2 its input (f). That is 9.5h + 3f elements at h = dim, f = FFN width when
  kv/heads = 1/4, in the compute precision. MoE families count per routed copy instead.) Tokens per
  micro-batch come from the task (`sample_items`).
  The head and loss (`models/common/head_loss.py`) keep the final norm's tensors (3h) and the gradient of the
  hidden states (h) per token, plus, once per micro-batch, the fp32 head-weight gradient and one chunk of
  logits (fp32, with its compute-precision copies under bf16).
  Activation checkpointing per block keeps only each block's input (h) plus one block's activations during
  its recomputation (of unlike blocks the largest: `ModelFamily.peak_block_elements`, qwen3_5_moe's DeltaNet).
  Selective checkpointing (`--ac-every K`, train/parallel.py: blocks 0, K, 2K, ... wrapped) keeps that for
  the ceil(n/K) wrapped blocks and the whole count for the others (of the family's average block: which kinds
  a K wraps is not told apart). `ttt plan` estimates it where --ac-every names it; its default rows are
  without and with checkpointing of every block, and `--ac` keeps the latter only.
  GRPO's per-token log-probabilities go through the same chunked head (`head_loss.linear_logprobs`): it
  keeps the compute-dtype hidden states (the h counted above for the hidden states' gradient) and computes a
  chunk's logits again in the backward, where the fp32 head-weight gradient appears; one chunk of logits at
  a time, fp32 plus its bf16 GEMM output (6 B an element under bf16, within the 8 counted). Until 2026-12 it
  read whole logits (14 B per token and vocabulary entry: ~333 GiB for one 65,536-token sample).
- The step's peak is the larger of its last backward's two ends (`backward_overlap`), not one sum: at the
  start every activation above and the gradients of the micro-batches before (none when the step is one
  micro-batch); at the end, in the first block, every gradient beside that block's activations and their
  gradients (twice the block's count, recomputed under checkpointing) and the fused loss's fp32 head-weight
  gradient, which FSDP2 reduces after the whole backward (`backward_end_bytes`). With more micro-batches
  that is the sum; a one-micro-batch step of DeepSeek-V3 on 8,192 GPUs counts 7.1 GiB less (found by
  `ttt plan --simulate`: the sum, 70.7 GiB, was 11% over the simulated 63.9).
- A task's own phases beside the step (`Task.plan_phases`: GRPO's rollout decode, each GPU's rollouts at
  once with their KV cache and recurrent state at the full sequence length, and its logprob check, a
  no-grad forward through the chunked head): the activations column holds the largest of these and the step's
  (`Estimate.peak` names it), the model states being resident through all of them.
  A family that is not such a decoder counts its own bytes per micro-batch (`ModelFamily.activation_bytes`):
  flux (models/flux/) counts what each double and single MMDiT block keeps per token of the joint
  sequence, with its fp32 parts, plus the embedders, final layer and loss per sample; tests/test_plan.py
  checks the count against the bytes autograd really saves on CPU. The frozen encoders of flux are not
  counted because training never runs them (it reads their precomputed outputs).
- A margin for the allocator, NCCL buffers and workspaces: 5% of the device plus 1 GiB.
- Only layouts `ttt run` accepts: `--parallel` goes through `parallel.parse` with --gpus as the world size,
  and the global batch must split over the data-parallel ranks (`parallel.check_batch_split`).
- HSDP (`dp_replicate=R,fsdp=S`, train/parallel.py): FSDP2 shards within groups of S GPUs, so the
  states, the gathered bf16 copies and the root group are those of `fsdp=S`; the batch splits over all
  R x S GPUs, so the activations are those of `fsdp=R*S`. `ttt plan --simulate` builds it (a 2-D mesh
  under the fake process group) and counts the same states. By this count it holds at least what
  `fsdp=R*S` holds on the same GPUs; what it saves is network traffic: its all-gathers stay within S GPUs,
  where `fsdp` over every GPU all-gathers every block across the nodes in the forward and the backward.
  So the search tries it across nodes (--gpus above --gpus-per-node), S = --gpus-per-node, wherever fsdp
  over all GPUs splits the batch, and where it fits it goes before `fsdp` at the same checkpointing, even
  at a smaller micro-batch (`plan`'s order); on one node it is never tried.
- The search without --parallel, fewest collectives first: dp and fsdp (MoE: ep, ep x fsdp, the hybrid),
  HSDP across nodes (MoE: HSDP x EP too, `dp_replicate=nodes,fsdp=node,ep=E`, E the largest dividing the
  experts and the node, planned as --parallel names it; at E = the node it holds HSDP's states plus its
  slices' bf16 copies, so a tie goes to HSDP, without all-to-all);
  where none of those fits or splits the batch, tp x fsdp (tp x ep); where none of those either, context
  parallelism `cp=C,fsdp=gpus/C` with C in 2, 4, 8 within a node (`_context_parallel_rows`; for an MoE model
  `cp=C,ep=E,fsdp=gpus/C` too, E the largest dividing the experts and the GPUs, and CP is tried before TP:
  the MoE TP plans run the router and routed experts whole on every TP rank of a group, where CP splits
  the experts' tokens too; for the llama family
  `cp=C,tp=T[,fsdp=F]` with C x T within a node, fewer TP first; where none of those fits or splits the
  batch either, across nodes `cp=2,tp=node[,fsdp=F]`, TP filling each of the CP pair's two nodes, NVIDIA's
  llama31_405b layout: `CROSS_NODE_CP`), each planned
  as if --parallel named it, so through the checks of `ttt run`'s preflight (`parallel.parse`, the batch
  split, `context_parallel.check`: causal-LM pretraining with a context-parallel attention, not GRPO, a
  sequence that cuts into 2C chunks). Of these the smallest C that fits. `ttt plan` (`plan_at_legal_gbs`)
  prefers a legal larger GBS where a layout without CP fits to CP at the tier's GBS (an MoE model's CP
  within a node excepted: it stands where TP stands for the others), so a suggestion made before the
  search had CP stays; where the tier's GBS takes a TP suggestion (or an MoE model's CP one: it splits over
  no layout without them), the rows of the smallest larger legal GBS where one without TP and CP fits are
  offered beside it, each row naming its GBS (`_with_legal_rows`). Pipeline parallelism last of all, where no layout above (CP included)
  fits or splits the batch (`_pipeline_search_rows`): `pp=P[,tp=T][,fsdp=F]` for P in 2, 4, 8, 16, 32 (an
  MoE family, deepseek_v3 and gpt_oss: `pp=P,ep=E,fsdp=gpus/P`, E the largest dividing the experts and F), each
  planned as --parallel names it (`_pipeline_rows`), so through `pipeline.check` (decoders whose task
  trains the model's own loss or LoRA adapters on it, fp8 too; not GRPO, nor flux) and a per-rank batch
  of at least P micro-batches; the fewest stages that fit, then the smallest TP, at the smallest
  micro-batch (the most micro-batches: the least bubble). By this count it seldom fits where nothing else
  does (a stage holds 1/P of the layers on 1/P of the GPUs, the same states per GPU, plus its gradients
  whole and parameters gathered under FSDP2, and 1F1B keeps P micro-batches of its L/P layers in flight):
  what it adds is data-parallel ranks the batch splits over, P x T GPUs sharing each sample (llama31_405b
  on 4,096 GPUs: GBS 1152 splits over at most 128, so `pp=8,tp=8,fsdp=64`; on 2,048 the CP pair across
  nodes splits it, `cp=2,tp=8,fsdp=128`). tests/test_plan_builds.py
  builds a suggested pipeline kind for both ends of the pipeline under the fake process group.
- Tensor parallelism (`tp=T,fsdp=F`, train/tensor_parallel.py), considered when nothing with dp or fsdp
  alone fits or splits the batch (or when --parallel names tp): the block parameters split over T x F ranks, the embedding, head
  and final norm over the F FSDP ranks only (they stay whole within a TP group); the bf16 copies of two
  unsharded blocks are 1/T of a block each; a block's kept activations are 1/T of the count above (heads
  split over the TP ranks, the norms and the residual stream cut along the sequence, Megatron's sequence
  parallelism), the block inputs kept under checkpointing too, except the inputs of the two column-wise
  linears (QKV, fc1): torch's ColwiseParallel keeps the all-gathered, whole-sequence input it multiplied
  for its weight gradient (Megatron gathers it again in the backward instead), h per token each where the
  count above has it once at 1/T (`tp_block_elements`; found by `ttt plan --simulate`: llama31_8b
  tp=4,fsdp=16 was 1.24x the formula); the head and loss see the whole sequence.
  T runs over 2, 4, 8 where heads and FFN width divide and T divides a node (`--gpus-per-node`: the TP
  group stays in one node's NVLink domain). This estimate has not been validated on GPUs; the TP code is
  tested for exactness on CPU (gloo) only.
- Tensor with expert parallelism (`tp=T,ep=E,fsdp=N`, an MoE family with a TP plan: gpt_oss; tried like
  tp x fsdp, with the largest E dividing the experts and N, or what --parallel names): TP cuts only the
  attention and the norms (1/(T x N) of them), the router is sharded over the N FSDP2 ranks and the
  routed experts held as slices of 1/E (FSDP2 ignores them, so a gathered block has no experts and the
  slices' bf16 copies are kept for the step, as under `ep,fsdp`). The activations are the family's count
  under its plan (`ModelFamily.tensor_parallel_elements`): the attention's 1/T, the MoE whole, since
  every TP rank of a group runs it on the group's whole tokens. `ttt plan --simulate` agrees at
  gpt_oss_20b tp=2,ep=4,fsdp=32 on 64 GPUs (GBS 32, no AC): states 71.69 GiB simulated, 71.68 counted,
  peak 107.0 against 106.8.
- Expert parallelism (MoE families: candidates beside dp and fsdp whenever the experts split over --gpus,
  or what --parallel names): `ep=N` (DDP) keeps the replicated part whole and 1/N of the routed experts on
  every GPU, the autocast copies likewise; `ep=N,fsdp=N` shards both
  parts 1/N (the states of `fsdp=N`), but FSDP2 gathers a block without its experts, and the experts' bf16
  copies are those of the local slices, of every layer with or without activation checkpointing: the step
  casts each stack once and keeps the copy until the step ends (models/common/weight_cast.py; found by
  `ttt plan --simulate`: 4.8 GiB per GPU at deepseekv3_671b `ep=256`, which the count of two blocks under
  checkpointing had left out since the cast moved there). The routed copies a GPU computes are counted as one GPU's own tokens'
  (balanced routing). `ep=E,fsdp=N` with E < N (the hybrid: offered when GPUs outnumber the experts, or named
  by --parallel) holds 1/E of the experts, each slice sharded over its N/E holders
  (`expert_parallel.shard_expert_replicas`), so 1/N of the experts' states as of the rest; a gathered block
  holds its slice (in the compute precision) and no bf16 copy of the slices outlives it. Where the slices stay
  whole on their replicas (HSDP x EP, tp or cp with ep: `Plan.expert_shards`) they count 1/E, their copies
  as under `ep=N,fsdp=N`. With context parallelism (`cp=C,ep=E[,fsdp=N]`) the states are those of the
  same layout over all GPUs (`ep=E,fsdp=N x C`, or `ep=E` under DDP: FSDP2 shards over the flattened (fsdp,
  cp) ranks, the experts split over E of them), the tokens, and so the routed copies, 1/C of each sequence
  beside the gathered K/V (`context_parallel_bytes`).
- `--precision fp8` (train/float8.py; facts from torchao 0.18's float8 training code): the block linears
  that float8 converts (`float8.converts`, counted on the model built on the meta device) keep their fp32
  master weight, gradient and Adam moments (states as under bf16), and everything else computes in bf16
  as under `--precision bf16`. What changes is the copies: a float8 linear casts its weight straight to
  float8 inside its GEMM (`matmul_with_hp_or_float8_args`), never through autocast, so on one device or
  under DDP it has no cached bf16 copy (its float8 weights, 1 B/param, exist one GEMM at a time: one
  block's worth counted); under FSDP2 the tensorwise recipe all-gathers those weights in float8
  (`WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`): the two unsharded blocks' linears take 1 B
  per parameter instead of 2; the rowwise recipes gather bf16 (2 B). Activations are those of bf16:
  torchao saves each float8 linear's high-precision input and weight for the backward
  (`ctx.save_for_backward(input_hp, weight_hp_t)`, all three recipes) and casts them to float8 again
  there; its float8 operands are transient. MoE experts (torchao's grouped-GEMM recipe, CUDA sm90+) are
  counted as under bf16. A model with no linear to convert is refused, as `ttt run` refuses it. The MX
  recipes (`mxfp8*`) count as rowwise: torchao's MX tensor casts to bf16 before FSDP2's all-gather
  (`fsdp_pre_all_gather`) and saves the high-precision input and weight as well; one GPU only (`ttt run`
  refuses --parallel with them).
- Launch: one torchrun on one node when --gpus fits in `--gpus-per-node`, else the same torchrun on every
  node with a c10d rendezvous and its sbatch form (docs/scale-out.md). When nothing fits, `fits_from`
  plans the larger worlds `ttt run` could take (whole nodes, a divisor of the global batch times a TP
  degree) in order and names the first that fits; when none does, `nothing_fits` says why in the numbers
  of the largest such world (one sample per data-parallel rank) and what would be needed: the sequence
  split over GPUs (context parallelism, activations / c, with why the search offered none) or tensor
  parallelism, or a larger device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shlex
from dataclasses import dataclass

from timetotrain.errors import UserError
from timetotrain.models.common.head_loss import chunk_rows
from timetotrain.models.common.layers import RMSNORM_SAVED
from timetotrain.train import context_parallel, expert_fsdp, parallel, pipeline
from timetotrain.train.float8 import converter
from timetotrain.train.launch import before_launch, check_nodes, format_launch, launch_lines

GiB = 2**30
HEADROOM = 0.9


@dataclass(frozen=True)
class Fp8:
    """`--precision fp8` for the estimate (module docstring): torchao's recipe, the parameters of the
    float8 linears, and the blocks (`model.layers`) they sit in."""

    recipe: str
    linear_params: int
    blocks: int

    @property
    def per_block(self) -> float:
        return self.linear_params / max(1, self.blocks)

    @property
    def gather_bytes(self) -> int:
        """Bytes per float8-linear parameter FSDP2 all-gathers: float8 under tensorwise, else bf16."""
        return 1 if self.recipe == "tensorwise" else 2  # rowwise, MX: bf16

    def label(self) -> str:
        return f"fp8 {self.recipe} block linears + bf16"


def fp8_model(bench, tier) -> Fp8:
    """What `--precision fp8` converts in `tier`'s model, counted on the meta device (seconds at 405B)."""
    import torch

    _check_supported(bench, tier)
    with torch.device("meta"):
        model = bench.family.build(tier.model)
    keep = converter(tier.fp8_recipe)
    n = sum(m.weight.numel() for name, m in model.named_modules() if keep(m, name))
    if n == 0:
        raise UserError(
            f"--precision fp8: {bench.name} has no block linears to train in float8; plan it with --precision bf16"
        )
    return Fp8(tier.fp8_recipe, n, len(model.layers))


def _fp8_saving(fp8: Fp8 | None, sharded: bool, fp32_linears: bool, tp: int = 1) -> float:
    """Bytes of copies float8 saves against bf16 (module docstring); negative where it adds some."""
    if fp8 is None:
        return 0.0
    if sharded:  # two unsharded blocks' linears, gathered in float8 (tensorwise) instead of bf16
        return 2 * (2 - fp8.gather_bytes) * fp8.per_block / tp
    # No autocast copy of a float8 linear (of an fp32 weight: a bf16 LoRA base has none either way), and
    # one block's float8 weights in flight.
    return (2 * fp8.linear_params if fp32_linears else 0) - fp8.per_block


@dataclass(frozen=True)
class Estimate:
    parallel: str
    ac: int  # activation checkpointing of every ac-th block; 0 none (train/parallel.py)
    micro_batch: int
    states: float
    compute_copies: float
    activations: float
    margin: float
    # What the activations column holds: the training step's, or a task phase's that is larger
    # (`Task.plan_phases`: GRPO's rollout decode or logprob check).
    peak: str = "the training step"
    # The columns' sum less the step's peak, the larger of its backward's start and end (`backward_overlap`):
    # positive where a step of one micro-batch never holds its gradients and all its activations at once,
    # negative where the end (every gradient beside the first block's backward) holds more than the start.
    overlap: float = 0.0
    # The global batch size the row is planned at: the tier's, or a legal one of the benchmark's RCP table
    # (`plan_at_legal_gbs`), which the table prints on each row.
    gbs: int = 0

    @property
    def total(self) -> float:
        return self.states + self.compute_copies + self.activations + self.margin - self.overlap


def activation_bytes(family, cfg, tokens: int, act_bytes: int, ac: int, tp: int = 1) -> float:
    h = cfg.dim
    per_block = _tp_elements(family, cfg, family.activation_elements(cfg), tp)  # per token, module docstring
    # Under checkpointing one block is recomputed at a time: of unlike blocks, the largest is the peak.
    peak = _tp_elements(family, cfg, (family.peak_block_elements or family.activation_elements)(cfg), tp)
    head = 4 * h * act_bytes
    rows = chunk_rows(tokens, cfg.vocab_size)
    # fp32 dW, the fp32 logits chunk and, in bf16, that chunk's bf16 logits and gradient.
    chunk_bytes = 4 + (2 * act_bytes if act_bytes < 4 else 0)
    head_fixed = cfg.vocab_size * cfg.dim * 4 + rows * cfg.vocab_size * chunk_bytes
    # Multi-token prediction (DeepSeek-V3, `mtp_layers` depths): each depth is one more block outside
    # `model.layers`, which activation checkpointing does not wrap, so it keeps all its activations; before it
    # its two input norms (3h each), the concatenation its projection reads (2h) and the block's input (h);
    # after it a second pass through the final norm, the head and the fused loss (4h per token, and that
    # loss's own fp32 head-weight gradient and logits chunk, computed in the forward). Found by `ttt plan
    # --simulate` (deepseekv3_671b, AC on: 11 GiB per GPU the formula had not counted).
    # Under checkpointing the backward frees the MTP depths before it recomputes any main block: the larger
    # of the two is what is held at once.
    mtp = (
        getattr(cfg, "mtp_layers", 0)
        * (per_block + (2 * RMSNORM_SAVED + 3) * h + head / act_bytes)
        * act_bytes
    )
    if ac:
        # Every ac-th block wrapped (blocks 0, ac, 2 ac, ...): those keep their input, the rest everything.
        wrapped = len(range(0, cfg.n_layers, int(ac)))
        whole = (cfg.n_layers - wrapped) * per_block * act_bytes
        body = wrapped * h / tp * act_bytes + whole + max(peak * act_bytes, mtp)
    else:
        body = cfg.n_layers * per_block * act_bytes + mtp
    return tokens * (body + head) + head_fixed * (1 + getattr(cfg, "mtp_layers", 0))


def backward_end_bytes(family, cfg, tokens: int, act_bytes: int, ac: int, tp: int = 1) -> float:
    """What a step holds beside its gradients when its backward reaches the first block (`backward_overlap`):
    that block's activations (under checkpointing recomputed, of unlike blocks the largest, and its input)
    and, as its backward runs, their gradients, of the same shapes; and the fused loss's fp32 head-weight
    gradient, computed in the forward and held until FSDP2 reduces the root group after the whole backward
    (the MTP depths' activations are freed by then: their backward comes first). The first block is wrapped
    whenever any is (`--ac-every K` wraps blocks 0, K, ...)."""
    block = (
        (family.peak_block_elements or family.activation_elements) if ac else family.activation_elements
    )(cfg)
    per_token = 2 * _tp_elements(family, cfg, block, tp) + (cfg.dim / tp if ac else 0)
    return tokens * per_token * act_bytes + cfg.vocab_size * cfg.dim * 4


def _tp_elements(family, cfg, elements: float, tp: int) -> float:
    """A block's kept `elements` per token on one rank under `tp`: the family's own count where its plan
    does not cut the whole block (`ModelFamily.tensor_parallel_elements`: gpt_oss's MoE runs whole on every
    TP rank), else `tp_block_elements`."""
    if tp > 1 and family.tensor_parallel_elements is not None:
        return family.tensor_parallel_elements(cfg, tp)
    return tp_block_elements(elements, cfg.dim, tp)


def tp_block_elements(elements: float, h: int, tp: int) -> float:
    """A block's kept elements per token under `tp`-way tensor and sequence parallelism: 1/tp of them,
    but the two column-wise linears' inputs whole (module docstring): 2h more, less their 1/tp share."""
    return elements if tp == 1 else elements / tp + 2 * h * (1 - 1 / tp)


def backward_overlap(local: int, micro: int, grads: float, act: float, end: float | None, peak: str) -> float:
    """The states + activations sum less the step's peak (`Estimate.overlap`). The last micro-batch's
    backward starts with every activation (`act`) and the gradients of the micro-batches before it (all of
    this rank's `grads` bytes, or none when the step is one micro-batch: `local` samples per data-parallel
    rank, all in one) and ends, in the first block, with every gradient beside that block's backward (`end`,
    `backward_end_bytes`); in between it frees activations as it makes gradients, so the peak is the larger
    of the two ends. With more micro-batches that is the sum, unless the end is larger. Found by `ttt plan
    --simulate`: deepseekv3_671b on 8,192 GPUs (one micro-batch of 2) peaks in the first MoE block's
    backward beside 9.7 GiB of expert gradients, gpt_oss_20b ep=8,fsdp=8 (one micro-batch of 2) in layer
    0's experts; the sum had counted those gradients beside activations gone by then. None where the end is
    not counted (a family with its own activation count: flux) or for a task phase outside the step
    (GRPO's decode holds no gradients)."""
    if end is None or peak != "the training step":
        return 0.0
    return min(grads if local == micro else 0.0, act - end)


MARGIN_SHARE = 0.05  # of the device, plus 1 GiB: allocator, NCCL buffers, workspaces (module docstring)


def margin_bytes(gpu_mem_gib: float) -> float:
    """The plan's margin on a device of `gpu_mem_gib` GiB, in bytes (what the count leaves out)."""
    return MARGIN_SHARE * gpu_mem_gib * GiB + GiB


def _peak(bench, tier, step_bytes: float, rows: int, act_bytes: int, cp: int = 1) -> tuple[float, str]:
    """The step's activations, or the task's larger phase (`Task.plan_phases`), with its name."""
    more = bench.task.plan_phases(bench.family, tier, rows, act_bytes, cp)
    phases = {"the training step": step_bytes, **more}
    name = max(phases, key=phases.get)
    return phases[name], name


def estimate(
    bench, tier, n_params: int, gpus: int, gpu_mem_gib: float, kind: str, ac: int, micro: int, bf16: bool,
    tp: int = 1, fp8: Fp8 | None = None, ep: int | None = None, replicas: int = 1, cp: int = 1,
):  # fmt: skip
    """One row. `fp8` (with `bf16`: what float8 does not cover computes in bf16): `--precision fp8`. `ep`: the
    expert-parallel degree of an `ep` kind (default: all GPUs); below --gpus under FSDP2 (`ep=E,fsdp=N`) each
    slice of 1/E of the experts is held by N/E GPUs. `replicas`: HSDP's replica count of the `hsdp` kind
    (`dp_replicate=R,fsdp=S`): everything FSDP2 holds is as under `fsdp=S`, a shard group of S GPUs.
    `cp`: context parallelism (`context_parallel_bytes`); FSDP2 shards over the (fsdp, cp) ranks together,
    which `gpus` counts already."""
    family, cfg = bench.family, tier.model
    ep = ep or gpus
    if tp > 1:
        return _estimate_tp(
            bench, tier, gpus, gpu_mem_gib, ac, micro, bf16, tp, fp8, ep if kind == "tp,ep" else None, cp,
            replicas,
        )  # fmt: skip
    sharded = kind in ("fsdp", "ep,fsdp", "hsdp")  # (`ep,fsdp` with `replicas`: dp_replicate=R,fsdp=S,ep=E)
    shards = gpus // replicas if sharded else 1
    trainable, frozen = bench.task.param_counts(family, tier)
    frozen_bytes = bench.task.frozen_bytes(tier, bf16)
    states = (16 * trainable + frozen_bytes * frozen) / shards
    block = family.block_params(cfg)
    # Expert parallelism (module docstring): experts not held by this GPU, and a block's experts.
    experts = away = 0.0
    layer_experts = 0
    # FSDP2 shards each expert slice over the shards / ep GPUs holding it (`Plan.expert_shards`: the hybrid,
    # not under HSDP or cp), so the experts' states are 1/shards, as the rest's.
    efsdp = kind == "ep,fsdp" and replicas == 1 and cp == 1 and shards > ep
    if kind.startswith("ep"):
        experts, layer_experts = expert_params(family, cfg)
        away = experts * (1 - 1 / ep)
        if kind == "ep":
            states -= 16 * away
        elif not efsdp:  # the experts split over ep GPUs, not over the shards
            states += 16 * experts * (1 / ep - 1 / shards)
        # FSDP2 gathers a block without its (ignored) expert slices; sharded slices are gathered by their
        # own wrap inside the block's forward, one slice (1/ep of the layer's experts) per gathered block.
        block -= layer_experts * (1 - 1 / ep if efsdp else 1)
    if bf16:
        # DDP: autocast caches a bf16 copy of each fp32 weight the step reads (the trainable ones, and a
        # frozen base unless it is stored in bf16 already).
        fp32_weights = trainable + (frozen if frozen_bytes == 4 else 0)
        if sharded:
            # The local expert slices' bf16 copies, of every layer: the step's cast cache keeps them until
            # the step ends, checkpointing or not (module docstring). Sharded slices are gathered in bf16
            # instead, a block's at a time (in `block`).
            local = 0 if efsdp else experts - away
            copies = 2 * 2 * block + 2 * local
        else:
            copies = 2 * (fp32_weights - away)
        copies -= _fp8_saving(fp8, sharded, frozen == 0 or frozen_bytes == 4)
    else:
        copies = 4 * 2 * block if sharded else 0
    if sharded:
        copies += _root_copies(family, cfg, bf16, experts=not kind.startswith("ep"))
        # Through the backward, the unsharded fp32 gradients of the block FSDP2 reduce-scatters (module
        # docstring), as the TP rows count them: of what the block's wrap gathers (`block`: no experts under
        # ep, one sharded slice at a time under the hybrid), its trained part (a LoRA block's adapters).
        copies += 4 * (trainable / cfg.n_layers if frozen else block)
    end = None
    if family.activation_bytes is not None:
        if ac > 1:
            raise UserError(
                f"--ac-every {ac}: ttt plan counts selective checkpointing for decoders; the {family.name} "
                "family's count knows every block or none: plan it with --ac"
            )
        act = family.activation_bytes(cfg, micro, 2 if bf16 else 4, bool(ac))
    else:
        tokens = micro * bench.task.sample_items(tier)[1] // cp
        act = activation_bytes(family, cfg, tokens, 2 if bf16 else 4, ac)
        act += context_parallel_bytes(cfg, micro, bench.task.sample_items(tier)[1], cp, 2 if bf16 else 4, ac)
        end = backward_end_bytes(family, cfg, tokens, 2 if bf16 else 4, ac)
    # A task phase counts whole samples: under cp a rank holds cp x as many, 1/cp of each, as many tokens
    # as gbs / gpus whole ones (at least one: conservative where fewer).
    act, peak = _peak(bench, tier, act, max(tier.global_batch_size // gpus, 1), 2 if bf16 else 4, cp)
    margin = margin_bytes(gpu_mem_gib)
    label = f"ep={ep},fsdp={gpus}" if kind == "ep,fsdp" else f"{kind}={gpus}"
    if kind == "hsdp":
        label = f"dp_replicate={replicas},fsdp={shards}"
    elif kind == "ep,fsdp" and replicas > 1:
        label = f"dp_replicate={replicas},ep={ep},fsdp={shards}"
    grads = 4 * trainable / shards  # this rank's: FSDP2's reduced shards or DDP's buckets, the expert slices
    if kind == "ep":
        grads -= 4 * away
    elif kind == "ep,fsdp" and not efsdp:
        grads += 4 * experts * (1 / ep - 1 / shards)
    if not sharded:  # DDP's buckets: a second copy of the gradients it reduces (timetotrain/fakes.py),
        states += 4 * (trainable - experts)  # all but the expert slices, which it ignores
    overlap = backward_overlap(tier.global_batch_size * cp // gpus, micro, grads, act, end, peak)
    return Estimate(label, ac, micro, states, copies, act, margin, peak, overlap, tier.global_batch_size)


def context_parallel_bytes(cfg, micro: int, seq: int, cp: int, act_bytes: int, ac: int) -> float:
    """What context parallelism adds to a rank's activations beside its 1/cp of the tokens (`micro`
    sequences of `seq`; train/context_parallel.py): each attention layer's K and V gathered for
    the whole sequence and, under GQA, repeated to every query head, which the attention keeps for its
    backward (every layer's; under checkpointing the one block recomputed), and the boolean masks
    (local queries x all keys, one per window kind)."""
    if cp == 1:
        return 0.0
    if hasattr(cfg, "v_head_dim"):  # MLA: keys of nope + rope, values of v per head
        per_token = cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    else:
        per_token = 2 * cfg.n_heads * cfg.head_dim
    # `ac` (--ac-every): every ac-th block checkpointed, which keeps nothing but while it is recomputed.
    checkpointed = cfg.n_layers // ac if ac else 0
    layers = cfg.n_layers - checkpointed + (1 if checkpointed else 0) + getattr(cfg, "mtp_layers", 0)
    return layers * micro * seq * per_token * act_bytes + 2 * seq * seq / cp


def expert_params(family, cfg) -> tuple[float, int]:
    """(routed-expert parameters of the model, of one MoE layer), from the family's total and active counts:
    a token skips `n_experts - top_k` experts of every MoE layer."""
    per_layer = cfg.n_experts * 3 * cfg.dim * cfg.expert_ffn_dim
    skipped = family.param_count(cfg) - family.active_param_count(cfg)
    return skipped * cfg.n_experts / (cfg.n_experts - cfg.top_k), per_layer


def _root_copies(family, cfg, bf16: bool, experts: bool = True) -> float:
    """FSDP2's root group (the parameters outside `model.layers`: embedding, head, final norm; DeepSeek-V3's
    MTP modules, less their routed experts under expert parallelism: `experts`) is gathered whole for the
    forward and the backward, in the compute precision: calibrated against `ttt plan --simulate` (llama31_8b
    fsdp=8 gathers 2.4 GiB at its peak, two blocks' copies are 0.8 GiB of it; deepseekv3_671b ep=256,fsdp=256
    4.5 GiB, of which the root group is 4.1 GiB). A family whose blocks are not all `block_params` says its
    own count (`ModelFamily.root_params`) or, without one (flux: two kinds of block), counts none here."""
    if family.root_params is not None:
        return (2 if bf16 else 4) * family.root_params(cfg, experts)
    if not hasattr(cfg, "n_layers"):
        return 0.0
    rest = family.param_count(cfg) - cfg.n_layers * family.block_params(cfg)
    return (2 if bf16 else 4) * max(0.0, rest)


def _estimate_tp(
    bench, tier, gpus, gpu_mem_gib, ac, micro, bf16, tp, fp8: Fp8 | None = None, ep: int | None = None,
    cp: int = 1, replicas: int = 1,
) -> Estimate:  # fmt: skip
    """tp x fsdp, or tp x ep x fsdp with `ep` (module docstring); with `cp` (`tp=T,cp=C[,fsdp=F]`) FSDP2
    shards over the gpus / tp ranks of (fsdp, cp) as the code does (`Plan.shard_ranks`), a rank's tokens
    are 1/cp of each sequence, and it gathers the K/V of its heads (1/tp of them) over the whole sequence.
    A task's frozen parameters (LoRA's base: every block weight but the adapters, and the embedding and
    head) take the task's frozen bytes per parameter, not 16. An MoE family's router and routed experts are not cut by TP: the router is sharded
    over the fsdp ranks only, the experts too, or with `ep` held as slices of 1/ep (FSDP2 ignores them).
    `replicas`: HSDP x TP (`dp_replicate=R,fsdp=S,tp=T`): FSDP2 shards over S = gpus / tp / R ranks only, so
    the states are those of `tp=T,fsdp=S`, while the batch splits over all gpus / tp data-parallel ranks."""
    family, cfg = bench.family, tier.model
    data = gpus // tp  # the data-parallel ranks: every sample stream
    fsdp = data // replicas  # the ranks FSDP2 shards over
    block = family.block_params(cfg)
    blocks = cfg.n_layers * block
    rest = family.param_count(cfg) - blocks  # embedding, head, final norm
    trainable, frozen = bench.task.param_counts(family, tier)
    # What TP does not cut (an MoE's router and experts): the model's, and of one gathered block.
    whole = whole_block = experts = layer_experts = 0.0
    if hasattr(cfg, "n_experts"):
        experts, layer_experts = expert_params(family, cfg)
        whole = experts + cfg.n_layers * cfg.dim * cfg.n_experts
        whole_block = cfg.dim * cfg.n_experts + (0 if ep else layer_experts)
    cut = blocks - whole  # per model: cut by TP, sharded by FSDP2
    if family.tensor_parallel_whole is not None:
        # The family counts what its plan keeps whole, the embedding and head among it, for blocks that are
        # not all `block_params` (DeepSeek-V3's dense-first layers and MTP): the rest is cut.
        kept, kept_block = family.tensor_parallel_whole(cfg)
        rest, whole = 0, experts + kept
        cut = family.param_count(cfg) - whole
        whole_block = kept_block + (0 if ep else layer_experts)
    cut_block = block - (whole_block + (layer_experts if ep else 0))
    if frozen:  # the adapters sit in the blocks; everything else is frozen
        fb = bench.task.frozen_bytes(tier, bf16)
        states = (16 * trainable + fb * (blocks - trainable)) / (tp * fsdp) + fb * rest / fsdp
        grads = 4 * trainable / (tp * fsdp)
        trained_block = trainable / cfg.n_layers
    else:
        held = (whole - experts) / fsdp + experts / (ep or fsdp)  # router over fsdp; experts over ep or fsdp
        states = 16 * (cut / (tp * fsdp) + rest / fsdp + held)
        grads = states / 4  # 4 of the 16 B
        trained_block = cut_block + whole_block * tp  # (divided by tp below: whole_block is not cut)
    # Two unsharded blocks (module docstring) and, through the backward, the unsharded fp32 gradients of
    # the block FSDP2 reduce-scatters (reduce_dtype fp32, train/parallel.py): with checkpointing they
    # outweigh a block's activations (llama31_405b tp=2,fsdp=128 with AC: `--simulate` 59.4 GiB, the
    # formula 52.9 without them, 58.8 with). Under ep the local expert slices' bf16 copies, of every layer
    # (the step's cast cache, as under `ep,fsdp`).
    copies = (
        (2 if bf16 else 4) * 2 * (cut_block / tp + whole_block)
        + 4 * trained_block / tp
        + _root_copies(family, cfg, bf16, experts=not ep)
        - _fp8_saving(fp8, True, True, tp)
        + (2 * experts / ep if ep and bf16 else 0)
    )
    seq = bench.task.sample_items(tier)[1]
    tokens = micro * seq // cp
    act = activation_bytes(family, cfg, tokens, 2 if bf16 else 4, ac, tp)
    act += context_parallel_bytes(cfg, micro, seq, cp, 2 if bf16 else 4, ac) / tp  # (the masks too: small)
    end = backward_end_bytes(family, cfg, tokens, 2 if bf16 else 4, ac, tp)
    act, peak = _peak(bench, tier, act, max(tier.global_batch_size // data, 1), 2 if bf16 else 4, cp)
    margin = margin_bytes(gpu_mem_gib)
    # A rank's samples: those of its data-parallel rank (data / cp of them), 1/cp of each.
    overlap = backward_overlap(tier.global_batch_size * cp // data, micro, grads, act, end, peak)
    label = f"tp={tp},ep={ep},fsdp={fsdp}" if ep else f"tp={tp},fsdp={fsdp}"
    if replicas > 1:
        label = f"dp_replicate={replicas},fsdp={fsdp},tp={tp}"
    return Estimate(label, ac, micro, states, copies, act, margin, peak, overlap, tier.global_batch_size)


def _tp_degrees(family, cfg, gpus: int, gpus_per_node: int, task=None) -> list[int]:
    """TP degrees to try: where the family has a plan that accepts them (`tensor_parallel_check`: heads and
    FFN width divide) for a task that does not decode (`parallel.check_tensor_parallel`), and within one node
    (a TP group's collectives sit on every block: they need the NVLink domain, not the network)."""
    if family.tensor_parallel is None or getattr(task, "on_policy", False):
        return []
    node = min(gpus, gpus_per_node)

    def accepted(t: int) -> bool:
        try:
            if family.tensor_parallel_check is not None:
                family.tensor_parallel_check(cfg, t)
        except UserError:
            return False
        return True

    return [t for t in (2, 4, 8) if node % t == 0 and accepted(t)]


def _kind(p: parallel.Plan) -> str:
    """The estimate's kind; HSDP's replicas (`replicas`) ride on it: `hsdp`, `tp` or `ep,fsdp` with them."""
    if p.tp > 1:
        return "tp,ep" if p.ep > 1 else "tp"
    if p.dp_replicate > 1 and p.ep == 1:
        return "hsdp"
    if p.ep > 1:
        return "ep,fsdp" if p.fsdp > 1 else "ep"
    return "fsdp" if p.fsdp > 1 else "dp"


def _check_supported(bench, tier) -> None:
    """One line for a benchmark whose memory the estimate cannot count, saying why and what to run."""
    decoder = all(hasattr(tier.model, k) for k in ("dim", "vocab_size", "n_layers"))
    if bench.family.activation_bytes is None and not decoder:
        n = bench.family.param_count(tier.model)
        raise UserError(
            f"ttt plan {bench.name}: no memory model for the {bench.family.name} family (it counts decoders and "
            f"MMDiTs); its {_count(n)} parameters take {16 * n / GiB:.2f} GiB of weights, gradients and Adam "
            "moments per GPU, so the layout does not limit it: run it data-parallel (the default, --parallel dp=N)"
        )


def _check_experts(cfg, spec: str, ep: int) -> None:
    """`ttt run` refuses experts that do not split over the ep ranks (train/expert_parallel.py)."""
    if cfg.n_experts % ep:
        raise UserError(
            f"--parallel {spec!r}: {cfg.n_experts} experts do not split over {ep} expert-parallel ranks; use an "
            f"ep that divides {cfg.n_experts}"
        )


def plan(
    bench, tier, gpus: int, gpu_mem_gib: float, parallel_spec: str | None, bf16: bool = True,
    gpus_per_node: int = 8, fp8: Fp8 | None = None, ac: int | None = None, searched: bool = False,
):  # fmt: skip
    """All candidate configurations with their estimates, and the suggested one (or None if none fits).
    `searched`: `parallel_spec` is one the search tries (`_context_parallel_rows`), not the user's: a layout
    the formula cannot count (`padded_experts`: padded expert shards) is left out rather than estimated.
    `ac`: only that activation checkpointing (`--ac`: 1, `--ac-every K`: K); None: each layout without and
    with checkpointing of every block.
    `parallel_spec` (`--parallel`) is read by `parallel.parse`, as `ttt run` reads it, with --gpus as the
    world size; only layouts `ttt run` would accept are estimated (the batch splits over the data-parallel
    ranks, TP divides the heads and the FFN width, the experts split over the ep ranks). Without it: dp and
    fsdp, for an MoE model ep and ep x fsdp too, HSDP (x EP) across nodes, then tp x fsdp (TP within a node)
    if none of those fits, then cp x fsdp (x ep, x tp) within a node if none of those fits either, then cp x
    tp across nodes with TP filling a node, then pp x tp x fsdp if nothing does (module docstring)."""
    if gpus < 1:
        raise UserError(f"--gpus {gpus} must be at least 1")
    if not (math.isfinite(gpu_mem_gib) and gpu_mem_gib > 0):
        raise UserError(f"--gpu-mem {gpu_mem_gib:g} must be a positive, finite number of GiB")
    check_nodes(gpus, gpus_per_node)
    _check_supported(bench, tier)
    n = bench.family.param_count(tier.model)
    gbs = tier.global_batch_size
    acs = (0, 1) if ac is None else (parallel.check_ac_every(ac, getattr(tier.model, "n_layers", None)),)

    def rows_of(
        kind: str, local: int, tp: int = 1, ep: int | None = None, replicas: int = 1, cp: int = 1
    ) -> list[Estimate]:
        if _refused_share(bench, tier, local, gbs // local):  # no row `ttt run` takes (GRPO: whole groups)
            return []
        if (ep or kind.startswith("ep")) and tier.eval_samples % (gbs // local):
            return []  # `ttt run` refuses it: every rank in every eval forward (`parallel.check_eval_split`)
        if (searching or searched) and padded_experts(tier, kind, gpus, tp, ep, replicas):
            left_out.append(kind)
            return []
        micros = [m for m in (1, 2, 4, 8, 16) if m <= local and local % m == 0]
        return [estimate(bench, tier, n, gpus, gpu_mem_gib, kind, ac, m, bf16, tp=tp, fp8=fp8, ep=ep,
                         replicas=replicas, cp=cp)
                for ac in acs for m in micros]  # fmt: skip

    # Suggest only what fits with 10% to spare: the estimate itself can be off by 5-10%.
    cap = HEADROOM * gpu_mem_gib * GiB
    searching = not parallel_spec
    left_out: list[str] = []  # kinds `padded_experts` kept from the search, for the refusal's reason
    if parallel_spec:
        given = parallel.parse(parallel_spec, gpus, world_from="--gpus is")
        local = parallel.check_batch_split(gbs, given)
        if given.cp > 1:
            context_parallel.check(bench, tier, given, parallel_spec)
        if given.pp > 1:
            pipeline.check(bench, tier, given, local, local, False, "--parallel")
            # A family whose stack is not a decoder (flux): `pipeline.build`'s refusal, before any count.
            if not (family_decoder(bench) and hasattr(tier.model, "vocab_size")):
                raise UserError(
                    f"--parallel pp: the {bench.family.name} family's model has no pipeline split yet"
                )
            rows = _pipeline_rows(bench, tier, given, gpus, gpu_mem_gib, local, acs, bf16, fp8)
            # the smallest micro-batch: the most micro-batches, the least bubble (the search's order below)
            best = max(
                (r for r in rows if r.total <= cap), key=lambda r: (not r.ac, -r.micro_batch), default=None
            )
            return n, rows, best
        kind = _kind(given)
        if given.ep > 1 and not hasattr(tier.model, "n_experts"):
            raise UserError(
                f"--parallel {parallel_spec!r}: expert parallelism needs a mixture-of-experts model"
            )
        if given.ep > 1:
            _check_experts(tier.model, parallel_spec, given.ep)
        if given.tp > 1:
            parallel.check_tensor_parallel(bench.family, tier.model, parallel_spec, given.tp, bench.task)
        parallel.check_eval_split(tier.eval_samples, given)  # (as `ttt run`'s preflight, after the tp checks)
        bench.task.check_share(tier, local, given.data_parallel)  # (GRPO: whole groups per rank)
        rows = rows_of(
            kind, local, given.tp, given.ep if given.ep > 1 else None, given.dp_replicate, given.cp
        )
        if given.cp > 1:  # the rows' labels name the data-parallel kind over all GPUs: name the layout
            label = ",".join(f"{k}={getattr(given, k)}" for k in parallel.KINDS if getattr(given, k) > 1)
            rows = [dataclasses.replace(r, parallel=label) for r in rows]
    else:

        def named(spec: str) -> list[Estimate]:
            return _named_rows(bench, tier, gpus, gpu_mem_gib, spec, bf16, gpus_per_node, fp8, ac)

        rows = _data_parallel_rows(tier, gpus, gpus_per_node, rows_of, named)
        # Tensor parallelism only where sharding alone cannot fit: it adds collectives to every block. Context
        # parallelism only where nothing before it fits or splits the batch (module docstring). An MoE model
        # tries CP first (`_moe`): its TP plans leave the router and routed experts whole on every TP rank of
        # a group, run on all the group's tokens (the same MoE T times over), where CP splits every layer's
        # tokens, the experts' included, for one K/V exchange per attention layer.
        stages = [
            lambda: _tensor_parallel_rows(bench, tier, gpus, gpus_per_node, rows_of),
            lambda: _context_parallel_rows(bench, tier, gpus, gpu_mem_gib, bf16, gpus_per_node, fp8, ac),
        ]
        for stage in reversed(stages) if _moe(tier) else stages:
            if not any(r.total <= cap for r in rows):
                rows += stage()
        if not any(r.total <= cap for r in rows):
            # Then a sample's C x T ranks across nodes, TP filling each node (NVIDIA's 405B layout): before a
            # pipeline, whose bubble costs more than CP's K/V exchange over the network (`CROSS_NODE_CP`).
            rows += _context_parallel_rows(
                bench, tier, gpus, gpu_mem_gib, bf16, gpus_per_node, fp8, ac, across_nodes=True
            )
        if not any(r.total <= cap for r in rows):
            # Pipeline parallelism last: only where no layout without it fits or splits the batch.
            rows += _pipeline_search_rows(bench, tier, gpus, gpu_mem_gib, bf16, gpus_per_node, fp8, ac, cap)
        if not rows:
            raise _no_split(bench, tier, gpus, left_out)
    return n, rows, _pick([r for r in rows if r.total <= cap])


def _named_rows(bench, tier, gpus, gpu_mem_gib, spec, bf16, gpus_per_node, fp8, ac) -> list[Estimate]:
    """The rows of `spec`, a layout the search tries, planned as `--parallel` names it, so through every check
    of `ttt run`'s preflight; none where those refuse it."""
    try:
        return plan(bench, tier, gpus, gpu_mem_gib, spec, bf16, gpus_per_node, fp8, ac, True)[1]
    except UserError:
        return []


def _pick(fitting: list[Estimate]) -> Estimate | None:
    """The suggestion among the rows that fit (`plan`), None where none does."""
    # Prefer no pipeline, then the fewest stages (a practitioner's pick: each stage adds to the schedule's
    # bubble, (P - 1) of its P - 1 + micro-batches idle, and a hand-off per micro-batch; pipeline rows are
    # only tried where nothing without them fits), then no tensor parallelism, then the smallest TP degree
    # (its collectives sit on every block), then the smallest CP degree (its K/V all-gathers sit on every
    # attention layer; a CP group across nodes is only estimated where none within a node fits, so it never
    # meets one here), then no recomputation, then HSDP across nodes (its all-gathers stay on a node, where
    # fsdp over every GPU all-gathers every block over the network, forward and backward; a larger
    # micro-batch gains less), then the larger micro-batch (fewer, bigger matmuls; under a pipeline the
    # smaller: more micro-batches shrink its bubble, 7 / 43 of the step at 36 micro-batches of 8 stages,
    # 7 / 16 at 9), then DDP (no gathers).
    return max(
        fitting,
        key=lambda r: (
            -degree(r, "pp"), -tp_degree(r), -degree(r, "cp"), not r.ac, r.parallel.startswith("dp_replicate"),
            r.micro_batch if degree(r, "pp") == 1 else -r.micro_batch, r.parallel.startswith("dp="),
        ),
        default=None,
    )  # fmt: skip


def _no_split(bench, tier, gpus: int, left_out: list[str]) -> UserError:
    """`plan`'s one line where the search found no row: the batch splits over no layout it tries."""
    gbs = tier.global_batch_size
    # where it splits, the task may refuse the share (GRPO: whole groups per rank): say why
    why = _refused_share(bench, tier, gbs // gpus, gpus) if gbs % gpus == 0 else ""
    why = f" ({why})" if why else ""
    if left_out:
        why += (
            f"; layouts with FSDP2 over more than the model's {tier.model.n_experts} experts, whose "
            "expert weights no dimension splits evenly over, are left out (their padded expert shards "
            "are not counted: see `padded_experts`)"
        )
    return UserError(
        f"--gpus {gpus}: global_batch_size {gbs} does not split over {gpus} data-parallel ranks{why} (nor "
        "over the fsdp ranks of a tensor-, context- or pipeline-parallel layout): change --gpus or "
        "--set global_batch_size"
    )


def _tensor_parallel_rows(bench, tier, gpus: int, gpus_per_node: int, rows_of) -> list[Estimate]:
    """tp x fsdp for each TP degree within a node (and across nodes HSDP x TP too); for an MoE family tp x ep
    x fsdp (`plan`'s search, where no layout without TP fits or splits the batch)."""
    gbs, rows = tier.global_batch_size, []
    for t in _tp_degrees(bench.family, tier.model, gpus, gpus_per_node, bench.task):
        data = gpus // t  # TP ranks share samples
        if gbs % data:
            continue
        if not hasattr(tier.model, "n_experts"):
            rows += rows_of("tp", gbs // data, t)
            if gpus > gpus_per_node > t:
                # Across nodes, HSDP x TP: TP and FSDP2 within each node, replicated over the nodes
                # (train/parallel.py), its all-gathers on the node's links as HSDP's are (`plan`'s order puts
                # it first where it fits).
                rows += rows_of("tp", gbs // data, t, replicas=gpus // gpus_per_node)
        elif math.gcd(tier.model.n_experts, data) > 1:
            # An MoE family's plan (gpt_oss): the experts split over the data-parallel ranks by the largest ep
            # dividing both, as the hybrid above (train/parallel.py).
            rows += rows_of("tp,ep", gbs // data, t, ep=math.gcd(tier.model.n_experts, data))
    return rows


def padded_experts(tier, kind: str, gpus: int, tp: int = 1, ep: int | None = None, replicas: int = 1) -> bool:
    """Whether FSDP2 pads an MoE model's stacked expert weights: sharded whole (no expert parallelism to split
    them first) over more ranks than there are experts, it cuts each on the first dimension that divides
    evenly over its ranks (train/expert_fsdp.py: the FFN rows or the model width), and pads only where none
    does. Each rank then holds one expert or none and the all-gathers run over shards padded to one expert
    each, which this formula does not count (before the even cut, simulated, qwen35_397b_grpo's 512 experts
    under `fsdp=128,cp=8` peaked at 139.9 GiB against the formula's 58.8: docs/scale.md), so the search does
    not suggest such a layout."""
    cfg = tier.model
    experts = getattr(cfg, "n_experts", 0)
    if not experts or kind not in ("fsdp", "hsdp", "tp"):  # (the `ep` kinds split the experts first)
        return False
    return expert_fsdp.pads(experts, cfg.dim, cfg.expert_ffn_dim, gpus // (replicas * tp))


def _refused_share(bench, tier, local: int, ranks: int) -> str:
    """The task's one line where it cannot train on `local` samples per data-parallel rank (of `ranks`);
    "" where it can (`Task.check_share`)."""
    try:
        bench.task.check_share(tier, local, ranks)
    except UserError as e:
        return str(e)
    return ""


def _data_parallel_rows(tier, gpus: int, gpus_per_node: int, rows_of, named) -> list[Estimate]:
    """The search's first layouts, where the batch splits over all GPUs (`plan`): dp and fsdp; for an MoE
    model ep and ep x fsdp (or the hybrid); across nodes HSDP, for an MoE model HSDP x EP too (`named`: a
    `--parallel` spec planned through `ttt run`'s checks). None where the batch does not split."""
    gbs = tier.global_batch_size
    if gbs % gpus:
        return []
    kinds = ["dp", "fsdp"]
    moe = hasattr(tier.model, "n_experts")
    if moe and gpus > 1 and tier.model.n_experts % gpus == 0:
        kinds += ["ep", "ep,fsdp"]  # after dp and fsdp: a tie goes to the layout without all-to-all
    rows = [r for k in kinds for r in rows_of(k, gbs // gpus)]
    hybrid = math.gcd(tier.model.n_experts, gpus) if moe else 1
    if moe and tier.model.n_experts % gpus and hybrid > 1:
        # More GPUs than experts (DeepSeek-V3's 256 on 1,024): expert groups of the largest ep that
        # divides both, each slice sharded over the rest (ep=E,fsdp=N, train/parallel.py).
        rows += rows_of("ep,fsdp", gbs // gpus, ep=hybrid)
    if gpus > gpus_per_node > 1:
        # Across nodes, HSDP: FSDP2 within each node, replicated over the nodes (module docstring). Its
        # all-gathers stay on the node's links; it holds fsdp=gpus_per_node's states, so where it fits
        # it goes before fsdp over every GPU (`plan`'s order).
        rows += rows_of("hsdp", gbs // gpus, replicas=gpus // gpus_per_node)
        node_ep = math.gcd(tier.model.n_experts, gpus_per_node) if moe else 1
        if node_ep > 1:
            # An MoE model, HSDP x EP: the same shard groups of one node, the experts split over E of its
            # GPUs (the largest dividing the experts and the node), each slice whole on every replica
            # (`Plan.expert_shards`): its all-to-alls and all-gathers stay on the node, only the gradients
            # cross nodes, so where it fits it goes before `ep=E,fsdp=gpus` (`plan`'s order). At E = the
            # node it holds HSDP's states plus its slices' bf16 copies: a tie goes to HSDP (no all-to-all,
            # listed first), so it is picked where HSDP is not offered, over a node of more GPUs than
            # experts (`padded_experts`: gpt_oss_20b's 32 on nodes of 64).
            reps = gpus // gpus_per_node
            rows += named(f"dp_replicate={reps},fsdp={gpus_per_node},ep={node_ep}")
    return rows


# Context-parallel degrees the search tries: a sample's sequence over up to one node's GPUs (its K/V
# all-gathers sit on every attention layer).
CP_DEGREES = (2, 4, 8)
# Across nodes, only where TP fills each node: a CP pair on two nodes, as NVIDIA runs llama31_405b (TP 8 x
# CP 2). Each CP rank beyond one adds a K/V transfer over the network on every attention layer while a rank's
# attention shrinks to 1/C of the sample: at 2 there is one, which the attention of the rank's own chunk can
# hide; more would be a choice nobody publishes for a pretraining sequence of 8,192 tokens.
CROSS_NODE_CP = (2,)


def _context_parallel_rows(
    bench, tier, gpus, gpu_mem_gib, bf16, gpus_per_node, fp8, ac, across_nodes: bool = False
) -> list[Estimate]:  # fmt: skip
    """`cp=C,fsdp=gpus/C` (an MoE model: and `cp=C,ep=E,fsdp=gpus/C`) for C in `CP_DEGREES` within a node,
    each planned as `--parallel` names it, so through the checks `ttt run`'s preflight runs
    (`parallel.parse`, the batch split over gpus/C data-parallel ranks, `context_parallel.check`); a layout
    those refuse is left out. `across_nodes`: instead `cp=C,tp=node[,fsdp=F]` for C in `CROSS_NODE_CP`, the
    C x T ranks of a sample on C nodes, TP filling each (the llama family; `plan` tries them only where no
    layout within a node fits or splits the batch)."""
    specs, rows = [], []
    if across_nodes:
        t = gpus_per_node
        tps = _tp_degrees(bench.family, tier.model, gpus, gpus_per_node, bench.task) if gpus > t else []
        specs = [
            f"cp={c},tp={t}" + (f",fsdp={gpus // (c * t)}" if gpus > c * t else "")
            for c in CROSS_NODE_CP
            if t in tps and gpus % (c * t) == 0
        ]
    # An MoE model: with its experts split over the largest E dividing them and the GPUs (groups of E of
    # the flattened (fsdp, cp) ranks, train/parallel.py), after the layout without all-to-all (a tie goes
    # to that one). FSDP2 then gathers a block without its experts (DeepSeek-V3's 256 experts are 11 B
    # parameters a layer), so it fits where `cp=C,fsdp=F` may not.
    experts = getattr(tier.model, "n_experts", 0)
    ep = math.gcd(experts, gpus) if experts else 1
    for c in () if across_nodes else CP_DEGREES:
        if gpus % c or gpus // c < 2 or c > gpus_per_node:
            continue
        specs += [f"cp={c},fsdp={gpus // c}"] + ([f"cp={c},ep={ep},fsdp={gpus // c}"] if ep > 1 else [])
        # With tensor parallelism (`cp=C,tp=T[,fsdp=F]`, the llama family's dense decoders: what
        # `context_parallel.check` takes), the C x T ranks of a sample within one node: where neither cp nor
        # tp alone fits, each cutting what the other leaves whole (TP the states and a block's heads, CP the
        # sequence, the head's and loss's included). Fewer TP first, then fewer CP (`plan`'s order).
        for t in _tp_degrees(bench.family, tier.model, gpus // c, gpus_per_node, bench.task):
            if min(gpus, gpus_per_node) % (c * t) == 0:
                f = gpus // (c * t)
                specs.append(f"cp={c},tp={t}" + (f",fsdp={f}" if f > 1 else ""))
    for spec in specs:
        rows += _named_rows(bench, tier, gpus, gpu_mem_gib, spec, bf16, gpus_per_node, fp8, ac)
    return rows


# Pipeline degrees the search tries (`_pipeline_search_rows`): up to 32 stages (405B's 126 layers: 4 a stage).
PP_DEGREES = (2, 4, 8, 16, 32)


def _pipeline_search_rows(
    bench, tier, gpus, gpu_mem_gib, bf16, gpus_per_node, fp8, ac, cap
) -> list[Estimate]:  # fmt: skip
    """`pp=P[,tp=T][,fsdp=F]` (P x T x F = gpus; T as `_tp_degrees` allows within a node, none too; no `dp`,
    which the pipeline does not compose with; an MoE model `pp=P[,tp=T],ep=E,fsdp=F`) for P in `PP_DEGREES`,
    fewest stages first, stopping after the first P with a layout that fits: more stages only add to the
    bubble (`plan`'s order). Each is planned as `--parallel` names it (`_pipeline_rows`), so through the checks of `ttt run`'s preflight
    (`parallel.parse`, the batch split over the F data-parallel ranks, `pipeline.check`: the family and task
    have a stage split, P stages within the layers, a micro-batch count the 1F1B schedule takes); a layout
    those refuse is left out."""
    rows: list[Estimate] = []
    if not hasattr(tier.model, "n_layers"):
        return rows
    experts = getattr(tier.model, "n_experts", 0)
    for p in PP_DEGREES:
        if gpus % p or p > tier.model.n_layers:
            continue
        if experts:
            # An MoE model: `pp=P[,tp=T],ep=E,fsdp=F` (train/pipeline_moe.py), E the largest dividing the
            # experts and a stage's F data-parallel ranks; without tp the expert slices sharded over its F / E
            # groups, as the hybrid without a pipeline; with tp (as `_tp_degrees` allows within a node) whole
            # on each of them. E = 1 (one GPU a stage, or experts that share no factor with F) is what
            # `pipeline.check` refuses for an MoE model.
            specs = []
            for t in (1, *_tp_degrees(bench.family, tier.model, gpus // p, gpus_per_node, bench.task)):
                f = gpus // p // t
                e = math.gcd(experts, f)
                if e > 1:
                    specs.append(f"pp={p}" + (f",tp={t}" if t > 1 else "") + f",ep={e},fsdp={f}")
        else:
            specs = [
                f"pp={p}"
                + (f",tp={t}" if t > 1 else "")
                + (f",fsdp={gpus // p // t}" if gpus // p // t > 1 else "")
                for t in (1, *_tp_degrees(bench.family, tier.model, gpus // p, gpus_per_node, bench.task))
            ]
        for spec in specs:
            rows += _named_rows(bench, tier, gpus, gpu_mem_gib, spec, bf16, gpus_per_node, fp8, ac)
        if any(r.total <= cap for r in rows):
            break
    return rows


@functools.lru_cache(maxsize=256)
def _stage_layers(
    costs: tuple[float, ...], head: float, pp: int, vpp: int, first_dense: int = 0
) -> tuple[int, int]:
    """(layers, of them dense) of the pipeline rank `pipeline.split_layers` loads most (its V stages
    together): the most MoE layers, then the most layers (a model's first `first_dense` layers are dense,
    DeepSeek-V3's 3: a stage of MoE layers, not the first with the dense ones, holds the most parameters).
    Cached, since the split's exact search is most of a pipeline row's cost and the search plans many."""
    ranges = pipeline.split_layers(list(costs), head, pp * vpp)

    def load(r: int) -> tuple[int, int]:
        mine = ranges[r::pp]
        dense = sum(max(0, min(hi, first_dense) - lo) for lo, hi in mine)
        return sum(hi - lo for lo, hi in mine) - dense, dense

    moe, dense = max((load(r) for r in range(pp)), key=lambda x: (x[0], x[0] + x[1]))
    return moe + dense, dense


def _pipeline_rows(bench, tier, given, gpus, gpu_mem_gib, local, acs, bf16, fp8) -> list[Estimate]:
    """`pp=P[,vpp=V],...` (train/pipeline.py): the most loaded rank holds the most layers the stage split
    gives a rank (`pipeline.split_layers`, the head weighed in) and one of the embedding and the head,
    estimated as the layout without `pp` on the GPUs of one stage for a model of that depth, with what
    torch's schedule changes:
    - the micro-batches in flight on the first rank: 1F1B runs P forwards before its first backward, so P
      micro-batches of the rank's blocks' activations; interleaved 1F1B (ScheduleInterleaved1F1B) warms up
      with (V - 1) P + 2 (P - 1) forwards of one virtual stage (L / (P V) layers), one more in the steady
      state; at most the step's micro-batches. The rest (head and loss, the block AC recomputes) once;
    - under FSDP2 it turns gradient reduction and resharding off until the last micro-batch: the stage's
      gradients whole in fp32 and its parameters gathered (per TP rank), not shards and two blocks; save
      for the wraps `--set pp_reduce=` reduces and reshards per micro-batch (train/pipeline_reduce.py):
      `experts` (the default) the sharded expert slices, of which one layer's is then gathered with its
      gradient whole at a time, `stage` all (the layout's own row);
    - one rank per stage (`pp=P` alone) has no DDP, so none of its buckets.
    Of a task that freezes the model (LoRA) only the trainable parameters (its adapters, all in the blocks)
    have gradients: the two corrections above count those, the stage's states its adapters' optimizer
    states and its base at `Task.frozen_bytes` (`estimate`, from `Task.param_counts` at the stage's depth).
    Under fp8 the stage's row is `estimate`'s with its float8 savings, as without pp, and the gathered stage
    holds its float8 linears at `Fp8.gather_bytes` (1 B under tensorwise's float8 all-gathers).
    Against `--simulate` (which runs the schedule, timetotrain/train/simulate.py), peaks without the margin:
    llama31_8b reference `pp=2,fsdp=4`, no AC, `--layers 3`: 75.1 GiB simulated; llama31_405b
    `pp=8,tp=8,fsdp=8`, AC, full depth: 51.2 GiB simulated (the figures of this formula: docs/scale.md)."""
    cfg = tier.model
    pp, vpp = given.pp, given.vpp
    costs, head = pipeline.stage_costs(bench, cfg)  # the split's own costs (DeepSeek: per layer, MTP)
    layers, dense = _stage_layers(tuple(costs), head, pp, vpp, getattr(cfg, "first_dense", 0))

    def deep(n: int):  # the model of n layers, the stage's dense ones first (DeepSeek-V3: at most n)
        return dataclasses.replace(
            cfg, n_layers=n, **({"first_dense": min(dense, n)} if hasattr(cfg, "first_dense") else {})
        )

    n_stage = bench.family.param_count(deep(layers)) - cfg.vocab_size * cfg.dim
    inner = dataclasses.replace(given, pp=1, vpp=1)
    n_slice = 0.0  # the stage's expert slice on a GPU, where FSDP2 shards it over its replicas
    if given.ep > 1:
        # `pp=P,ep=E,fsdp=N` (train/pipeline_moe.py): the stage's layout row holds 1/E of the experts already
        # (1/N where FSDP2 shards each slice over its N/E replicas); what the schedule keeps whole below is
        # the rest, and the sharded slices: the schedule defers their wrap's reduction and resharding too.
        stage_experts = expert_params(bench.family, deep(layers))[0]
        n_stage -= stage_experts
        if inner.expert_shards > 1:
            n_slice = stage_experts / given.ep
    depth = dataclasses.replace(tier, model=deep(layers))
    trainable, frozen = bench.task.param_counts(bench.family, depth)
    n_grads = trainable if frozen else n_stage  # a frozen base has no gradients (LoRA: the adapters do)
    # Under cp FSDP2 shards a stage over its (fsdp, cp) ranks even at fsdp=1 (`Plan.shard_ranks`).
    kind = "fsdp" if _kind(inner) == "dp" and given.cp > 1 else _kind(inner)
    shards = given.shard_ranks

    def at(depth: int, ac: int, m: int) -> Estimate:  # the layout of one stage, for a model of `depth`
        model = deep(depth)
        n = bench.family.param_count(model) - cfg.vocab_size * cfg.dim  # one of embedding and head
        return estimate(bench, dataclasses.replace(tier, model=model), n, gpus // pp, gpu_mem_gib, kind, ac, m,
                        bf16, tp=inner.tp, fp8=fp8, ep=inner.ep if inner.ep > 1 else None,
                        replicas=inner.dp_replicate, cp=inner.cp)  # fmt: skip

    rows = []
    for ac in acs:
        for m in (1, 2, 4, 8, 16):
            accum = local // m if local % m == 0 else 0
            if not (accum >= pp if vpp == 1 else accum and accum % pp == 0):
                continue
            if vpp == 1:
                in_flight = min(accum, pp)
            else:
                chunks = min(accum * vpp, (vpp - 1) * pp + 2 * (pp - 1) + 1)
                in_flight = chunks / vpp  # in micro-batches of the rank's whole share of layers

            e = at(layers, ac, m)
            # The blocks' activations (kept per micro-batch in flight) apart from the rest (the head and loss,
            # the block recomputed under AC: one at a time): a layer's share is the difference of two depths.
            blocks = (
                layers * (e.activations - at(layers - 1, ac, m).activations) if layers > 1 else e.activations
            )
            stage_layout = "" if e.parallel == "dp=1" else "," + e.parallel  # one GPU per stage
            label = f"pp={pp}" + (f",vpp={vpp}" if vpp > 1 else "") + stage_layout
            if given.cp > 1:  # the stage rows name fsdp over (fsdp, cp): name the stage's layout as given
                kinds = [f"{k}={getattr(given, k)}" for k in parallel.KINDS[1:] if getattr(given, k) > 1]
                label = ",".join([f"pp={pp}", *([f"vpp={vpp}"] if vpp > 1 else []), *kinds])
            states, copies = e.states, e.compute_copies
            if not stage_layout:  # one rank per stage: no DDP, so none of its buckets (a gradient copy)
                states -= 4 * n_grads
            if shards > 1 and tier.pp_reduce != "stage":
                # torch's schedule turns FSDP2's gradient reduction and resharding off until the last
                # micro-batch: the stage's gradients whole in fp32 and its parameters gathered, per TP rank.
                states += 4 * n_grads / inner.tp * (1 - 1 / shards)
                gathered = (2 if bf16 else 4) * n_stage / inner.tp
                if tier.pp_reduce == "step":  # the sharded expert slices too
                    states += 4 * n_slice * (1 - 1 / inner.expert_shards)
                    gathered += (2 if bf16 else 4) * n_slice
                elif n_slice:  # they reshard per micro-batch: one MoE layer's slice gathered, gradient whole
                    gathered += ((2 if bf16 else 4) + 4) * n_slice / (layers - min(dense, layers))
                if fp8 is not None and bf16:  # the float8 linears gathered in float8 (tensorwise)
                    gathered -= (2 - fp8.gather_bytes) * fp8.per_block * layers / inner.tp
                copies = max(copies, gathered)
            act = blocks * in_flight + (e.activations - blocks)
            rows.append(
                dataclasses.replace(
                    e, parallel=label, states=states, compute_copies=copies, activations=act, overlap=0.0
                )
            )
    return rows


def plan_at_legal_gbs(bench, tier, gpus: int, plan_at, retier=None):
    """(tier, plan_at(tier), note): the plan at the tier's GBS; where that GBS does not split over `gpus`,
    or nothing fits at it, and `retier` (GBS -> the tier at that GBS, with its RCP's LR and warmup) is given,
    the plan at the smallest larger GBS of the benchmark's RCP table (a legal closed-division batch size)
    where a layout without tensor, context or pipeline parallelism fits, else where one without context or
    pipeline parallelism fits, said in the note; then a context- or pipeline-parallel layout at the tier's
    GBS, else at the smallest legal GBS (CP and PP are searched last, `plan`). An MoE model's CP within a
    node counts as TP does here (`_last_resort`): its search tries CP before TP. At 256 GPUs real
    submissions run llama31_8b at such a GBS, where the tier's 16 splits over no layout."""
    try:
        own, refused = plan_at(tier), None
    except UserError as e:
        own, refused = None, e
    moe = _moe(tier)
    if own is not None and own[2] is not None and not _last_resort(own[2], moe):
        return tier, _with_legal_rows(bench, tier, own, plan_at, retier), None
    legal = sorted(g for g in bench.rcp_hparams if g > tier.global_batch_size) if retier else []
    fallback = None  # the smallest legal GBS where a layout with TP fits
    later_cp = None  # the smallest where only a context- or pipeline-parallel layout fits
    for gbs in legal:
        at = retier(gbs)
        try:
            found = plan_at(at)
        except UserError:
            continue
        if found[2] is None:
            continue
        if _last_resort(found[2], moe):
            later_cp = later_cp or (at, found, _gbs_note(bench, tier, at, gpus, refused, "a layout"))
        elif not _shares_samples(found[2]):
            return at, found, _gbs_note(bench, tier, at, gpus, refused, "a layout without TP or CP")
        elif fallback is None:
            what = "a layout without CP" if degree(found[2], "cp") == 1 else "a layout without TP"
            fallback = at, found, _gbs_note(bench, tier, at, gpus, refused, what)
    # Context and pipeline parallelism last: the search tries them only where nothing else fits (`plan`),
    # and a legal GBS where something else fits is that search's answer too.
    if fallback:
        return fallback
    if own is not None and own[2] is not None:
        return tier, own, None
    if later_cp:
        return later_cp
    if refused:
        raise refused
    return tier, own, None


def _with_legal_rows(bench, tier, found, plan_at, retier):
    """`found` (the plan at the tier's GBS) with, where its suggestion needs TP (the tier's GBS splits over
    no dp, fsdp or HSDP layout of the GPUs), the rows of the smallest larger GBS of the RCP table where a
    layout without TP, CP or PP fits, each row saying its GBS: the layouts real submissions run at that
    size (llama31_8b on 64 GPUs: fsdp=64 or dp_replicate=8,fsdp=8 at GBS 64), offered beside the
    suggestion, which keeps the tier's GBS (`plan_at_legal_gbs`)."""
    n, rows, best = found
    if retier is None or not _shares_samples(best):
        return found
    have = {r.parallel for r in rows}
    for gbs in sorted(g for g in bench.rcp_hparams if g > tier.global_batch_size):
        try:
            _, more, other = plan_at(retier(gbs))
        except UserError:
            continue
        if other is not None and not _shares_samples(other) and not _last_resort(other):
            plain = [
                r for r in more if not _shares_samples(r) and not _last_resort(r) and r.parallel not in have
            ]
            return n, rows + plain, best
    return found


def _last_resort(r: Estimate, moe: bool = False) -> bool:
    """A context- or pipeline-parallel suggestion: the search's last resorts (`plan`), which a legal larger
    GBS where a layout without them fits goes before (`plan_at_legal_gbs`). For an MoE model (`moe`) CP
    within a node is not: the search tries it before TP (`plan`), and it takes TP's place in these rules."""
    return (degree(r, "cp") > 1 and not moe) or degree(r, "pp") > 1


def _shares_samples(r: Estimate) -> bool:
    """Whether a sample spans several GPUs (TP or CP), so that a legal larger GBS would let a layout without
    them split the batch (`plan_at_legal_gbs`, `_with_legal_rows`)."""
    return tp_degree(r) > 1 or degree(r, "cp") > 1


def _moe(tier) -> bool:
    """An MoE model: its TP plans cut the attention only, so CP goes before TP (`plan`)."""
    return bool(getattr(tier.model, "n_experts", 0))


def _gbs_note(bench, tier, at, gpus: int, refused, what: str) -> str:
    why = "does not split over" if refused else "fits in no layout on"
    return (
        f"GBS: the tier's {tier.global_batch_size} {why} {gpus} GPUs; planned at {at.global_batch_size}, the "
        f"smallest of the RCP table's ({', '.join(map(str, sorted(bench.rcp_hparams)))}) where {what} fits, "
        f"with that RCP's LR {at.lr:g} and warmup {at.warmup_steps} steps"
    )


# TP groups are at most 8 wide (one node's NVLink domain).
MAX_TP = 8


def _spec_at(kind: str, given: parallel.Plan | None, world: int) -> str | None:
    """The --parallel of `kind` at another world size, its degrees grown with the world (a tp degree kept),
    or None (the default candidates) when no layout was given."""
    if given is None:
        return None
    if given.pp > 1:  # the pipeline kept, the layout of one stage grown with the world
        inner = _spec_at(kind, dataclasses.replace(given, pp=1, vpp=1), world // given.pp)
        return f"pp={given.pp}," + (f"vpp={given.vpp}," if given.vpp > 1 else "") + inner
    if given.cp > 1:  # the sequence split kept, the data-parallel layout grown with the world
        return _spec_at(kind, dataclasses.replace(given, cp=1), world // given.cp) + f",cp={given.cp}"
    if kind == "tp":
        return f"tp={given.tp},fsdp={world // given.tp}"
    if kind == "tp,ep":  # the expert-parallel degree kept, as a hybrid's
        return f"tp={given.tp},ep={given.ep},fsdp={world // given.tp}"
    if kind == "hsdp":  # the shard group kept, more replicas
        return f"dp_replicate={world // given.fsdp},fsdp={given.fsdp}"
    if kind == "ep,fsdp":  # a hybrid keeps its expert-parallel degree; ep=N,fsdp=N grows with the world
        return f"ep={given.ep if given.ep < given.fsdp else world},fsdp={world}"
    return f"{kind}={world}"


def _sample_splits(gpus_per_node: int) -> list[int]:
    """The GPUs one data-parallel rank's samples can span in a layout the search tries (`plan`): a TP group
    (1, 2, 4 or `MAX_TP`), cp x tp within a node (up to the node), the CP pair across nodes where TP fills
    each (`CROSS_NODE_CP`), or a pipeline's `PP_DEGREES` stages of a TP group each. A world is the
    data-parallel ranks (a divisor of the global batch) times one of these, so on nodes of 8 only the pair
    across nodes and the pipeline reach above 8 x the global batch (llama31_405b at GBS 16: `cp=2,tp=8,
    fsdp=16` on 256)."""
    tps = (1, 2, 4, MAX_TP)
    node = max(gpus_per_node, MAX_TP)
    within = {t * c for t in tps for c in (1, *CP_DEGREES) if t * c <= node}
    across = {c * gpus_per_node for c in CROSS_NODE_CP}
    stages = {p * t for p in PP_DEGREES for t in tps}
    return sorted(within | across | stages)


def fits_from(
    bench, tier, gpus: int, gpu_mem_gib: float, parallel_spec: str | None, bf16: bool = True,
    gpus_per_node: int = 8, fp8: Fp8 | None = None, ac: int | None = None,
) -> tuple[int, Estimate] | None:  # fmt: skip
    """When nothing fits on --gpus: the smallest larger world size on which the same estimates suggest a
    layout (of the kind --parallel names, grown with the world; else the default candidates), with that
    suggestion; None when none does. Only worlds `ttt run` could take are tried: the batch splits over the
    data-parallel ranks (a divisor of the global batch, times the GPUs a rank's samples span in a layout the
    search tries, `_sample_splits`) and the world is whole nodes of --gpus-per-node (or fits in one), so the
    search is some dozens of plans, not a scan."""
    for w, (_, _, best) in _larger_plans(
        bench, tier, gpus, gpu_mem_gib, parallel_spec, bf16, gpus_per_node, fp8, ac
    ):
        if best is not None:
            return w, best
    return None


def _larger_plans(bench, tier, gpus, gpu_mem_gib, parallel_spec, bf16, gpus_per_node, fp8=None, ac=None):
    """(world, plan) of every world above `gpus` that `ttt run` could take, in increasing order (`fits_from`)."""
    gbs = tier.global_batch_size
    given = parallel.parse(parallel_spec, gpus, world_from="--gpus is") if parallel_spec else None
    kind = _kind(given) if given is not None else ""
    divisors = [d for d in range(1, math.isqrt(gbs) + 1) if gbs % d == 0]
    divisors += [gbs // d for d in divisors]
    worlds = sorted({d * m for d in divisors for m in _sample_splits(gpus_per_node)})
    for w in worlds:
        if given is not None and w % (given.pp * given.tp * given.cp):
            continue
        if w <= gpus or (w > gpus_per_node and w % gpus_per_node):
            continue
        spec = _spec_at(kind, given, w)
        try:
            yield w, plan(bench, tier, w, gpu_mem_gib, spec, bf16, gpus_per_node, fp8, ac)
        except UserError:  # this world splits neither the batch nor the experts: try the next one
            continue


def nothing_fits(
    bench, tier, gpus: int, gpu_mem_gib: float, parallel_spec: str | None, bf16: bool = True,
    gpus_per_node: int = 8, fp8: Fp8 | None = None, ac: int | None = None,
) -> str:  # fmt: skip
    """Why no world fits (when `fits_from` found none), in numbers: the smallest estimate on the largest world
    `ttt run` could take (one sample per data-parallel rank at most), its activations against what the
    device leaves beside the states, bf16 copies and margin, and what would be needed: the sequence split
    over that many GPUs (context parallelism: activations / c)."""
    plans = list(_larger_plans(bench, tier, gpus, gpu_mem_gib, parallel_spec, bf16, gpus_per_node, fp8, ac))
    if not plans:
        plans = [(gpus, plan(bench, tier, gpus, gpu_mem_gib, parallel_spec, bf16, gpus_per_node, fp8, ac))]
    w, (_, rows, _) = plans[-1]
    r = min(rows, key=lambda e: e.total)
    cap = HEADROOM * gpu_mem_gib * GiB
    # Where the backward's end outweighs its start (a negative overlap: `backward_overlap`), the end is what
    # the activations must fit in, not a part of the states.
    fixed = r.states + r.compute_copies + r.margin - max(r.overlap, 0.0)
    act = r.activations - min(r.overlap, 0.0)
    peak = r.peak if r.overlap >= 0 else f"the end of {r.peak}'s backward"
    item, per_sample = bench.task.sample_items(tier)
    head = (
        f"on {w} GPUs, the most `ttt run` takes for GBS {tier.global_batch_size}, the smallest layout "
        f"({r.parallel}, activation checkpointing {parallel.ac_words(r.ac)}, micro-batch {r.micro_batch}) "
        f"for one sample of {per_sample:,} {item} needs ~{act / GiB:,.0f} GiB of "
        f"activations ({peak}) beside ~{fixed / GiB:,.0f} GiB of states, bf16 copies and margin, over the "
        f"{cap / GiB:,.0f} GiB usable ({HEADROOM:.0%} of {gpu_mem_gib:g} GiB)"
    )
    if fixed >= cap:
        return f"nor on more GPUs: {head}; the states alone exceed it: use GPUs with more memory"

    def split(act: float) -> int:
        return math.ceil(act / (cap - fixed))

    need = (
        f"needed: the sequence split over GPUs, context parallelism of at least {split(act)} (or "
        f"tensor parallelism), {_why_no_cp(bench, tier, split(act))}"
    )
    # The device on which this estimate fits, its margin growing with it.
    total = (r.states + r.compute_copies + r.activations - r.overlap + GiB) / (HEADROOM - MARGIN_SHARE) / GiB
    return f"nor on more GPUs: {head}; {need}; or GPUs with ~{total:,.0f} GiB"


def _why_no_cp(bench, tier, c: int) -> str:
    """Why the search offered no context-parallel layout that fits: `ttt run` refuses cp for the benchmark
    (`context_parallel.check`'s reason), or the degree needed is beyond `CP_DEGREES`."""
    try:
        context_parallel.check(bench, tier, parallel.Plan(cp=2, fsdp=2), "cp=2,fsdp=2")
    except UserError as e:
        return f"which `ttt run` refuses here ({str(e).split(': ', 1)[-1].removesuffix(': leave cp out')})"
    if c > max(CP_DEGREES):
        return f"beyond the cp={max(CP_DEGREES)} within a node that the search tries"
    return "which the search tried at cp 2, 4 and 8 where the batch splits (each rank's gathered K/V counted)"


def family_decoder(bench) -> bool:
    """A decoder whose activations `activation_bytes` counts (not a family with its own count: flux)."""
    return bench.family.activation_bytes is None


def launch(
    bench, tier, best: Estimate, gpus: int, gpus_per_node: int = 8, bf16: bool = True, fp8: Fp8 | None = None
) -> dict:
    """The launch line of a suggestion (train/launch.py)."""
    flags = suggested_flags(best, bf16, fp8, tier)
    return launch_lines(bench.name, tier.name, flags, gpus, gpus_per_node, before_launch(bench, tier))


def tp_degree(r: Estimate) -> int:
    return degree(r, "tp")  # anywhere in the layout: `pp=8,tp=8,fsdp=32` too


def degree(r: Estimate, kind: str) -> int:
    """The degree of `kind` (cp, pp, ...) in a row's layout, 1 where it has none."""
    return next((int(v) for k, _, v in (p.partition("=") for p in r.parallel.split(",")) if k == kind), 1)


def suggested_flags(best: Estimate, bf16: bool = True, fp8: Fp8 | None = None, tier=None) -> str:
    """The `ttt run` flags of a suggested configuration, in the precision it was estimated for, with the
    `--set` values the plan was made at (`tier.user_set`: the user's, or a GBS the plan chose), so that
    the run is the one planned."""
    precision = "fp8" if fp8 else "bf16" if bf16 else "fp32"
    flags = f"--parallel {best.parallel} --precision {precision} --set micro_batch_size={best.micro_batch}"
    if fp8 and fp8.recipe != "tensorwise":
        flags += f" --set fp8_recipe={fp8.recipe}"
    for key in sorted(tier.user_set - {"micro_batch_size", "fp8_recipe"}) if tier is not None else ():
        value = getattr(tier, key) if hasattr(tier, key) else getattr(tier.data, key)
        flags += f" --set {shlex.quote(f'{key}={value}')}"
    return flags + (" --ac" if best.ac == 1 else f" --ac-every {best.ac}" if best.ac else "")


def _schedule_words(r: Estimate, tier, gpus: int) -> str:
    """For a pipeline suggestion, the micro-batches of a step its schedule runs (train/pipeline.py: 1F1B
    needs at least pp of them, the interleaved schedule a multiple of pp); nothing otherwise."""
    pp = degree(r, "pp")
    if pp == 1:
        return ""
    local = parallel.check_batch_split(tier.global_batch_size, parallel.parse(r.parallel, gpus))
    need = f"at least {pp}" if degree(r, "vpp") == 1 else f"a multiple of {pp}"
    return f", {local // r.micro_batch} micro-batches a step (the pipeline schedule needs {need})"


def ac_cell(ac: int) -> str:
    """The AC column: off, on, 1/K (every K-th block)."""
    return {0: "off", 1: "on"}.get(ac) or f"1/{ac}"


def _fits(r: Estimate, gpu_mem_gib: float) -> str:
    cap = gpu_mem_gib * GiB
    return "yes" if r.total <= HEADROOM * cap else ("tight" if r.total <= cap else "no")


def plan_doc(
    bench, tier, n_params, rows, best, gpus, gpu_mem_gib, bf16: bool = True, gpus_per_node: int = 8,
    larger: tuple[int, Estimate] | None = None, simulated: dict | None = None, fp8: Fp8 | None = None,
    why: str | None = None,
) -> dict:  # fmt: skip
    """`ttt plan --json`: what format_plan prints, as data (bytes per GPU in GiB). `larger` is
    `fits_from`'s answer when nothing fits."""
    trainable, frozen = bench.task.param_counts(bench.family, tier)
    doc = {
        "benchmark": bench.name,
        "tier": tier.name,
        "parameters": n_params,
        "active_parameters": bench.family.active_param_count(tier.model),
        "trainable_parameters": trainable,
        "frozen_parameters": frozen,
        "global_batch_size": tier.global_batch_size,
        "gpus": gpus,
        "gpus_per_node": gpus_per_node,
        "nodes": check_nodes(gpus, gpus_per_node),
        "gpu_mem_gib": gpu_mem_gib,
        "precision": "fp8" if fp8 else "bf16" if bf16 else "fp32",
        **({"fp8_recipe": fp8.recipe, "fp8_linear_parameters": fp8.linear_params} if fp8 else {}),
        "headroom": HEADROOM,
        "rows": [
            {
                "parallel": r.parallel,
                "ac": bool(r.ac),
                "ac_every": r.ac,  # every ac_every-th block checkpointed; 0: none
                "micro_batch": r.micro_batch,
                "global_batch_size": r.gbs,  # the tier's, or a legal GBS of the RCP table
                "states_gib": r.states / GiB,
                "compute_copies_gib": r.compute_copies / GiB,
                "activations_gib": r.activations / GiB,
                "activations_of": r.peak,  # the training step, or a task phase (GRPO: the rollouts, the logprob check)
                "margin_gib": r.margin / GiB,
                # the columns' sum less the total: the backward's start or end, the larger (`backward_overlap`)
                "overlap_gib": r.overlap / GiB,
                "total_gib": r.total / GiB,
                **(
                    {}
                    if simulated is None
                    else {"simulated_gib": _gib(simulated.get((r.parallel, r.ac, r.micro_batch)))}
                ),
                "fits": _fits(r, gpu_mem_gib),
            }
            for r in rows
        ],
        "suggestion": None,
    }
    if best is None:
        doc["suggestion_reason"] = f"nothing fits within 90% of the device; {_fits_from_text(larger, why)}"
        doc["fits_from"] = None
        if larger is not None:
            w, r = larger
            doc["fits_from"] = {"gpus": w, "parallel": r.parallel, "ac": bool(r.ac), "ac_every": r.ac,
                                "micro_batch": r.micro_batch,
                                "total_gib": r.total / GiB}  # fmt: skip
    else:
        doc["suggestion"] = {
            "parallel": best.parallel,
            "ac": bool(best.ac),
            "ac_every": best.ac,
            "micro_batch": best.micro_batch,
            "total_gib": best.total / GiB,
            "run_flags": suggested_flags(best, bf16, fp8, tier),
            "launch": launch(bench, tier, best, gpus, gpus_per_node, bf16, fp8),
        }
    return doc


def _gib(x: float | None) -> float | None:
    return None if x is None else x / GiB


def _fits_from_text(larger: tuple[int, Estimate] | None, why: str | None = None) -> str:
    if larger is None:
        return why or (
            "nor on more GPUs (any count of whole nodes that splits the global batch, up to 8 GPUs a sample): "
            "use GPUs with more memory"
        )
    w, r = larger
    return (
        f"fits from {w} GPUs ({r.parallel}, activation checkpointing {parallel.ac_words(r.ac)}, micro-batch "
        f"{r.micro_batch}, ~{r.total / GiB:.0f} GiB per GPU)"
    )


def _count(n: float) -> str:
    """A parameter count a person reads at once: 8.03 B, 3.41 M (a tiny tier is not "0.00 B")."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def format_plan(
    bench, tier, n_params, rows, best, gpus, gpu_mem_gib, bf16: bool = True, gpus_per_node: int = 8,
    larger: tuple[int, Estimate] | None = None, simulated: dict | None = None, fp8: Fp8 | None = None,
    why: str | None = None,
) -> str:  # fmt: skip
    """The plan table; `simulated` (`ttt plan --simulate`): {(parallel, ac, micro): simulated bytes with the
    same margin} adds a "simulated" column (train/simulate.py), "-" on the rows not simulated."""
    active = bench.family.active_param_count(tier.model)
    params = f"{_count(n_params)} parameters"
    if active != n_params:
        params += f" ({_count(active)} active per token)"
    item, per_sample = bench.task.sample_items(tier)
    per = f"{per_sample:,} {item} per sample, " if per_sample > 1 else ""  # not "1 images per sample"
    w = max([14] + [len(r.parallel) + 2 for r in rows])  # (ep=256,fsdp=256)
    out = [
        f"{bench.name} {tier.name}: {params}, {per}"
        f"GBS {tier.global_batch_size}, {gpus} GPU{'' if gpus == 1 else 's'} x {gpu_mem_gib:g} GiB, {fp8.label() if fp8 else 'bf16' if bf16 else 'fp32'} compute, "
        "fp32 master weights",
    ]
    if fp8:
        gather = "float8 (1 B/param)" if fp8.gather_bytes == 1 else "bf16 (rowwise and MX recipes)"
        out.append(
            f"fp8: {_count(fp8.linear_params)} parameters in float8 linears: no autocast bf16 copy of them; "
            f"FSDP2 gathers them in {gather}; activations as bf16 (torchao saves the bf16 inputs)"
        )
        if hasattr(tier.model, "n_experts"):
            out.append(
                "fp8 MoE experts: counted as bf16; they need CUDA sm90+ (torch._scaled_grouped_mm), elsewhere "
                "ttt run refuses --precision fp8 for this model"
            )
    trainable, frozen = bench.task.param_counts(bench.family, tier)
    if frozen:  # say what the states column charges, since most of the model carries no optimizer state
        frozen_bytes = bench.task.frozen_bytes(tier, bf16)
        out.append(
            f"states: {trainable / 1e6:,.2f} M trainable x 16 B (fp32 weight, gradient, 2 Adam moments) + "
            f"{frozen / 1e9:.2f} B frozen x {frozen_bytes} B ({'bf16' if frozen_bytes == 2 else 'fp32'} weight "
            "only: no gradient, no optimizer state)"
        )
    out.append(
        f"{'parallel':<{w}}{'AC':<5}{'micro':>6}{'GBS':>7}{'states':>10}{'fp8+bf16 cp' if fp8 else 'bf16 copies':>13}{'activations':>13}"
        f"{'margin':>9}{'total':>9}" + (f"{'simulated':>11}" if simulated is not None else "") + "  fits"
    )
    for r in rows:
        fits = _fits(r, gpu_mem_gib)
        sim = ""
        if simulated is not None:
            got = simulated.get((r.parallel, r.ac, r.micro_batch))
            sim = f"{got / GiB:>10.1f}G" if got is not None else f"{'-':>11}"
        out.append(
            f"{r.parallel:<{w}}{ac_cell(r.ac):<5}{r.micro_batch:>6}{r.gbs:>7}{r.states / GiB:>9.1f}G"
            f"{r.compute_copies / GiB:>12.1f}G{r.activations / GiB:>12.1f}G{r.margin / GiB:>8.1f}G"
            f"{r.total / GiB:>8.1f}G{sim}  {fits}"
        )
    if best is None:
        out.append(
            f"suggestion: nothing fits on {gpus} GPU{'' if gpus == 1 else 's'}; {_fits_from_text(larger, why)}"
        )
    else:
        how = launch(bench, tier, best, gpus, gpus_per_node, bf16, fp8)
        out.append(
            f"suggestion: {best.parallel}, activation checkpointing {parallel.ac_words(best.ac)}, micro-batch "
            f"{best.micro_batch}{_schedule_words(best, tier, gpus)} (~{best.total / GiB:.0f} GiB per GPU):"
        )
        out.extend(f"  {line}" for line in format_launch(how))
    out.append("fits: within 90% of the device (only those are suggested); tight: within 100%.")
    out.append(
        "estimate: parameter/optimizer bytes plus a count of the tensors autograd keeps per block (see"
    )
    out.append("timetotrain/train/memory.py); allocator fragmentation and NCCL buffers can add 5-10%.")
    if any(r.overlap for r in rows):
        out.append(
            "total: the larger of the backward's start (every activation; no gradient yet when the step is one "
            "micro-batch) and its end (every gradient beside the first block's backward), not always the columns' sum."
        )
    hook = bench.family.activation_bytes
    if hook is not None:
        out.append(
            f"activations: the {bench.family.name} family's count of the tensors autograd keeps "
            f"({hook.__module__.replace('.', '/')}.py), checked against the bytes saved on CPU. "
            "Method only: not validated on GPUs."
        )
    note = bench.task.plan_note(tier)
    if note:
        out.append(note)
    out.extend(_row_notes(bench, tier, rows))
    return "\n".join(out)


def _row_notes(bench, tier, rows) -> list[str]:
    """What the plan table's rows of another GBS or of each parallelism kind mean, one note per kind shown."""
    out = []
    other = sorted({r.gbs for r in rows} - {tier.global_batch_size})
    if other:
        out.append(
            f"GBS {', '.join(map(str, other))} rows: a legal GBS of the RCP table "
            f"({', '.join(map(str, sorted(bench.rcp_hparams)))}) where a layout without tensor or context "
            f"parallelism fits, offered beside the suggestion at the tier's GBS; run one with --set global_batch_size=N "
            "(its RCP's LR and warmup follow)."
        )
    if any(tp_degree(r) > 1 and degree(r, "pp") == 1 for r in rows):
        out.append(
            "tp x fsdp rows (tried because no dp or fsdp layout alone fits or splits the batch): block weights split over tp x "
            "fsdp ranks, embedding/head over fsdp; block activations 1/tp (sequence parallel); tp up to 8 "
            "(one node). Method only: not validated on GPUs."
        )
    if any(degree(r, "cp") > 1 for r in rows) and not any(degree(r, "cp") > 1 for r in rows[:1]):
        out.append(
            "cp rows (tried because no layout above fits or splits the batch): each sample's sequence split "
            "over cp ranks (activations of 1/cp of its tokens, plus every attention layer's K and V gathered "
            "whole); FSDP2 shards over the fsdp x cp ranks. Method only: not validated on GPUs."
        )
    if any(degree(r, "pp") > 1 for r in rows):
        out.append(
            "pp rows (the search tries them only where no layout without pipeline parallelism fits or splits "
            "the batch): the layers cut into pp stages (train/pipeline.py), each sharded over its tp x fsdp "
            "GPUs; a stage holds its gradients whole in fp32 and its parameters gathered through the step "
            "(torch's schedule defers FSDP2's reduction to the last micro-batch; the sharded expert slices "
            "reduce per micro-batch, and under --set pp_reduce=stage every wrap does), and 1F1B up to pp "
            "micro-batches of its blocks' activations; suggested: the fewest stages that fit, at the "
            "smallest micro-batch (the most micro-batches: the least bubble). Method only: not validated on "
            "GPUs."
        )
    if any(",ep=" in r.parallel and tp_degree(r) > 1 for r in rows):
        out.append(
            "tp x ep rows: attention and the shared experts cut by tp; the router and routed experts not "
            "(every TP rank of a group routes its whole tokens: the routed experts' activations whole), nor "
            "MLA's latent down-projections; the experts 1/ep per GPU."
        )
    return out
