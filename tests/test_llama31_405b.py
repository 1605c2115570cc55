"""llama31_405b declaration against the closed rules: the GBS-scaled hyperparameters with the rule file's
exact LR equality, the eval cadence with its skipped first evaluations, and a whole log through `ttt check`."""

import dataclasses

import pytest
from fakelogs import logged_keys, tier_log, ttt_main, uncovered_rule_keys

from timetotrain.mlperf.compliance import hparam_violations, official_rules_dir
from timetotrain.mlperf.keys import check_rules
from timetotrain.spec.benchmark import apply_overrides
from timetotrain.spec.registry import get
from timetotrain.suite.llama31_405b import closed_lr

BENCH = get("llama31_405b")
CLOSED = [official_rules_dir() / f for f in BENCH.closed_rules]

# closed_llama31_405b.yaml (and the RCP file for the LRs and warmups): GBS -> (base LR, warmup, decay steps,
# eval every (steps), first eval step). First eval = 18,432 * floor(0.0026 GBS + 12) / GBS.
TABLE = {
    1152: (8e-5, 8000, 1_200_000 - 8000, 16, 224),
    2304: (1.6e-4, 4000, 600_000 - 4000, 8, 18_432 * 17 // 2304),
    4608: (3.2e-4, 2000, 300_000 - 2000, 4, 18_432 * 23 // 4608),
    9216: (6.4e-4, 1000, 150_000 - 1000, 2, 18_432 * 35 // 9216),
}


def logged(tier):
    return logged_keys(BENCH, tier)


def at(gbs, *extra):
    return apply_overrides(BENCH, BENCH.tier("reference"), [f"global_batch_size={gbs}", *extra])


@pytest.mark.parametrize("gbs", sorted(TABLE))
def test_closed_hparams_follow_the_gbs(gbs):
    lr, warmup, decay, every, first = TABLE[gbs]
    tier = at(gbs)
    assert (tier.lr, tier.warmup_steps, tier.decay_steps) == (lr, warmup, decay)
    assert tier.lr * 1152 == gbs * 8e-5  # the rule file's exact float equality
    assert tier.end_lr == 8e-7 and tier.eval_samples == 5760
    assert (tier.eval_every_steps, BENCH.task.first_eval_step(tier)) == (every, first)
    assert hparam_violations(CLOSED, logged(tier)) == []
    check_rules(BENCH, tier)  # no closed refusal either


def test_the_reference_tier_is_gbs_1152_and_logs_every_closed_key():
    tier = BENCH.tier("reference")
    assert tier.global_batch_size == 1152 and tier.data.seq_len == 8192 and tier.runs == 3
    keys = dict(logged(tier))
    assert keys["init_checkpoint_step"] == 0
    assert hparam_violations(CLOSED, logged(tier)) == []
    assert uncovered_rule_keys(CLOSED, logged(tier)) == []


def test_an_odd_gbs_gets_an_lr_that_passes_exact_equality():
    gbs = 1000  # neither divides nor is divided by 1152; first eval: floor(14.6) = 14 skipped intervals
    tier = at(gbs)
    assert tier.lr * 1152 == gbs * 8e-5 and abs(tier.lr - 8e-5 * gbs / 1152) < 1e-18
    assert (tier.warmup_steps, tier.max_steps) == (9216, 1_382_400)
    assert tier.decay_steps == 1_382_400 - 9216
    every = 19  # ceil(18432 / 1000)
    assert tier.eval_every_steps == every
    # 18,432 * 14 / 1000 = 258.05 steps: the first cadence step at or after it.
    assert BENCH.task.first_eval_step(tier) == 266
    assert hparam_violations(CLOSED, logged(tier)) == []


def test_a_gbs_without_an_exact_lr_is_refused_closed_and_runs_open():
    assert closed_lr(1160) is None
    tier = at(1160)
    problems = hparam_violations(CLOSED, logged(tier))
    assert any(p.startswith("opt_base_learning_rate") for p in problems), problems
    check_rules(BENCH, at(1160, "division=open"))


def test_an_lr_one_ulp_off_fails_the_rule_file():
    import math

    tier = BENCH.tier("reference")
    bad = [(k, math.nextafter(v, 1) if k == "opt_base_learning_rate" else v) for k, v in logged(tier)]
    assert any(p.startswith("opt_base_learning_rate") for p in hparam_violations(CLOSED, bad))


def _reference_log(path, gbs):
    tier = at(gbs)
    log = tier_log(path, 7, 3 * 18_432, 30.0, benchmark="llama31_405b", tier="reference", gbs=gbs)
    lines = log.read_text().splitlines()
    # tier_log writes the tier's own schedule keys; put this GBS's and the checkpoint step in.
    fixes = {
        "opt_base_learning_rate": tier.lr,
        "opt_learning_rate_warmup_steps": tier.warmup_steps,
        "opt_learning_rate_decay_steps": tier.decay_steps,
        "max_steps": tier.max_steps,
    }
    import json

    out = []
    for line in lines:
        rec = json.loads(line.removeprefix(":::MLLOG "))
        if rec["key"] in fixes:
            rec["value"] = fixes[rec["key"]]
        out.append(":::MLLOG " + json.dumps(rec))
        if rec["key"] == "eval_samples":
            rec = {**rec, "key": "init_checkpoint_step", "value": 0}
            out.append(":::MLLOG " + json.dumps(rec))
    log.write_text("\n".join(out) + "\n")
    return log


@pytest.mark.parametrize("gbs", [1152, 4608])
def test_a_reference_log_passes_ttt_check(tmp_path, capsys, gbs):
    log = _reference_log(tmp_path / "result_0.txt", gbs)
    assert ttt_main(["check", str(log)]) == 0, capsys.readouterr().out


def _mlcommons_folder(root, tokenizer: dict[str, str]):
    """The three files of MLCommons' preprocessed Mixtral C4 under their names (a few tiny documents each),
    with manifests naming `tokenizer` for the shard `en_7`."""
    import numpy as np

    from timetotrain.data.indexed import IndexedWriter
    from timetotrain.data.manifest import write_manifest

    rng = np.random.default_rng(0)
    root.mkdir()
    for name in ("c4-train.en_6", "c4-train.en_7", "c4-validation-91205-samples.en"):
        prefix = root / f"{name}_text_document"
        with IndexedWriter(prefix, np.uint16) as w:
            for _ in range(40):
                w.add_document(rng.integers(0, 32768, 300))
        files = [root / f"{prefix.name}.bin", root / f"{prefix.name}.idx"]
        tok = tokenizer if name == "c4-train.en_7" else {"name": "mixtral"}
        write_manifest(root, name, files, {"tokenizer": tok})
    return root


def test_data_prepared_with_another_tokenizer_is_a_preflight_error(tmp_path):
    from timetotrain.errors import UserError

    # An evaluation reads whole global batches: at GBS 8, ceil(8 / 8) = one batch of 8 windows (at 1,152 it
    # would be 1,152). The LR is given: scaled to GBS 8 it would fall below the fixed end LR.
    sets = ["seq_len=64", "eval_samples=8", "global_batch_size=8", "lr=1e-5", "division=open"]
    tier = apply_overrides(BENCH, BENCH.tier("reference"), sets)
    good = BENCH.task.resolve(tier, _mlcommons_folder(tmp_path / "ok", {"name": "mixtral"}))
    assert [p.name for p in good.train_prefixes] == [
        "c4-train.en_6_text_document",
        "c4-train.en_7_text_document",
    ]
    assert good.val_prefix.name == "c4-validation-91205-samples.en_text_document"
    with pytest.raises(
        UserError, match=r"c4-train.en_7_text_document: prepared with tokenizer 'llama3'.*mixtral"
    ):
        BENCH.task.resolve(tier, _mlcommons_folder(tmp_path / "bad", {"name": "llama3"}))


def _hf_folder(path, **overrides):
    from conftest import random_hf_llama, small_llama

    random_hf_llama(small_llama(**overrides)).save_pretrained(
        path, safe_serialization=True, max_shard_size=200_000
    )
    assert len(list(path.glob("*.safetensors"))) == 3
    return path


def test_missing_shard_is_one_line_before_init_start(tmp_path, capsys):
    from timetotrain.cli import main

    hf = _hf_folder(tmp_path / "hf", vocab_size=384)
    (hf / "model-00002-of-00003.safetensors").unlink()
    argv = ["run", "llama31_405b", "--tier", "reference", "--data", str(tmp_path / "data")]
    argv += ["--logdir", str(tmp_path / "logs"), "--init-checkpoint", str(hf)]
    code = main(argv)
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ttt: error:")]
    assert code == 2 and len(errors) == 1, errors
    assert "model-00002-of-00003.safetensors" in errors[0] and "missing" in errors[0]
    assert not list((tmp_path / "logs").rglob("result_*.txt"))  # nothing logged: no init_start


def test_shape_mismatch_is_one_line_naming_the_tensor(tmp_path):
    import torch
    from conftest import small_llama

    from timetotrain.errors import UserError
    from timetotrain.models.llama import Llama
    from timetotrain.train.checkpoint import init_from

    hf = _hf_folder(tmp_path / "hf", vocab_size=384, ffn_dim=96)
    cfg = small_llama()  # ffn 128
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    rows = BENCH.task.checkpoint_rows(BENCH.tier("reference"))
    rows = dict.fromkeys(rows, cfg.vocab_size)
    with pytest.raises(UserError) as e:
        init_from(hf, model, BENCH.family, cfg, truncate_rows=rows)
    msg = str(e.value)
    assert "\n" not in msg and "layers.0.ffn.fc1.weight" in msg, msg


def test_embedding_and_head_keep_the_first_rows(tmp_path):
    import torch
    from conftest import small_llama

    from timetotrain.models.llama import Llama
    from timetotrain.train.checkpoint import init_from

    hf = _hf_folder(tmp_path / "hf", vocab_size=384)
    from safetensors.torch import load_file

    tensors = {}
    for f in hf.glob("*.safetensors"):
        tensors.update(load_file(f))
    cfg = small_llama()  # 256 rows
    model = Llama(cfg)
    rows = {"embed.weight": 256, "head.weight": 256}
    assert BENCH.task.checkpoint_rows(dataclasses.replace(BENCH.tier("reference"), model=cfg)) == rows
    init_from(hf, model, BENCH.family, cfg, truncate_rows=rows)
    assert torch.equal(model.embed.weight, tensors["model.embed_tokens.weight"][:256])
    assert torch.equal(model.head.weight, tensors["lm_head.weight"][:256])


def test_synth_reference_runs_one_block_at_the_exact_width(tmp_path, monkeypatch):
    """`ttt synth llama31_405b --tier reference` cannot hold 126 blocks on one GPU: it runs 1 at width
    16,384 and says so. Checked on the tiny tier's shape (the reference needs a GPU): the same path."""
    from timetotrain.spec import registry
    from timetotrain.train.synth import SynthOptions, format_table, synth

    assert BENCH.synth_layers == {"reference": 1}
    from timetotrain.suite.llama31_405b import TINY

    patched = dataclasses.replace(BENCH, tiers={**BENCH.tiers, "tiny": TINY}, synth_layers={"tiny": 1})
    monkeypatch.setattr(registry, "get", lambda name: patched)
    s = synth(SynthOptions("llama31_405b", "tiny", steps=2, warmup_steps=0, logdir=tmp_path, seed=3))
    assert (s["layers"], s["layers_of"]) == (1, 2)
    assert "1 of its 2 layers at the exact width (reduced depth)" in format_table(s)


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_continues_a_llama3_base_on_mixtral_ids(c4_src, c4_prepared, tmp_path):
    """The tiny tier's situation end to end, shortened: a base pretrained on Llama 3 ids (cut to 3 steps),
    continued by `ttt run` on Mixtral-tokenized C4 with the embedding and head cut to the tier's rows. The
    log names the base's sha256 and `init_checkpoint_step` 0, and its keys pass the tier's rule file."""

    from conftest import mllog, require_file, shared_data_dir, ttt_run

    from timetotrain.data import c4
    from timetotrain.mlperf.compliance import rule_file
    from timetotrain.train import base_model

    recipe = BENCH.tier("tiny").base
    pre = dataclasses.replace(recipe.pretraining, max_steps=3, warmup_steps=1, eval_samples=2)
    recipe = dataclasses.replace(recipe, benchmark=dataclasses.replace(recipe.benchmark, tiers={"tiny": pre}))
    base, doc, _ = base_model.make_base(recipe, c4_prepared, tmp_path / "cache", echo=False)
    model = require_file(shared_data_dir() / "tokenizers" / "mixtral-8x22b" / "tokenizer.model")
    mixtral = tmp_path / "c4-mixtral"
    for split in ("train", "validation"):
        c4.prepare(c4_src, split, "mixtral", mixtral, workers=1, tokenizer_model=model)
    args = ["run", "llama31_405b", "--tier", "tiny", "--data", str(mixtral), "--init-checkpoint", str(base)]
    args += ["--logdir", str(tmp_path / "logs"), "--max-steps", "2", "--quiet", "--seed", "1"]
    proc = ttt_run(*args)
    assert proc.returncode in (0, 1) and "ttt: error" not in proc.stderr, proc.stderr[-3000:]
    log = next((tmp_path / "logs" / "llama31_405b" / "tiny").glob("result_*.txt"))
    first = {}
    for r in mllog(log):
        first.setdefault(r["key"], r["value"])
    assert first["ttt_init_checkpoint_sha256"] == doc["weights_sha256"]
    assert first["init_checkpoint_step"] == 0
    hp = [(k, first[k]) for k, _ in logged(BENCH.tier("tiny"))]
    assert hparam_violations([rule_file("llama31_405b", "tiny")], hp) == []
