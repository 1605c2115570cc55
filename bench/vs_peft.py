"""Our LoRA fine-tuning step vs Hugging Face transformers `LlamaForCausalLM` + PEFT LoRA, side by side.

    python bench/vs_peft.py [--reps 5] [--steps 3] [--configs tiny,20m] [--peft-qkv fused|separate]

The workload is one `llama2_70b_lora` training step: a frozen Llama 2 style base, rank-16 adapters (alpha
32, dropout 0.1 on the adapter input) on the attention input and output projections of every layer, a
batch of packed blocks (`input_ids` + `labels`, -100 where no loss is taken), the mean next-token
cross-entropy over the labelled positions, AdamW over the adapters only (betas 0.9/0.999, eps 1e-8, weight
decay 1e-4, lr 4e-4) with gradient clipping at 0.3. Everything that sets these numbers is read from
`suite/llama2_70b_lora.py` (REFERENCE's LoRAData and lr, ADAMW), not restated here.

Both sides start from the same base weights, the same adapters (our A, drawn by `apply_lora`, copied into
PEFT's; B zero on both) and see the same batch. Ours runs `train_step` exactly as `ttt run` calls it, with the
task's own loss (`tasks/lora_sft.lm_block_loss`: the model applies the LM head and the loss together in
chunks, never holding the logits) and `build_optimizer` (fused AdamW). PEFT runs as its users run it under
the HF Trainer: `get_peft_model(model, LoraConfig(...))`, logits out of the model, upcast to fp32,
`F.cross_entropy` with ignore_index -100 (what HF's causal-LM loss does), `clip_grad_norm_`, and
`torch.optim.AdamW(fused=True)` (the Trainer's default optimizer, `adamw_torch_fused`, since torch 2.8).
Dropout is 0.1 on both; the two draw their masks in a different order from the global RNG, so the masks
differ, which costs the same either way.

PEFT's model, `--peft-qkv`:

- `fused` (default): what the reference trains and what `tests/test_lora.py` checks parity against. MLCommons'
  base (`Llama2-70b-fused-qkv-mlperf`) has one `qkv_proj` (rows q|k|v) and the reference targets `qkv_proj`
  and `o_proj`. Stock transformers has no such module, so each HF attention here is HF's own
  `LlamaAttention` with q/k/v_proj replaced by one `qkv_proj` whose output is split, then RoPE and HF's
  attention dispatch (SDPA) unchanged. Same adapters, same adapter parameter count as ours.
- `separate`: stock HF Llama (q/k/v_proj), PEFT on q_proj, k_proj, v_proj, o_proj: what a user without
  the MLCommons modeling code would do. Ours then targets the q, k and v parts of its fused qkv (LoRA targets
  "attn.q", "attn.k", "attn.v", "attn.proj"): the same adapters, each with its own A, so like with like again
  (`tests/test_lora.py::test_peft_parity[separate_qkv]`). Three adapters where the reference has one: 2 x rank
  x dim more adapter parameters per layer than `fused`.

Tokens are counted per block (`block` tokens a sample, the task's `sample_items`); the model sees
`block - 1` positions of each (next-token shift). MFU uses the task's FLOPs per sample
(`LoRAFineTune.flops_per_sample` on REFERENCE with this config's model, block and the layout's adapters: 4
FLOPs per frozen weight per token, 6 per adapter parameter, plus causal attention), for ours and PEFT alike.
On CPU the peak is an fp32 matmul peak measured in the same run (`train/peak.py`); on CUDA the datasheet bf16
peak.

The step loops alternate within each repetition (ours eager, ours compiled, PEFT) so drift in machine load
hits all of them; medians and their ratios are printed. Ours compiled is `--compile` of `ttt run`: each block
`torch.compile`d; PEFT runs eager, as the HF Trainer does by default.

Allocator fairness: both run in one process with glibc's default malloc, which hands every block above its
mmap threshold (at most 32 MB) back to the OS on free, so a step that allocates large fresh arrays (HF's
`[tokens, vocab]` logits, their fp32 copy and gradient) page-faults them in again every step. `ttt run` and
`ttt synth` raise those thresholds themselves on CPUs (`train/device.keep_freed_memory`); this script does
not, so that the default figure is what a plain PEFT user gets. For the figure with that cost removed from
both, run with
    MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_MMAP_THRESHOLD_=4294967296 python bench/vs_peft.py ...
On CUDA the caching allocator has no such cost.

On a CPU shared with other work, two intra-op threads that wait on each other lose whole time slices: on the
2-core development machine under a load of 5 the same step varied 5x between runs. `OMP_NUM_THREADS=1` slows
every loop by about the same share there, so its ratios are the steadier figure (its MFU is against the
1-thread peak measured in the same run).

GPU: `--device cuda --bf16 --configs 70b-2l` (bf16 autocast for both, fp32 base, adapters and AdamW; `ttt
run --precision bf16` stores the frozen base in bf16 instead, `LoRAData.bf16_base`, which this comparison
keeps out so that both sides hold the same fp32 base). The 70B width with 2 layers holds ~2.2 B fp32
parameters per model copy, three copies (ours, ours compiled, PEFT): ~27 GB before activations.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import warnings

import torch
import torch.nn.functional as F
from side_by_side import add_common_args, figures, peak_for, timed
from torch import nn

from timetotrain.models.common.lora import apply_lora, lora_param_count, lora_parameters
from timetotrain.models.llama import FAMILY, LLAMA2_70B, Llama, LlamaConfig
from timetotrain.models.llama.hf import hf_config_kwargs, qkv_to_hf, to_hf_state_dict
from timetotrain.suite.llama2_70b_lora import ADAMW, BENCHMARK, REFERENCE
from timetotrain.tasks.lora_sft import lm_block_loss
from timetotrain.train.optim import build_optimizer
from timetotrain.train.step import train_step


def _llama2(**shape) -> LlamaConfig:
    """A Llama 2 shaped config (plain RoPE at theta 10,000, norm eps 1e-5, as the benchmark's base)."""
    return dataclasses.replace(LLAMA2_70B, **shape)


# name -> (model config, blocks per step, tokens per block). Edit here to follow the tiers.
CONFIGS: dict[str, tuple[LlamaConfig, int, int]] = {
    # The shape the llama2_70b_lora tiny tier is to use: 2 blocks of 1,024 tokens a step.
    "tiny": (
        _llama2(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=4096, max_seq_len=1024),
        2,
        1024,
    ),
    # ~19 M parameters in the blocks (d 512, 8 layers, 8 query / 4 KV heads, FFN 1024) with the Llama 2
    # vocabulary of 32,000, so the LM head and the loss are over the real vocabulary; 1 block of 1,024.
    "20m": (
        _llama2(
            dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=32_000, max_seq_len=1024
        ),
        1,
        1024,
    ),
    # GPU only (--device cuda --bf16): the Llama 2 70B width and vocabulary with 2 of its 80 layers, 1 x 4,096.
    "70b-2l": (_llama2(n_layers=2, max_seq_len=4096), 1, 4096),
}

# The prompt share of a block whose labels are -100 (the way validation blocks mask the prompt; training
# blocks label every token): exercises the ignore path of both losses at no cost to either.
MASKED_PREFIX = 1 / 8

# Ours in the `separate` layout: an adapter on each of the q, k, v parts of the fused qkv, as PEFT on q/k/v.
SEPARATE_TARGETS = ("attn.q", "attn.k", "attn.v", "attn.proj")


def flops_per_token(cfg: LlamaConfig, block: int, targets: tuple[str, ...]) -> float:
    """The task's model FLOPs per sample (frozen-base convention) for this model, block and LoRA targets, per
    block token."""
    data = dataclasses.replace(REFERENCE.data, block=block, targets=targets)
    tier = dataclasses.replace(REFERENCE, model=cfg, data=data)
    return BENCHMARK.flops_per_sample(tier) / block


def make_batch(cfg: LlamaConfig, batch: int, block: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, block), generator=g)
    labels = ids.clone()
    labels[:, : int(block * MASKED_PREFIX)] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def _fused_attention_class():
    """HF's `LlamaAttention` with q/k/v_proj replaced by one `qkv_proj` (rows q|k|v, the MLCommons layout);
    after the split it is HF's code path: RoPE, then the configured attention implementation."""
    from transformers.models.llama import modeling_llama as ml

    class FusedQKVLlamaAttention(ml.LlamaAttention):
        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            del self.q_proj, self.k_proj, self.v_proj
            q, kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
            self.split_sizes = [q, kv, kv]
            self.qkv_proj = nn.Linear(config.hidden_size, q + 2 * kv, bias=config.attention_bias)

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            input_shape = hidden_states.shape[:-1]
            heads = (*input_shape, -1, self.head_dim)
            q, k, v = self.qkv_proj(hidden_states).split(self.split_sizes, dim=-1)
            q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
            q, k = ml.apply_rotary_pos_emb(q, k, *position_embeddings)
            attend = ml.ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, ml.eager_attention_forward
            )
            # Training: no KV cache to update; what is left (position ids, ...) goes on as in HF's own forward.
            kwargs = {n: a for n, a in kwargs.items() if n not in ("cache", "past_key_values", "use_cache")}
            out, weights = attend(
                self,
                q,
                k,
                v,
                attention_mask,
                dropout=self.attention_dropout if self.training else 0.0,
                scaling=self.scaling,
                **kwargs,
            )
            return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return FusedQKVLlamaAttention


def build_peft(ours_base: dict[str, torch.Tensor], cfg: LlamaConfig, device, fused: bool, dropout: float):
    """PEFT's model: an HF Llama holding `ours_base` (our base state dict, before LoRA), LoRA per the
    task's rank/alpha on the reference's targets (`fused`) or on q/k/v/o_proj (stock HF)."""
    import peft
    import transformers

    hf_cfg = transformers.LlamaConfig(**hf_config_kwargs(cfg), attn_implementation="sdpa")
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(hf_cfg)
        if fused:
            attention = _fused_attention_class()
            for i, layer in enumerate(hf.model.layers):
                layer.self_attn = attention(hf_cfg, i)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours_base, cfg, fused_qkv=fused), strict=False)
    if missing or unexpected:  # a rename in transformers would otherwise leave random weights in place
        raise RuntimeError(f"HF state dict mismatch: missing {missing}, unexpected {unexpected}")
    d = REFERENCE.data
    targets = ["qkv_proj", "o_proj"] if fused else ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = peft.LoraConfig(
        r=d.rank, lora_alpha=d.alpha, lora_dropout=dropout, target_modules=targets, bias="none"
    )
    return peft.get_peft_model(hf, config).train()


@torch.no_grad()
def copy_adapters(ours: nn.Module, theirs: nn.Module, cfg: LlamaConfig, fused: bool) -> None:
    """Our adapters into PEFT's. A multiplies the input, so it copies as is; B has one row per output, so the
    fused qkv's B goes from our grouped-per-KV-head rows to HF's q|k|v (the parts' B are in HF's order)."""

    def put(module, a, b):
        module.lora_A["default"].weight.copy_(a)
        module.lora_B["default"].weight.copy_(b)

    for block, layer in zip(ours.layers, theirs.get_base_model().model.layers, strict=True):
        attn, qkv, proj = layer.self_attn, block.attn.qkv, block.attn.proj
        put(attn.o_proj, proj.lora_A.weight, proj.lora_B.weight)
        if fused:
            put(attn.qkv_proj, qkv.lora_A.weight, qkv_to_hf(qkv.lora_B.weight, cfg))
        else:
            for part in "qkv":
                put(getattr(attn, f"{part}_proj"), qkv.lora_A[part].weight, qkv.lora_B[part].weight)


def build_ours(
    base: dict[str, torch.Tensor], cfg: LlamaConfig, device, dropout: float, seed: int, targets
) -> Llama:
    """Our Llama with `base` loaded and the task's LoRA applied on `targets`, adapters drawn from `seed` (as
    `build_training` does: load the base, then `adapt_model` with a seeded generator)."""
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device=device)
    model.reset_rope()  # non-persistent buffers: not in the state dict
    model.load_state_dict(base)
    d = REFERENCE.data
    g = torch.Generator(device=device).manual_seed(seed)
    return apply_lora(model, targets, d.rank, d.alpha, dropout, generator=g).train()


def make_step_ours(model: nn.Module, autocast=None):
    """`train_step` exactly as `ttt run` calls it for this benchmark (one micro-batch)."""
    opt = build_optimizer(model, ADAMW, REFERENCE.lr)
    params = lora_parameters(model)

    def loss(m, batch):
        return lm_block_loss(m, batch["input_ids"], batch["labels"])

    return lambda batch: train_step(model, opt, batch, 1, loss, ADAMW.clip, params, autocast)


def make_step_peft(model: nn.Module, autocast=None):
    """An HF Trainer step of a PEFT model, written out: forward under autocast, logits upcast to fp32 and
    `F.cross_entropy` over the shifted labels (HF's causal-LM loss), clip, fused AdamW, zero the grads."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = params[0].device.type in ("cuda", "cpu")
    opt = torch.optim.AdamW(
        params,
        lr=REFERENCE.lr,
        betas=ADAMW.betas,
        eps=ADAMW.eps,
        weight_decay=ADAMW.weight_decay,
        fused=fused,
    )

    def step(batch):
        ids, labels = batch["input_ids"], batch["labels"]
        # The same block - 1 positions as ours: HF would also run the last position, whose logits it discards.
        with torch.autocast(ids.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, ADAMW.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build(name: str, device, autocast=None, compile=True, fused=True, dropout=None, seed: int = 0) -> dict:
    """The config's batch, both models and the steps: "ours", "compiled" (None without `compile`) and
    "peft", each step(batch) -> that step's loss."""
    cfg, batch, block = CONFIGS[name]
    dropout = REFERENCE.data.dropout if dropout is None else dropout
    device = torch.device(device)
    targets = REFERENCE.data.targets if fused else SEPARATE_TARGETS
    torch.manual_seed(seed)
    with torch.device(device):
        base = Llama(cfg).state_dict()  # Megatron init from the global RNG, on the device (fast at 70B width)
    ours = build_ours(base, cfg, device, dropout, seed + 1, targets)
    compiled = None
    if compile:
        compiled = build_ours(base, cfg, device, dropout, seed + 1, targets)
        for blk in compiled.layers:  # what `ttt run --compile` does
            blk.compile()
    theirs = build_peft(base, cfg, device, fused, dropout)
    copy_adapters(ours, theirs, cfg, fused)
    del base
    return {
        "cfg": cfg,
        "batch": make_batch(cfg, batch, block, device, seed),
        "blocks": batch,
        "block": block,
        "targets": targets,
        "adapters_ours": lora_param_count(cfg, REFERENCE.data.rank, targets),
        "adapters_peft": sum(p.numel() for p in theirs.parameters() if p.requires_grad),
        "params": FAMILY.param_count(cfg),
        "ours_model": ours,
        "peft_model": theirs,
        "ours": make_step_ours(ours, autocast),
        "compiled": make_step_ours(compiled, autocast) if compiled is not None else None,
        "peft": make_step_peft(theirs, autocast),
    }


def bench(name, reps, steps, peak, device, autocast=None, compile=True, fused=True) -> dict:
    b = build(name, device, autocast, compile, fused)
    batch, comp = b["batch"], b["compiled"] or b["ours"]
    for s in (b["ours"], comp, comp, b["peft"]):  # warm-up: allocator, threads, kernels, compilation
        s(batch)
    tok = b["blocks"] * b["block"] * steps
    ours_tps, comp_tps, peft_tps = [], [], []
    for _ in range(reps):
        ours_tps.append(tok / timed(b["ours"], batch, steps, device))
        if b["compiled"] is not None:
            comp_tps.append(tok / timed(comp, batch, steps, device))
        peft_tps.append(tok / timed(b["peft"], batch, steps, device))
    mo, mp = statistics.median(ours_tps), statistics.median(peft_tps)
    mc = statistics.median(comp_tps) if comp_tps else float("nan")
    flops = flops_per_token(b["cfg"], b["block"], b["targets"])
    return {
        "config": name,
        "params": b["params"],
        "adapters_ours": b["adapters_ours"],
        "adapters_peft": b["adapters_peft"],
        "batch": b["blocks"],
        "block": b["block"],
        **figures(mo, mc, mp, "peft", flops, peak),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "70b-2l")
    ap.add_argument("--configs", default="tiny,20m", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument(
        "--peft-qkv",
        choices=("fused", "separate"),
        default="fused",
        help="fused: one qkv_proj, the reference's layout and targets; separate: stock HF q/k/v_proj",
    )
    args = ap.parse_args()
    # transformers deprecates a name PEFT still reads; noise on every build, nothing to act on here.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
    import peft
    import transformers

    device = torch.device(args.device)
    peak, source = peak_for(device)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
        f"{torch.get_num_threads()} threads, {device}{', bf16 autocast' if args.bf16 else ', fp32'}, "
        f"peak {peak / 1e12:.3f} TFLOP/s ({source}); PEFT on "
        + (
            "a fused qkv_proj + o_proj (the reference's targets)"
            if args.peft_qkv == "fused"
            else "stock q_proj, k_proj, v_proj, o_proj"
        )
    )
    print(
        f"{'config':<8}{'params':>14}{'adapters ours/PEFT':>22}{'batch x block':>15}{'ours tok/s':>12}"
        f"{'compiled':>10}{'PEFT tok/s':>12}{'ratio':>7}{'compiled':>9}{'our MFU':>9}{'compiled':>9}"
        f"{'PEFT MFU':>9}"
    )
    for name in args.configs.split(","):
        r = bench(
            name,
            args.reps,
            args.steps,
            peak,
            device,
            torch.bfloat16 if args.bf16 else None,
            not args.no_compile,
            args.peft_qkv == "fused",
        )
        adapters = f"{r['adapters_ours']:,}/{r['adapters_peft']:,}"
        skipped = args.no_compile  # "-" in the compiled columns rather than nan
        comp_tps = "-" if skipped else f"{r['compiled_tokens_per_s']:,.0f}"
        comp_ratio = "-" if skipped else f"{r['compiled_ratio']:.2f}x"
        comp_mfu = "-" if skipped else f"{r['compiled_mfu']:.1%}"
        print(
            f"{r['config']:<8}{r['params']:>14,}{adapters:>22}{r['batch']:>7} x {r['block']:<5}"
            f"{r['ours_tokens_per_s']:>12,.0f}{comp_tps:>10}{r['peft_tokens_per_s']:>12,.0f}"
            f"{r['ratio']:>6.2f}x{comp_ratio:>9}{r['ours_mfu']:>9.1%}{comp_mfu:>9}{r['peft_mfu']:>9.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
