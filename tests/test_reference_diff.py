"""The reference tiers against their MLCommons references, row by row.

Each row is one fact of a benchmark's reference implementation (a closed hyperparameter as its log records
it, the first evaluation step, the eval cadence and size, the step cap), as a function of the GBS, with the
file and line of the reference it was read from. The test logs each reference tier's init block through the
harness's own path (`prepare.preflight` + `prepare.log_init_keys` into a real result file; no model is
built) at every RCP batch size and at one batch size without an RCP (gpt_oss_20b at three: 128, and 48 and
40, which do not divide its eval size or interval), and compares. A second test checks that the reference
tier logs every key its reference logs (`REFERENCE_KEYS`).

Read from mlcommons/training at aa344c7f (2026-07; llm_moe_pretraining after 5bf5f996 "Deepseek: skip
first N evals"), Megatron-Bridge v0.3.0 (its container), the mlperf-logging 4.1.68 rule and RCP files.
flux1's rows come from the torchtitan fork the reference's submodule points at (pytorch/torchtitan 9603aa83)
and its RCP file; gpt_oss_20b's logged keys from the primus_mllog 0.1.20 wheel in the Primus folder.
rgat's come from the retired GNN reference (retired_benchmarks/rgat at aa344c7f) and the 5.1.0 rule and
RCP files, the ruleset it was retired with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from timetotrain.mlperf.logger import ResultLog
from timetotrain.spec.benchmark import apply_overrides
from timetotrain.spec.registry import get
from timetotrain.train import prepare

pytestmark = pytest.mark.parity

DS = "llm_moe_pretraining/nemo/"
L405 = "large_language_model_pretraining/nemo/pretrain_llama31.py"
L8 = "small_llm_pretraining/nemo/pretrain_llama31.py"
OSS = "small_llm_moe_pretraining/primus/"
LORA = "llama2_70b_lora/"
RULES = "mlperf_logging/compliance_checker/training_6.0.0/"
RCPS = "mlperf_logging/rcp_checker/training_6.0.0/"


@dataclass(frozen=True)
class Row:
    what: str  # a logged key, or one of HARNESS
    expect: Callable[[int], Any]  # GBS -> the reference's value
    source: str  # file:line in the reference


HARNESS = (
    "first_eval_step",
    "first_logged_eval_step",
    "eval_every_steps",
    "eval_windows",
    "step_cap",
    "target",
    "eval_steps",  # every step after which the run evaluates, up to the step cap
    "eval_seeds_on_reference_gpus",  # rgat: validation seeds read on GBS / 1,024 ranks
    "epoch_num_decimals",
    "first_evals",  # the first three steps after which the run evaluates
)


def const(v):
    return lambda gbs: v


def ds_lr(gbs):  # rounded to the 9th decimal (README.md:8), as the configs write it
    return round(2.4e-5 * math.sqrt(gbs / 16384), 9)


def l405_lr(gbs):
    """The reference's round(GBS / 1152 * 8e-5, 8); where that float fails closed_llama31_405b.yaml's exact
    `lr * 1152 == GBS * 8e-5` (GBS 1536, a GBS the reference never ran), the quotient, which passes: the
    decision of suite/llama31_405b.closed_lr."""
    rounded = round(gbs / 1152 * 8e-5, 8)
    return rounded if rounded * 1152 == gbs * 8e-5 else 8e-5 * gbs / 1152


# GBS -> (base LR, warmup samples) of the RCP files: the reference's hyperparameters at those sizes.
L8_RCP = {16: (4e-4, 256), 32: (8e-4, 4096), 64: (8e-4, 6144), 96: (1e-3, 16384), 128: (2e-3, 32768)}
OSS_RCP = {16: (4e-4, 2048), 32: (8e-4, 4096), 64: (1e-3, 12288)}
LORA_LR = {8: 4e-4, 16: 4e-4, 32: 4e-4, 128: 1e-3}
FLUX_RCP = {512: (2e-4, 1600), 1024: (2.5e-4, 800), 2048: (2.5e-4, 0), 4096: (4e-4, 100), 256: (1e-4, 0)}
# Primus's logger (the wheel in small_llm_moe_pretraining/primus, 0.1.20).
PRIMUS_MLLOG = "primus_mllog/mlperf_logger.py"
LIGHTNING = "lightning pytorch/trainer/setup.py _determine_batch_limits"


def l8_first_evals(gbs):
    """The llama31_8b reference's first three evaluations. `val_check_interval = eval_every / GBS` (:180),
    eval_every = ceil(12288 / GBS) steps; Lightning keeps a value in [0, 1] as a fraction of the epoch, makes
    a larger whole number that many batches, refuses the rest; the MLPerfCallback's on_validation_start
    then sets val_check_batch = eval_every, so evaluations follow at its multiples. Where Lightning would
    not evaluate early (a fraction: 75% of a 1.2 M-step epoch at GBS 128; GBS 48, 96: a refused value)
    ttt evaluates on the cadence only, the decision of docs/benchmarks/llama31_8b.md."""
    every = math.ceil(12288 / gbs)
    interval = every / gbs
    early = [int(interval)] if interval > 1 and interval % 1.0 == 0 else []
    return (early + [every * k for k in (1, 2, 3)])[:3]


# The flux1 reference is the torchtitan fork text_to_image/torchtitan points at (9603aa83).
FLUX = "pytorch/torchtitan@9603aa83 torchtitan/experiments/flux/"

# rgat: the reference's loader holds 1,024 seeds per GPU (train_rgnn_multi_gpu.py:290), so GBS / 1,024 ranks.
RGAT = "retired_benchmarks/rgat/"
RGAT_MAIN = RGAT + "train_rgnn_multi_gpu.py"
RGAT_TRAIN = int(157_675_969 * 0.6)  # split_seeds.py:26,31
RGAT_VAL = int(157_675_969 * 0.005)  # split_seeds.py:32,53
RGAT_LR = {4096: 1e-3, 16384: 2e-3, 32768: 2e-3, 65536: 3e-3, 262144: 5e-3}
RULES51 = "mlperf_logging/compliance_checker/training_5.1.0/"
RCPS51 = "mlperf_logging/rcp_checker/training_5.1.0/"


def rgat_batch_num(gbs: int) -> int:
    """`batch_num` of a rank: ceil(len(train_idx.split(n // world)[rank]) / 1024) (:83, :147)."""
    return math.ceil(RGAT_TRAIN // (gbs // 1024) / 1024)


def rgat_eval_steps(gbs: int) -> list[int]:
    """The reference's loop, literally (:153-165, :199): `idx` restarts at 1 each of `--epochs` 2 epochs and
    an eval follows batch idx when idx % int(batch_num * 0.05) == 0; the global step is epoch * batch_num +
    idx."""
    batch_num = rgat_batch_num(gbs)
    freq = int(batch_num * 0.05)
    return [e * batch_num + i for e in range(2) for i in range(1, batch_num + 1) if i % freq == 0]


TABLE: dict[str, list[Row]] = {
    "rgat": [
        Row("global_batch_size", lambda g: g, RGAT_MAIN + ":326 (world x --train_batch_size)"),
        Row("gradient_accumulation_steps", const(1), RGAT_MAIN + ":327"),
        Row("opt_name", const("adam"), RGAT_MAIN + ":143,328; " + RULES51 + "closed_rgat.yaml:9"),
        Row("opt_base_learning_rate", lambda g: RGAT_LR[g], RCPS51 + "rcps_rgat.json; " + RGAT_MAIN + ":329"),
        Row("train_samples", const(RGAT_TRAIN), RGAT_MAIN + ":356; " + RGAT + "split_seeds.py:31"),
        Row("eval_samples", const(RGAT_VAL), RGAT_MAIN + ":357; " + RGAT + "split_seeds.py:32,53"),
        Row(
            "eval_seeds_on_reference_gpus", lambda g: RGAT_VAL // (g // 1024) * (g // 1024), RGAT_MAIN + ":96"
        ),
        Row("step_cap", lambda g: 2 * rgat_batch_num(g), RGAT_MAIN + ":153,294 (--epochs 2)"),
        Row("eval_steps", rgat_eval_steps, RGAT_MAIN + ":147-148,162-166,199 (--validation_frac 0.05 :307)"),
        Row("target", const(0.72), RGAT_MAIN + ":309; " + RULES51 + "closed_rgat.yaml:22"),
        Row("epoch_num_decimals", const(2), RGAT_MAIN + ":203 (round(epoch + idx / batch_num, 2))"),
    ],
    "deepseekv3_671b": [
        Row("opt_base_learning_rate", ds_lr, DS + "config_GB300_64x4x256xtp1pp4cp1.sh:45; README.md:8"),
        Row("opt_learning_rate_warmup_steps", const(4), DS + "config_GB300_64x4x256xtp1pp4cp1.sh:49"),
        Row("opt_learning_rate_decay_steps", const(11996), DS + "config_GB300_64x4x256xtp1pp4cp1.sh:48"),
        Row("opt_end_learning_rate", const(1e-8), DS + "config_GB300_64x4x256xtp1pp4cp1.sh:46"),
        Row("max_steps", const(100), DS + "config_GB300_64x4x256xtp1pp4cp1.sh:47"),
        Row("step_cap", const(100), DS + "pretrain_deepseek_v3_671b.py:163 (train_iters)"),
        Row(
            "opt_learning_rate_decay_schedule",
            const("cosine with linear warmup"),
            DS + "pretrain_deepseek_v3_671b.py:114",
        ),
        Row("opt_name", const("adamw"), DS + "pretrain_deepseek_v3_671b.py:104"),
        Row("opt_adamw_beta_1", const(0.9), "Megatron-Bridge recipes/deepseek/deepseek_v3.py:272"),
        Row("opt_adamw_beta_2", const(0.95), "Megatron-Bridge recipes/deepseek/deepseek_v3.py:273"),
        Row("opt_adamw_epsilon", const(1e-8), DS + "pretrain_deepseek_v3_671b.py:178"),
        Row("opt_adamw_weight_decay", const(0.1), "Megatron-Bridge recipes/deepseek/deepseek_v3.py:275"),
        Row("opt_gradient_clip_norm", const(1.0), "Megatron-Bridge recipes/utils/optimizer_utils.py:33"),
        Row("moe_aux_loss_coeff", const(0.01), DS + "pretrain_deepseek_v3_671b.py:155"),
        Row("max_sequence_length", const(4096), DS + "pretrain_deepseek_v3_671b.py:236"),
        Row("eval_samples", const(1024), DS + "config_GB300_64x4x256xtp1pp4cp1.sh:51-52; pretrain:101"),
        Row("init_checkpoint_step", const(0), DS + "pretrain_deepseek_v3_671b.py:103"),
        Row("first_eval_step", lambda g: 42 + 24576 // g, DS + "config_GB300_64x4x256xtp1pp4cp1.sh:53"),
        Row("eval_every_steps", const(1), DS + "config_GB300_64x4x256xtp1pp4cp1.sh:50"),
        Row("eval_windows", const(1024), DS + "eval_batch_size.patch (eval.py:101); config:51-52"),
    ],
    "llama31_405b": [
        Row("opt_base_learning_rate", l405_lr, L405 + ":150-154"),
        Row("opt_end_learning_rate", const(8e-7), L405 + ":160"),
        Row(
            "opt_learning_rate_warmup_steps",
            lambda g: math.ceil(8000 * 1152 * 8192 / 8192 / g),
            L405 + ":151,159",
        ),
        Row(
            "opt_learning_rate_decay_steps",
            lambda g: math.ceil(1_200_000 * 1152 / g) - math.ceil(8000 * 1152 / g),
            L405 + ":181-182,402",
        ),
        Row("step_cap", lambda g: math.ceil(1_200_000 * 1152 / g), L405 + ":182"),
        Row("opt_learning_rate_decay_schedule", const("cosine with linear warmup"), L405 + ":403"),
        Row("max_sequence_length", const(8192), L405 + ":387"),
        Row("eval_samples", const(5760), L405 + ":388 (--eval_tokens default :306)"),
        Row("eval_every_steps", lambda g: math.ceil(18432 / g), L405 + ":358"),
        Row("eval_windows", lambda g: math.ceil(5760 / g) * g, L405 + ":359,186 (limit_val_batches)"),
        # The reference's first validation is at 18432 * k / GBS steps (:357, a float); on the cadence here.
        Row(
            "first_eval_step",
            lambda g: (
                math.ceil(math.ceil(18432 * math.floor(0.0026 * g + 12) / g) / math.ceil(18432 / g))
                * math.ceil(18432 / g)
            ),
            L405 + ":357",
        ),
    ],
    "llama2_70b_lora": [
        Row(
            "opt_base_learning_rate",
            lambda g: LORA_LR.get(g, 4e-4),
            LORA + "run_llama_70B_scrolls_r16.sh:12; " + RCPS + "rcps_llama2_70b_lora.json",
        ),
        Row(
            "opt_learning_rate_training_steps",
            const(1024),
            LORA + "run_llama_70B_scrolls_r16.sh:22; scripts/mlperf_logging_utils.py:138",
        ),
        Row(
            "opt_learning_rate_warmup_factor",
            const(0.0),
            LORA + "run_llama_70B_scrolls_r16.sh:14; scripts/mlperf_logging_utils.py:137",
        ),
        Row("opt_adamw_weight_decay", const(1e-4), LORA + "run_llama_70B_scrolls_r16.sh:13"),
        Row("opt_gradient_clip_norm", const(0.3), LORA + "run_llama_70B_scrolls_r16.sh:15"),
        Row(
            "lora_rank",
            const(16),
            LORA + "run_llama_70B_scrolls_r16.sh:19; scripts/mlperf_logging_utils.py:143",
        ),
        Row("lora_alpha", const(32), LORA + "run_llama_70B_scrolls_r16.sh:20"),
        Row("step_cap", const(1024), LORA + "run_llama_70B_scrolls_r16.sh:22"),
        Row(
            "eval_every_steps",
            lambda g: math.ceil(384 / g),
            LORA + "run_llama_70B_scrolls_r16.sh:7 (48 at GBS 8)",
        ),
        # Evaluated from eval_delay (HF: eval_delay <= global_step), reported from the next eval on.
        Row(
            "first_eval_step",
            lambda g: int(0.125 * g + 2) * math.ceil(384 / g),
            LORA + "scripts/train.py:158",
        ),
        Row(
            "first_logged_eval_step",
            lambda g: (int(0.125 * g + 2) + 1) * math.ceil(384 / g),
            LORA + "scripts/mlperf_logging_utils.py:173",
        ),
    ],
    "llama31_8b": [
        Row("opt_base_learning_rate", lambda g: L8_RCP[g][0], RCPS + "rcps_llama31_8b.json"),
        # GBS 96's RCP records 16348 warmup samples, a typo of 16,384 (170.7 steps; suite rounds up).
        Row(
            "opt_learning_rate_warmup_steps",
            lambda g: math.ceil(L8_RCP[g][1] / g),
            RCPS + "rcps_llama31_8b.json",
        ),
        Row("opt_end_learning_rate", lambda g: 0.1 * L8_RCP[g][0], L8 + ":157"),
        Row("opt_learning_rate_decay_steps", lambda g: 1_200_000 - math.ceil(L8_RCP[g][1] / g), L8 + ":421"),
        Row("max_steps", const(1_200_000), RULES + "closed_llama31_8b.yaml:86; " + L8 + ":310"),
        Row("opt_adamw_epsilon", const(1e-5), RULES + "closed_llama31_8b.yaml:54"),
        Row("eval_samples", const(1024), L8 + ":309,407"),
        Row("eval_every_steps", lambda g: math.ceil(12288 / g), L8 + ":368"),
        Row("eval_windows", lambda g: math.ceil(1024 / g) * g, L8 + ":369,181 (limit_val_batches)"),
        Row("first_evals", l8_first_evals, L8 + ":180,368,383; nemo/callbacks.py:211-213; " + LIGHTNING),
        Row("init_checkpoint_step", const(0), L8 + ":486,522 (--ckpt_start_step 0, :297)"),
    ],
    "gpt_oss_20b": [
        Row("opt_base_learning_rate", lambda g: OSS_RCP[g][0], RCPS + "rcps_gpt_oss_20b.json"),
        Row("opt_learning_rate_warmup_steps", lambda g: OSS_RCP[g][1] // g, RCPS + "rcps_gpt_oss_20b.json"),
        Row("opt_end_learning_rate", const(4e-5), OSS + "config_MI355X_1x8x1.sh:54"),
        Row(
            "opt_learning_rate_decay_steps",
            lambda g: 1_200_000 - OSS_RCP[g][1] // g,
            OSS + "config_MI355X_1x8x1.sh:57",
        ),
        Row("max_steps", const(1_200_000), OSS + "config_MI355X_1x8x1.sh:55"),
        # The shell's integer division floors both (at GBS 48: 1,008 windows; at 40: every 307 steps).
        Row("eval_every_steps", lambda g: 12288 // g, OSS + "config_MI355X_1x8x1.sh:60-61"),
        Row("first_evals", lambda g: [12288 // g * k for k in (1, 2, 3)], OSS + "config_MI355X_1x8x1.sh:61"),
        Row("eval_windows", lambda g: 1024 // g * g, OSS + "config_MI355X_1x8x1.sh:64-65"),
        # Primus logs eval_iters x GBS (1,008 at GBS 48), which closed_gpt_oss_20b.yaml:72-75 (== 1024) fails:
        # ttt logs 1,024, the decision of docs/benchmarks/gpt_oss_20b.md.
        Row(
            "eval_samples",
            const(1024),
            OSS + "config_MI355X_1x8x1.sh:64; " + RULES + "closed_gpt_oss_20b.yaml:74",
        ),
        Row("train_samples", lambda g: 1_200_000 * g, PRIMUS_MLLOG + ":66-68"),
        Row("init_checkpoint_step", const(0), PRIMUS_MLLOG + ":83 (args.iteration)"),
    ],
    "flux1": [
        Row("opt_base_learning_rate", lambda g: FLUX_RCP[g][0], RCPS + "rcps_flux1.json"),
        Row("opt_learning_rate_warmup_steps", lambda g: FLUX_RCP[g][1], RCPS + "rcps_flux1.json"),
        Row("opt_adamw_beta_1", const(0.9), RCPS + "rcps_flux1.json"),
        Row("opt_adamw_beta_2", const(0.95), RCPS + "rcps_flux1.json"),
        Row("opt_adamw_epsilon", const(1e-8), FLUX + "train_configs/flux_schnell_mlperf.toml:28"),
        Row("opt_adamw_weight_decay", const(0.1), RCPS + "rcps_flux1.json"),
        Row("opt_gradient_clip_norm", const(1.0), FLUX + "train_configs/flux_schnell_mlperf.toml:37"),
        Row("evaluation_frequency", const(262_144), FLUX + "train_configs/flux_schnell_mlperf.toml:58"),
        Row("eval_samples", const(29_696), "text_to_image/README.md:332"),
        Row("step_cap", const(30_000), FLUX + "train_configs/flux_schnell_mlperf.toml:38"),
        # GBS dividing 262,144 only: how the reference rounds otherwise (#829) was not read for this table.
        Row("eval_every_steps", lambda g: 262_144 // g, FLUX + "train_configs/flux_schnell_mlperf.toml:58"),
        Row("first_eval_step", lambda g: 262_144 // g, FLUX + "train_configs/flux_schnell_mlperf.toml:58"),
    ],
}

# Per benchmark: the RCP batch sizes, and one without an RCP (with the --set its closed run needs).
SIZES: dict[str, tuple[tuple[int, ...], tuple[int, list[str]]]] = {
    # 8,192: the reference on one 8-GPU node, a GBS without an RCP.
    "rgat": ((4096, 16384, 32768, 65536, 262144), (8192, ["lr=1.5e-3", "warmup_steps=0"])),
    "deepseekv3_671b": ((15_360, 16_384, 18_432), (20_480, [])),
    "llama31_405b": ((1152, 2304, 4608), (1536, [])),
    "llama2_70b_lora": ((8, 16, 32, 128), (64, ["lr=4e-4", "warmup_steps=0"])),
    "llama31_8b": ((16, 32, 64, 96, 128), (48, [])),
    "gpt_oss_20b": ((16, 32, 64), (128, [])),
    "flux1": ((512, 1024, 2048, 4096), (256, ["lr=1e-4", "warmup_steps=0"])),
}
# Non-RCP sizes whose LR and warmup are the submitter's: the value the rows compare is the one set.
L8_RCP[48] = (8e-4, 4096)
OSS_RCP[128] = (1e-3, 12288)
RGAT_LR[8192] = 1.5e-3
SIZES["llama31_8b"] = ((16, 32, 64, 96, 128), (48, ["lr=8e-4", "warmup_steps=86"]))
SIZES["gpt_oss_20b"] = ((16, 32, 64), (128, ["lr=1e-3", "warmup_steps=96", "end_lr=4e-5"]))
# gpt_oss_20b also at sizes that do not divide the eval size (48) or either interval (40).
OSS_RCP[48] = (8e-4, 6144)
OSS_RCP[40] = (8e-4, 5120)
MORE_SIZES = {
    "gpt_oss_20b": [
        (48, ["lr=8e-4", "warmup_steps=128", "end_lr=4e-5"]),
        (40, ["lr=8e-4", "warmup_steps=128", "end_lr=4e-5"]),
    ],
}


def cases():
    for name, (rcps, (other, sets)) in SIZES.items():
        for gbs in rcps:
            yield pytest.param(name, gbs, [], id=f"{name}-{gbs}")
        for gbs, more in [(other, sets), *MORE_SIZES.get(name, [])]:
            yield pytest.param(name, gbs, more, id=f"{name}-{gbs}-no-rcp")


def logged_init_block(bench, tier, tmp_path) -> dict:
    """What a run of `tier` logs between init_start and the model build, read back from its result file."""
    prep = prepare.preflight(bench, tier, tmp_path, None, "fp32", False, False, device="cpu", seed=1)
    log = ResultLog(tmp_path)
    prep.seed = 1
    logged = {}  # what the file receives, record by record (a log closed before run_start is removed)
    log.listeners.append(lambda key, value, metadata: logged.__setitem__(key, value))
    prepare.log_init_keys(log, prep, "org", "platform", {})
    log.close()
    return logged


def harness(bench, tier, what: str):
    task = bench.task
    if what == "first_eval_step":
        return task.first_eval_step(tier)
    if what == "first_logged_eval_step":
        return task.first_logged_eval_step(tier)
    if what == "eval_every_steps":
        return task.eval_every_steps(tier)
    if what == "eval_windows":
        return task.eval_windows(tier) if hasattr(task, "eval_windows") else tier.eval_samples
    if what == "step_cap":
        return tier.max_steps
    if what == "target":
        return tier.target
    if what == "first_evals":
        found, step = [], 0
        while len(found) < 3 and step < tier.max_steps:
            step += 1
            if task.eval_due(tier, step):
                found.append(step)
        return found
    if what == "eval_steps":
        return [s for s in range(1, tier.max_steps + 1) if task.eval_due(tier, s)]
    if what == "eval_seeds_on_reference_gpus":
        return task.eval_windows(tier, tier.global_batch_size // 1024)
    if what == "epoch_num_decimals":
        return task.metric.epoch_decimals
    raise AssertionError(f"unknown harness quantity {what}")


@pytest.mark.parametrize("name, gbs, sets", cases())
def test_reference_tier_matches_its_reference(name, gbs, sets, tmp_path):
    bench = get(name)
    tier = apply_overrides(bench, bench.tier("reference"), [f"global_batch_size={gbs}", *sets])
    from timetotrain.spec.benchmark import closed_violation

    assert closed_violation(bench, tier) is None  # a closed configuration at this GBS
    logged = logged_init_block(bench, tier, tmp_path)
    wrong = []
    for row in TABLE[name]:
        want = row.expect(gbs)
        got = (
            logged.get(row.what, "<not logged>")
            if row.what not in HARNESS
            else (harness(bench, tier, row.what))
        )
        same = got == want or (
            isinstance(want, float) and isinstance(got, float) and math.isclose(got, want, rel_tol=1e-9)
        )
        if not same:
            wrong.append(f"{row.what}: ttt {got!r}, reference {want!r} ({row.source})")
    assert not wrong, "\n".join(wrong)


SUBMISSION = tuple(f"submission_{k}" for k in ("benchmark", "org", "division", "status", "platform"))
# Every key the reference's init block logs (and, llama31_8b, its `train_samples` after run_stop), without
# the PoC name and email two of them add (the submitter's own, no rule asks for them).
REFERENCE_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "rgat": (
        (
            *SUBMISSION,
            "global_batch_size",
            "gradient_accumulation_steps",
            "opt_name",
            "opt_base_learning_rate",
        )
        + ("seed", "train_samples", "eval_samples"),
        RGAT_MAIN + ":325-331,356-357; " + RGAT + "mlperf_logging_utils.py:12-33",
    ),
    "llama31_8b": (
        (
            *SUBMISSION,
            "global_batch_size",
            "gradient_accumulation_steps",
            "max_sequence_length",
            "eval_samples",
        )
        + ("opt_name", "opt_base_learning_rate", "opt_adamw_beta_1", "opt_adamw_beta_2", "opt_adamw_epsilon")
        + ("opt_adamw_weight_decay", "opt_gradient_clip_norm", "opt_end_learning_rate")
        + (
            "opt_learning_rate_warmup_steps",
            "opt_learning_rate_decay_steps",
            "opt_learning_rate_decay_schedule",
        )
        + ("seed", "init_checkpoint_step", "train_samples"),
        L8 + ":402-423,481,522; small_llm_pretraining/nemo/callbacks.py:52-59,202",
    ),
    "gpt_oss_20b": (
        (
            *SUBMISSION,
            "global_batch_size",
            "gradient_accumulation_steps",
            "max_sequence_length",
            "train_samples",
        )
        + ("eval_samples", "seed", "init_checkpoint_step", "opt_name", "opt_base_learning_rate")
        + ("opt_adamw_beta_1", "opt_adamw_beta_2", "opt_adamw_epsilon", "opt_adamw_weight_decay")
        + ("opt_gradient_clip_norm", "opt_end_learning_rate", "opt_learning_rate_warmup_steps")
        + ("opt_learning_rate_decay_steps", "opt_learning_rate_decay_schedule", "max_steps")
        + ("tensor_parallelism", "pipeline_parallelism", "context_parallelism", "expert_parallelism")
        + ("micro_batch_size", "config_filename"),
        PRIMUS_MLLOG + ":76-107",
    ),
    "flux1": (
        (*SUBMISSION, "train_samples", "eval_samples", "seed", "global_batch_size", "opt_name")
        + ("opt_learning_rate_warmup_steps", "opt_adamw_beta_1", "opt_adamw_beta_2", "opt_adamw_epsilon")
        + ("opt_adamw_weight_decay", "opt_base_learning_rate", "opt_gradient_clip_norm")
        + ("gradient_accumulation_steps", "evaluation_frequency"),
        FLUX + "mlperf_logging.py:51-103",
    ),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_KEYS))
def test_reference_tier_logs_every_key_its_reference_logs(name, tmp_path):
    bench = get(name)
    keys, source = REFERENCE_KEYS[name]
    logged = logged_init_block(bench, bench.tier("reference"), tmp_path)
    missing = [k for k in keys if k not in logged]
    assert not missing, f"{name}: the reference logs {missing} ({source}); the reference tier does not"


def test_every_table_row_names_its_source():
    for name, rows in TABLE.items():
        assert name in SIZES
        for row in rows:
            assert ":" in row.source or ".json" in row.source, (name, row)
