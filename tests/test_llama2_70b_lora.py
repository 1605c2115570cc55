"""llama2_70b_lora on the harness: the reference block against the official closed rules and its logged LoRA
keys, LoRA applied by the task (only adapters train and carry optimizer state), frozen-base FLOPs (by formula
and against torch's FLOP counter), `ttt synth`, the eval delay, a run that misses its target, and the HF
Trainer eval loss (its definition by hand, and `Trainer.evaluate()` itself) on prepared GovReport blocks."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import mllog, random_hf_llama, require, require_file, shared_data_dir

from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir
from timetotrain.mlperf.keys import submission_keys
from timetotrain.models.common.lora import lora_param_count
from timetotrain.models.llama import LlamaConfig
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.tasks.lora_sft import LoRAData
from timetotrain.train.step import build_training

pytestmark = pytest.mark.parity

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
    logged = dict(BENCH.hyperparameters(REF))
    assert [logged[k] for k in ("lora_rank", "lora_alpha", "train_samples", "eval_samples")] == [
        16,
        32,
        3901,
        173,
    ]


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
    first_qkv = 2 * 64 * (4 + 2 * 2) * 16 + 2 * 16 * 64  # block 0's qkv and its A: no input gradient
    expected = seq * (4 * matmul + attention + 6 * lora_param_count(SMALL, 16) - first_qkv)
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
    data = task.open(
        tier, task.resolve(tier, tmp_path), 1, Share.of(tier.global_batch_size), torch.device("cpu")
    )
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
    # bf16 frozen base weights, no gradients or moments; DDP's buckets hold the adapters' gradients only
    assert dp.states == 20 * lora + 2 * n
    assert fsdp.states == (16 * lora + 2 * n) / 8
    assert dp.compute_copies == 2 * lora  # autocast copies only the fp32 adapters
    assert best is not None and best.parallel == "fsdp=8"
    # fp32 compute keeps an fp32 base (4 B), as does a tier that opts out of the bf16 base.
    _, rows32, _ = plan(BENCH, REF, 8, 80, None, bf16=False)
    assert next(r for r in rows32 if r.parallel == "dp=8").states == 20 * lora + 4 * n  # (+ buckets)
    fp32_base = dataclasses.replace(REF, data=dataclasses.replace(REF.data, bf16_base=False))
    _, rows_opt_out, _ = plan(BENCH, fp32_base, 8, 80, None)
    dp_opt_out = next(r for r in rows_opt_out if r.parallel == "dp=8")
    assert dp_opt_out.states == 20 * lora + 4 * n and dp_opt_out.compute_copies == 2 * (lora + n)


def test_plan_command_says_the_frozen_base_has_no_optimizer_state(capsys):
    from timetotrain.cli import main

    assert main(["plan", "llama2_70b_lora", "--tier", "reference", "--gpus", "8", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert "44.56 M trainable x 16 B" in out
    assert "68.98 B frozen x 2 B (bf16 weight only: no gradient, no optimizer state)" in out
    assert "suggestion: fsdp=8, activation checkpointing on" in out


def test_a_training_step_runs_exactly_the_matmuls_the_flops_count():
    """torch's FLOP counter over one forward and backward of the LoRA model: its matmul FLOPs are the
    task's count without attention, so no frozen weight gets a weight-gradient matmul, and the count
    leaves out only what autograd skips (the input gradient of block 0's qkv, whose input is the frozen
    embedding)."""
    from torch.utils.flop_counter import FlopCounterMode

    tier = small_tier(dropout=0.0)
    tr = build_training(BENCH, tier, torch.device("cpu"), seed=3)
    data = BENCH.task.synthetic(tier, 2, torch.Generator().manual_seed(0), torch.device("cpu"))
    batch = data.batch(0)
    with FlopCounterMode(display=False) as counter:
        data.loss(tr.model, batch).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    # Every op it counts but attention (which it does not see inside CPU SDPA anyway).
    matmuls = sum(n for op, n in counts.items() if "scaled_dot_product" not in op)
    # Per token: 2 layers of qkv (8,192 weights), proj (4,096) and SwiGLU (24,576), and the head (2,048,000),
    # each 4 FLOPs; the 10,240 adapter parameters 6; block 0's qkv 2 less per weight and its A (16 x 64).
    qkv, frozen, adapters = 64 * 8 * 16, 2 * (64 * 8 * 16 + 64 * 64 + 3 * 64 * 128) + 64 * 32_000, 10_240
    per_token = 4 * frozen + 6 * adapters - 2 * qkv - 2 * 16 * 64
    assert matmuls == 2 * 31 * per_token
    seq = 31
    attention = BENCH.flops_per_sample(tier) - seq * per_token  # what the count adds: the attention scores
    assert attention == pytest.approx(seq * 12 * 2 * 4 * 16 * seq // 2)


def _gov_rows(tok, out, rows=None, block=64):
    """Both splits of a few short synthetic GovReport rows, packed into `block`-token blocks."""
    from timetotrain.data import govreport

    if rows is None:
        rows = [{"input": f"Report {i} on item {i}. " * 3, "output": f"Item {i}."} for i in range(40)]
    src = out / "rows.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), **r}) + "\n" for i, r in enumerate(rows)))
    for split in ("train", "validation"):
        govreport.prepare(src, split, tok, out / "data", block=block, packing="whole")
    return out / "data"


@pytest.mark.parametrize("target", [0.0, 1e6])
def test_a_run_that_misses_the_target_ends_fail(tmp_path, monkeypatch, target):
    """The reference's 1,024 steps are no multiple of its 48-step eval interval, so its last step is no
    eval point: a run that has not met the target at an eval ends with the reference's status `fail` (exit 1)
    without evaluating there. Here evals every 2 steps, 5 steps. With a target no eval meets (0.0): the eval
    at eval_delay (step 2) runs unreported, as the reference's (`global_step > eval_delay`), the one at step 4
    is logged, the run ends at 5. With one any eval meets (1e6) but the first eval delayed past the end: no
    eval at all."""
    from timetotrain.train import loop

    tok = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")
    data_dir = _gov_rows(tok, tmp_path)
    skip = 1 if target == 0.0 else 3  # first eval at step 2, or at step 6 > the 5 steps
    tier = dataclasses.replace(
        REF, model=SMALL, data=LoRAData(block=64, train_samples=8, dropout=0.0, skip_evals=skip),
        global_batch_size=2, micro_batch_size=2, eval_samples=2, max_steps=5, eval_every_samples=4,
        division="open", target=target,
    )  # fmt: skip
    monkeypatch.setitem(BENCH.tiers, "reference", tier)
    res = loop.run(loop.RunOptions(BENCH.name, "reference", data_dir, tmp_path / "logs", seed=1, echo=False))
    assert (res.status, res.exit_code, res.steps) == ("fail", 1, 5)
    assert "reached 5 steps without meeting the target" in res.reason
    recs = mllog(res.log_path)
    logged = {r["key"]: r["value"] for r in recs}
    assert [logged[k] for k in ("lora_rank", "lora_alpha", "train_samples", "eval_samples")] == [16, 32, 8, 2]
    assert logged["opt_learning_rate_warmup_factor"] == 0.0  # the reference's name for HF's warmup_ratio
    evals = [r["metadata"]["samples_count"] for r in recs if r["key"] == "eval_accuracy"]
    assert evals == ([8] if target == 0.0 else [])
    stop = recs[-1]
    assert stop["key"] == "run_stop" and (stop["metadata"]["status"], stop["metadata"]["samples_count"]) == (
        "fail",
        10,
    )


def test_the_unreported_eval_at_eval_delay_still_ends_the_run(tmp_path, monkeypatch):
    """The reference stops on the loss of the eval at eval_delay too (its stop check reads every eval loss),
    though it does not report it; a run that meets the target there logs that eval, so its log keeps an
    eval_accuracy at the target (the official checker requires one)."""
    from timetotrain.train import loop

    tok = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")
    data_dir = _gov_rows(tok, tmp_path)
    tier = dataclasses.replace(
        REF, model=SMALL, data=LoRAData(block=64, train_samples=8, dropout=0.0, skip_evals=1),
        global_batch_size=2, micro_batch_size=2, eval_samples=2, max_steps=5, eval_every_samples=4,
        division="open", target=1e6,
    )  # fmt: skip
    monkeypatch.setitem(BENCH.tiers, "reference", tier)
    res = loop.run(loop.RunOptions(BENCH.name, "reference", data_dir, tmp_path / "logs", seed=1, echo=False))
    assert (res.status, res.steps) == ("success", 2)
    recs = mllog(res.log_path)
    keys = [r["key"] for r in recs if r["key"] in ("block_stop", "eval_start", "eval_accuracy", "eval_stop")]
    assert keys == ["block_stop", "eval_start", "eval_accuracy", "eval_stop"]
    assert [r["metadata"]["samples_count"] for r in recs if r["key"] == "eval_accuracy"] == [4]


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")  # transformers / accelerate
def test_eval_loss_equals_hf_trainer_evaluate(tmp_path):
    """The metric against `transformers.Trainer.evaluate()` itself, whose `eval_loss` the reference reports:
    an HF Llama and ours loaded from its checkpoint, on prepared validation blocks (batch 1, as the
    reference evaluates). Six rows of a long report and a one-word summary, then six of a short report and a
    long summary: the blocks score very different numbers of tokens, and the mean over all tokens is
    another number, far outside the tolerance."""
    transformers = require("transformers")
    require("accelerate")
    from timetotrain.data import govreport

    tok = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")
    long_report = [
        {"input": f"Report {i} on the state of item {i}. " * 6, "output": "Fine."} for i in range(6)
    ]
    long_summary = [
        {"input": f"Item {i}.", "output": f"Item {i} is reported on, at length. " * 6} for i in range(6)
    ]
    data_dir = _gov_rows(tok, tmp_path, long_report + long_summary, block=128)
    ids, labels, _ = govreport.load_prepared(data_dir, "validation")
    ids, labels = torch.from_numpy(ids.astype("int64")), torch.from_numpy(labels.astype("int64"))
    scored = (labels[:, 1:] != -100).sum(1)
    assert len(ids) >= 3 and scored.max() > 2 * scored.min() > 0
    hf = random_hf_llama(SMALL)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)

    tier = dataclasses.replace(
        small_tier(dropout=0.0), data=LoRAData(block=128, train_samples=9), eval_samples=len(ids)
    )
    tr = build_training(BENCH, tier, torch.device("cpu"), 1, None, tmp_path / "hf")
    task = BENCH.task
    ours = task.open(
        tier, task.resolve(tier, data_dir), 1, Share.of(tier.global_batch_size), torch.device("cpu")
    ).evaluate(tr.model)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_eval_batch_size=1, report_to=[], use_cpu=True,
        remove_unused_columns=False, disable_tqdm=True,
    )  # fmt: skip
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]
    theirs = transformers.Trainer(model=hf, args=args, eval_dataset=rows).evaluate()["eval_loss"]
    assert ours == pytest.approx(theirs, abs=1e-5)
    with torch.no_grad():
        token_mean = hf(input_ids=ids, labels=labels).loss.item()  # one batch: the mean over its tokens
    print(
        f"eval loss: ours {ours:.6f}, Trainer.evaluate {theirs:.6f}, token mean {token_mean:.6f}, scored {scored.tolist()}"
    )
    assert abs(token_mean - theirs) > 1e-3


def test_synth_measures_lora_fine_tuning(tmp_path):
    """`ttt synth llama2_70b_lora` on the CPU (tiny shape, random base): its FLOPs are the task's frozen-base
    count, and the log carries the LoRA keys."""
    from timetotrain.train.prepare import resolve_tier
    from timetotrain.train.synth import SynthOptions, synth

    sets = ["block=128"]  # 128-token blocks: the same model, an eighth of the tier's work per step
    _, tiny = resolve_tier("llama2_70b_lora", "tiny", sets)
    s = synth(
        SynthOptions("llama2_70b_lora", "tiny", steps=2, warmup_steps=1, logdir=tmp_path, seed=3, sets=sets)
    )
    assert s["model_flops_per_sample"] == pytest.approx(BENCH.flops_per_sample(tiny))
    assert s["model_tflops_per_s"] * 1e12 == pytest.approx(s["samples_per_s"] * s["model_flops_per_sample"])
    logged = {r["key"]: r["value"] for r in mllog(Path(s["log"]))}
    assert (logged["lora_rank"], logged["lora_alpha"], logged["eval_samples"]) == (16, 32, tiny.eval_samples)


def test_run_from_a_base_without_its_qkv_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """`ttt run --init-checkpoint` at a base whose layer 1 has neither `qkv_proj` nor all of q/k/v_proj: one
    line naming the tensor and both layouts, before run_start."""
    safetensors = require("safetensors.torch")
    from timetotrain.cli import main
    from timetotrain.train.checkpoint import HF_SINGLE

    tok = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")
    data_dir = _gov_rows(tok, tmp_path)
    capsys.readouterr()  # the preparation's progress lines
    hf = random_hf_llama(SMALL).state_dict()
    (tmp_path / "base").mkdir()
    broken = {n: t for n, t in hf.items() if n != "model.layers.1.self_attn.k_proj.weight"}
    safetensors.save_file(broken, tmp_path / "base" / HF_SINGLE)
    tier = dataclasses.replace(
        REF, model=SMALL, data=LoRAData(block=64, train_samples=8), global_batch_size=2, micro_batch_size=2,
        eval_samples=2, max_steps=5, eval_every_samples=4, division="open",
    )  # fmt: skip
    monkeypatch.setitem(BENCH.tiers, "reference", tier)
    argv = [
        "run",
        "llama2_70b_lora",
        "--tier",
        "reference",
        "--data",
        str(data_dir),
        "--logdir",
        str(tmp_path / "logs"),
    ]
    assert main([*argv, "--init-checkpoint", str(tmp_path / "base"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ttt: error: "), err
    assert "model.layers.1.self_attn.k_proj.weight (needed for layers.1.attn.qkv.weight) is missing" in err
    assert "and so is model.layers.1.self_attn.qkv_proj.weight" in err
    # Found while loading, inside init: the run never reached run_start, so it leaves no log at all.
    assert list((tmp_path / "logs" / "llama2_70b_lora" / "reference").iterdir()) == []
