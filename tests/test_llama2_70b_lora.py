"""llama2_70b_lora on the harness: the reference block against the official closed rules, LoRA applied by
the task (only adapters train and carry optimizer state), frozen-base FLOPs, the eval delay, and the HF
Trainer eval-loss definition on prepared GovReport blocks."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import require_file, shared_data_dir

from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir
from timetotrain.mlperf.keys import submission_keys
from timetotrain.models.llama import LlamaConfig
from timetotrain.suite import get
from timetotrain.tasks.lora_sft import LoRAData
from timetotrain.train.lora import lora_param_count
from timetotrain.train.step import build_training

BENCH = get("llama2_70b_lora")
REF = BENCH.tier("reference")
SMALL = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=32_000, max_seq_len=256,
                    rope_theta=10_000.0)  # fmt: skip


def small_tier(**data):
    return dataclasses.replace(
        REF, model=SMALL, data=LoRAData(block=32, train_samples=9, **data), global_batch_size=4, micro_batch_size=2,
        eval_samples=2, max_steps=10, eval_every_samples=8,
    )  # fmt: skip


def test_reference_block_passes_every_official_closed_rule():
    files = [official_rules_dir() / f for f in BENCH.closed_rules]
    logged = submission_keys(BENCH, REF, "org", "platform") + BENCH.hyperparameters(REF)
    assert hparam_violations(files, logged) == []
    keys = {k for k, _ in logged}
    for item in yaml.safe_load(files[1].read_text()):
        name = item["KEY"]["NAME"]
        if name != "eval_accuracy":
            assert name in keys, name
    bad = [(k, 8 if k == "lora_rank" else v) for k, v in logged]
    assert any("lora_rank" in p for p in hparam_violations(files, bad))


def test_reference_shape_and_schedule():
    assert lora_param_count(REF.model, 16) == 44_564_480
    # HF eval_delay = int(0.125 * 8 + 2) * 48 steps: the first evaluation at step 144.
    assert REF.eval_every_steps == 48 and BENCH.task.first_eval_step(REF) == 144
    assert BENCH.schedule == "hf_cosine" and REF.end_lr == 0.0


def test_only_adapters_train_and_carry_optimizer_state():
    tier = small_tier(dropout=0.0)
    tr = build_training(BENCH, tier, torch.device("cpu"), seed=3)
    trainable = [n for n, p in tr.bare.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(p.numel() for p in tr.params) == lora_param_count(SMALL, 16)
    base = {n: p.detach().clone() for n, p in tr.bare.named_parameters() if not p.requires_grad}
    data = BENCH.task.synthetic(tier, 4, torch.Generator().manual_seed(0), torch.device("cpu"))
    for step in range(3):
        tr.step(step, data.batch(step), 2, data.loss)
    assert all(torch.equal(p, base[n]) for n, p in tr.bare.named_parameters() if not p.requires_grad)
    assert all(p.grad is None for p in tr.bare.parameters() if not p.requires_grad)
    assert any(p.abs().sum() > 0 for n, p in tr.bare.named_parameters() if ".lora_B." in n)  # B left zero
    assert len(tr.opt.state) == len(trainable)


def test_frozen_base_flops():
    tier = small_tier()
    seq = 31  # a block of 32 tokens predicts 31
    matmul = 2 * (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128) + 64 * 32_000
    attention = 12 * 2 * 4 * 16 * seq // 2
    expected = seq * (4 * matmul + attention + 6 * lora_param_count(SMALL, 16))
    assert BENCH.flops_per_sample(tier) == pytest.approx(expected)


def test_eval_loss_is_the_hf_trainer_mean_of_per_block_means(tmp_path):
    """On prepared GovReport blocks: our evaluate equals the HF Trainer definition computed here by hand."""
    from timetotrain.data import govreport

    src = require_file(shared_data_dir() / "govreport" / "gov_report.validation.scrolls_format.jsonl")
    tok = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")
    govreport.prepare_tiny(src, tok, tmp_path)
    ids, labels, _ = govreport.load_prepared(tmp_path, "validation")
    block = ids.shape[1]
    cfg = dataclasses.replace(SMALL, max_seq_len=block)
    tier = dataclasses.replace(
        small_tier(dropout=0.0), model=cfg, data=LoRAData(block=block, train_samples=9)
    )
    tier = dataclasses.replace(tier, eval_samples=len(ids))
    task = BENCH.task
    tr = build_training(BENCH, tier, torch.device("cpu"), seed=1)
    data = task.open(tier, task.resolve(tier, tmp_path), 1, 0, 1, torch.device("cpu"))
    got = data.evaluate(tr.model)
    with torch.no_grad():
        tr.model.eval()
        per_block = []
        for i in range(len(ids)):
            x = torch.from_numpy(ids[i : i + 1].astype("int64"))
            y = torch.from_numpy(labels[i : i + 1].astype("int64"))
            logits = tr.model(x)
            per_block.append(F.cross_entropy(logits[0, :-1], y[0, 1:], ignore_index=-100).item())
    assert got == pytest.approx(sum(per_block) / len(per_block), rel=1e-6)
    # Batches of training blocks come as dicts of input_ids and labels, the same on every call.
    b0, b1 = data.batch(0), data.batch(0)
    assert set(b0) == {"input_ids", "labels"} and torch.equal(b0["input_ids"], b1["input_ids"])


def test_plan_counts_the_frozen_base_without_optimizer_state():
    from timetotrain.train.memory import plan

    n, rows, best = plan(BENCH, REF, 8, 80, None)  # bf16 compute: the frozen base is stored in bf16
    lora = lora_param_count(REF.model, 16)
    dp = next(r for r in rows if r.parallel == "dp=8")
    fsdp = next(r for r in rows if r.parallel == "fsdp=8")
    assert dp.states == 16 * lora + 2 * n  # bf16 frozen base weights, no gradients or moments
    assert fsdp.states == dp.states / 8
    assert dp.compute_copies == 2 * lora  # autocast copies only the fp32 adapters
    assert best is not None and best.parallel == "fsdp=8"
    # fp32 compute keeps an fp32 base (4 B), as does a tier that opts out of the bf16 base.
    _, rows32, _ = plan(BENCH, REF, 8, 80, None, bf16=False)
    assert next(r for r in rows32 if r.parallel == "dp=8").states == 16 * lora + 4 * n
    fp32_base = dataclasses.replace(REF, data=dataclasses.replace(REF.data, bf16_base=False))
    _, rows_opt_out, _ = plan(BENCH, fp32_base, 8, 80, None)
    dp_opt_out = next(r for r in rows_opt_out if r.parallel == "dp=8")
    assert dp_opt_out.states == 16 * lora + 4 * n and dp_opt_out.compute_copies == 2 * (lora + n)
