"""`--precision fp8`: float8 training of the block linears with torchao (an optional extra,
`pip install 'timetotrain[fp8]'`), applied from outside the model before tensor parallelism, activation
checkpointing, compile and FSDP2 see it (train/parallel.py), as torchtitan orders it.

What runs in float8. Every `nn.Linear` inside `model.layers` whose two dimensions divide by 16 (the float8
GEMM's alignment) becomes torchao's `Float8Linear`: its three GEMMs (output, input gradient, weight gradient)
take e4m3 operands (e5m2 for gradients in the rowwise recipes) with dynamic scales, and the weight stays in
its master dtype. Not converted, on purpose: the embedding, the head and its fused loss
(models/common/head_loss.py reads `head.weight`), norms, the MoE router (a bare fp32 Parameter, not a
linear: Megatron's `moe_router_dtype: fp32`), LoRA's adapters (`lora_A`/`lora_B`: rank-r matmuls that
float8 would not speed up; PEFT users with torchao convert the frozen base linears and leave the adapters
in bf16, the filter this module applies), and everything outside the blocks (flux1's embedders and final
layer). Everything float8 does not cover computes in `Plan.high`: bf16 on CUDA (autocast or FSDP2's
`param_dtype`, as `--precision bf16`), fp32 on a CPU (no fast bf16 there).

Recipes (`--set fp8_recipe=`): `tensorwise` (one scale per tensor; under FSDP2 the weights are all-gathered
in float8, torchao's `enable_fsdp_float8_all_gather`, with their scales precomputed once per step),
`rowwise` (one scale per row, e4m3 forward and e5m2 backward), `rowwise_with_gw_hp` (rowwise, the weight
gradient GEMM left in high precision). MXFP8 (`mxfp8`, `mxfp8_with_gw_hp`: e4m3 elements with one power-of-two
e8m0 scale per 32 consecutive elements, RCEIL rounding of the scales): torchao 0.18's MX training tensor
(`torchao.prototype.moe_training`, `MXFP8TrainingOpConfig`) on the block linears and on the MoE experts'
stacked weights (its grouped MXFP8 GEMM), with its real kernels on CUDA compute capability 10.0+ (Blackwell)
and its emulation (operands rounded to MXFP8 as the kernels round them, the product then in bf16/fp32) on a
CPU; other GPUs are refused. Two limits of torchao 0.18 shape what converts: its linear override drops the
bias (`F.linear(x, w, b)` returns `x @ w.T`), so only bias-free linears become MXFP8; and its emulated
grouped GEMM writes bf16, so on a CPU the experts' outputs are bf16 in an otherwise fp32 model.

MoE experts (`models/common/moe/experts.py`, stacked weights through `torch._grouped_mm`) need a grouped
float8 GEMM (`torch._scaled_grouped_mm`): where it runs, torchao's grouped-GEMM training tensor (rowwise)
wraps the expert weights; where it does not (CPUs, pre-Hopper GPUs), `--precision fp8` on a MoE model is
refused with one line rather than silently training the experts in high precision.

A device without float8 GEMMs (CUDA below compute capability 8.9, i.e. before Ada/Hopper) is refused before
anything is logged. On a CPU the rowwise float8 GEMMs are PyTorch's own `torch._scaled_mm` (a reference
kernel: for numerics and tests, not for speed) and tensorwise is emulated (`linear_config`).

torchao is imported inside the functions that use it (optional, and 0.3 s to import): every run imports this
module (train/parallel.py), and only `--precision fp8` needs torchao.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from timetotrain.errors import UserError
from timetotrain.models.common.moe.experts import GroupedExperts

# `torch._scaled_mm` wants both GEMM dimensions of every operand divisible by 16; MX scales cover 32 elements.
ALIGN = 16
MX_ALIGN = 32
MX_RECIPES = ("mxfp8", "mxfp8_with_gw_hp")
_ADAPTERS = ("lora_A", "lora_B")
_NO_GROUPED = (
    "--precision fp8: the MoE experts need a grouped float8 GEMM (torch._scaled_grouped_mm), which this "
    "device lacks (CUDA sm90+ has it); use --precision bf16 here"
)


def is_mx(recipe: str) -> bool:
    return recipe in MX_RECIPES


def check_device(device: torch.device, recipe: str = "tensorwise") -> None:
    """One line where this device cannot train in float8 (with `recipe`), or torchao is missing."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UserError(
            "--precision fp8 needs torchao: pip install 'timetotrain[fp8]' (or pip install torchao)"
        ) from None
    if is_mx(recipe):
        _check_mx(device, recipe)
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise UserError(
                f"--precision fp8: {name} (compute capability {major}.{minor}) has no float8 GEMMs "
                "(they need 8.9+: Ada, Hopper, Blackwell); use --precision bf16"
            )
    elif not scaled_mm_works(device):
        raise UserError(f"--precision fp8: torch._scaled_mm does not run on {device.type}; use fp32 or bf16")


def _check_mx(device: torch.device, recipe: str) -> None:
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig  # noqa: F401
    except ImportError:
        raise UserError(
            f"--set fp8_recipe={recipe} needs torchao's MX training (torchao.prototype.moe_training, torchao "
            ">= 0.18): pip install -U 'timetotrain[fp8]'"
        ) from None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (10, 0):
            name = torch.cuda.get_device_name(device)
            raise UserError(
                f"--set fp8_recipe={recipe}: {name} (compute capability {major}.{minor}) has no MXFP8 GEMMs "
                "(torchao's MX kernels need 10.0+: Blackwell); use fp8_recipe=tensorwise or rowwise"
            )
    elif device.type != "cpu":
        raise UserError(
            f"--set fp8_recipe={recipe} runs on CUDA 10.0+ (torchao's kernels) or emulated on a CPU, not on "
            f"{device.type}; use fp8_recipe=tensorwise"
        )


def check_mx_parallel(recipe: str, spec: str | None) -> None:
    """The MX recipes run in one process: torchao's MX tensor under DDP, FSDP2, TP or EP is not tested here."""
    if is_mx(recipe):
        raise UserError(
            f"--set fp8_recipe={recipe} with --parallel {spec}: MXFP8 runs in one process here (torchao's MX "
            "training tensor is not yet tested under DDP, FSDP2, TP or EP); drop --parallel or use "
            "fp8_recipe=tensorwise or rowwise"
        )


@functools.cache
def scaled_mm_works(device: torch.device) -> bool:
    """Whether a tensorwise float8 GEMM runs here (probed once: support is by build and device)."""
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False


@functools.cache
def grouped_float8_works(device: torch.device) -> bool:
    """Whether the grouped float8 GEMM the MoE experts need runs here (CPUs have the op name, no kernel)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False
    try:
        a = torch.ones(32, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(2, 32, 32, device=device).to(torch.float8_e4m3fn).transpose(-2, -1)
        offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
        sa = torch.ones(32, device=device)
        sb = torch.ones(2, 32, device=device)
        torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError):
        return False


def check_model(model_cfg, device: torch.device, recipe: str = "tensorwise") -> None:
    """Preflight (before any log line): a MoE model's experts need a grouped float8 GEMM on `device` (the
    MX recipes bring their own, emulated on a CPU). Read from the config (`n_experts`, as the MoE families
    name it): building even on the meta device imports seconds' worth of modules. `convert` checks the
    built model again."""
    if getattr(model_cfg, "n_experts", 0) and not is_mx(recipe) and not grouped_float8_works(device):
        raise UserError(_NO_GROUPED)


def _refuse(model: nn.Module, device: torch.device, recipe: str) -> None:
    experts = _expert_modules(model)
    if experts and not is_mx(recipe) and not grouped_float8_works(device):
        raise UserError(_NO_GROUPED)
    keep = converter(recipe)
    if not experts and not any(keep(m, n) for n, m in model.named_modules()):
        raise UserError("--precision fp8: this model has no block linears to train in float8; use bf16")


def linear_config(recipe: str, fsdp: bool, device: torch.device):
    """torchao's configuration for `recipe`; float8 all-gathers under FSDP2 where the recipe allows them
    (tensorwise: one scale per weight, which a shard can compute from a global amax).

    On a CPU the tensorwise GEMM is emulated (operands rounded to float8 and scaled exactly as the real
    kernel's, the product then taken in fp32): CPU `torch._scaled_mm` with scalar scales runs a per-element
    path, 20 s for one 4096x128x384 GEMM here (measured, torch 2.13), against 0.12 s with rowwise scales,
    which therefore run the real kernel."""
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
        return dataclasses.replace(config, emulate=True) if device.type == "cpu" else config
    return Float8LinearConfig.from_recipe_name(recipe)


def converts(module: nn.Module, fqn: str) -> bool:
    """Whether the float8 recipes convert this linear (module docstring)."""
    if not isinstance(module, nn.Linear):
        return False
    if not fqn.startswith("layers.") or fqn.rsplit(".", 1)[-1] in _ADAPTERS:
        return False
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


def mx_converts(module: nn.Module, fqn: str) -> bool:
    """Whether the MX recipes convert this linear: a float8 one without a bias (torchao 0.18's MX linear
    drops it) whose dimensions hold whole 32-element scale blocks."""
    return (
        converts(module, fqn)
        and module.bias is None
        and module.in_features % MX_ALIGN == 0
        and module.out_features % MX_ALIGN == 0
    )


def converter(recipe: str):
    """The linear filter of `recipe` (`ttt plan` counts with it too)."""
    return mx_converts if is_mx(recipe) else converts


def _expert_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def convert(model: nn.Module, recipe: str, fsdp: bool, device: torch.device) -> int:
    """Swap the block linears of `model` for float8 ones (module docstring), in place, on any device
    including meta. Returns how many were converted; a model with none is refused (nothing would change)."""
    _refuse(model, device, recipe)
    experts = _expert_modules(model)
    if is_mx(recipe):
        return _convert_mx(model, experts, recipe, device)
    from torchao.float8 import convert_to_float8_training

    names = [n for n, m in model.named_modules() if converts(m, n)]
    convert_to_float8_training(model, module_filter_fn=converts, config=linear_config(recipe, fsdp, device))
    if experts:
        _convert_experts(experts)
    return len(names)


def mx_config(recipe: str, device: torch.device):
    """torchao's MX training configuration: its kernels on CUDA (10.0+, `check_device`), emulated on a CPU."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization.quantize_.common import KernelPreference

    kernels = KernelPreference.EMULATED if device.type == "cpu" else KernelPreference.AUTO
    return MXFP8TrainingOpConfig(kernel_preference=kernels, wgrad_with_hp=recipe == "mxfp8_with_gw_hp")


def _convert_mx(model: nn.Module, experts: list[nn.Module], recipe: str, device: torch.device) -> int:
    """The MX training tensor on the bias-free block linears' weights and the experts' stacks: it
    intercepts `linear` and `torch._grouped_mm` (which the experts are then told to take)."""
    from torchao.quantization import quantize_

    names = [n for n, m in model.named_modules() if mx_converts(m, n)]
    ids = {id(m) for m in experts}
    quantize_(model, mx_config(recipe, device), filter_fn=lambda m, fqn: mx_converts(m, fqn) or id(m) in ids)
    for module in experts:
        module.use_grouped_mm = True
    return len(names)


def _convert_experts(experts: list[nn.Module]) -> None:
    """torchao's grouped-GEMM training tensor (rowwise e4m3, bf16 out) on the stacked expert weights: it
    intercepts `torch._grouped_mm`, which the experts are then told to take (not the per-expert loop)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    for module in experts:
        quantize_(module, Float8TrainingOpConfig(), filter_fn=lambda m, _, target=module: m is target)
        module.use_grouped_mm = True


def tensor_parallel_styles(device: torch.device) -> dict:
    """torchao's TP styles for tensorwise float8 linears on GPUs: a sharded input is cast with the scale of
    its global amax (a single process's), and the gathers move float8. Elsewhere torch's styles: CPUs have
    no `cat` for float8 tensors, which the float8 gathers' backward needs; and rowwise recipes (torchtitan
    does the same). A row-parallel layer then scales its input shard by that shard's own amax, which
    differs from one process's scales in the last bits (tests/test_float8_parallel.py states by how much)."""
    if device.type == "cpu":
        return {}
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return {"colwise": Float8ColwiseParallel, "rowwise": Float8RowwiseParallel}


def uses_float8_all_gather(model: nn.Module) -> bool:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p

    return any(isinstance(local(p), WeightWithDynamicFloat8CastTensor) for p in model.parameters())


def after_optimizer_step(model: nn.Module):
    """What a step does after `opt.step()` under FSDP2 float8 all-gathers: the scales of every weight in one
    all-reduce of amaxes, instead of one per weight inside each all-gather. None when not needed."""
    if not uses_float8_all_gather(model):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return functools.partial(precompute_float8_dynamic_scale_for_fsdp, model)


def converted(model: nn.Module) -> list[str]:
    """Names of the float8 (or MXFP8) linears of `model` (tests, reports)."""
    from torchao.float8.float8_linear import Float8Linear

    def mx(m):
        return isinstance(m, nn.Linear) and type(m.weight.data).__name__ == "MXFP8TrainingWeightWrapperTensor"

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear) or mx(m)]
