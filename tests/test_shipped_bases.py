"""The shipped bases (issue 29): the tiers that fine-tune or continue a base of ours load it from the package,
pinned by sha256, so every host starts from the same bits; a changed or missing file is refused in one line
before anything parses it; `ttt base` stays the record of how each was made."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from conftest import mllog, require_file, shared_data_dir
from safetensors import safe_open
from safetensors.torch import save_file

from timetotrain.cli import main
from timetotrain.data import govreport
from timetotrain.errors import UserError
from timetotrain.spec import benchmark as spec_benchmark
from timetotrain.spec.registry import get
from timetotrain.train import base_model
from timetotrain.train.checkpoint import check_init_source

TIERS = ["llama2_70b_lora", "deepseekv3_671b", "llama31_405b", "qwen35_397b_grpo"]


@pytest.mark.parametrize("name", TIERS)
def test_the_tier_runs_from_its_pinned_shipped_base(name):
    bench = get(name)
    tier = bench.tier("tiny")
    shipped = tier.base.shipped
    folder = base_model.shipped_base(tier.base)  # every pinned file, hashed
    files = {p.name for p in folder.iterdir()}
    # Weights as safetensors only (nothing a loader would unpickle), every file but the description pinned.
    assert files == {name for name, _ in shipped.sha256} | {base_model.BASE_JSON}
    assert "config.json" in files and (
        "model.safetensors" in files or "model.safetensors.index.json" in files
    )
    assert all(p.stat().st_size < 5_000_000 for p in folder.iterdir())  # no file over 5 MB in the repository
    assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files)
    assert shipped.name.startswith(f"{name}-tiny-v")
    # base.json is the record `ttt base` wrote when it made these bits: this recipe, these weights.
    doc = json.loads((folder / base_model.BASE_JSON).read_text())
    assert (doc["benchmark"], doc["tier"], doc["seed"]) == (tier.base.benchmark.name, "tiny", tier.base.seed)
    assert doc["weights_sha256"] == shipped.weights_sha256
    assert doc["steps"] == tier.base.pretraining.max_steps
    # A few MB in all: package data, not a download.
    assert sum(p.stat().st_size for p in folder.iterdir()) < 16 * 2**20
    # A run without --init-checkpoint resolves it, and logs it by name with its sha256.
    got = base_model.check_init_base(bench, tier, None)
    assert (got.folder, got.sha256, got.shipped) == (folder, shipped.weights_sha256, shipped.name)
    assert got.note is None


@pytest.mark.bad_input
@pytest.mark.parametrize("damage", ["flip", "missing"])
def test_a_tampered_shipped_base_is_refused_in_one_line(damage, tmp_path, monkeypatch):
    bench = get("llama2_70b_lora")
    tier = bench.tier("tiny")
    shipped = tier.base.shipped
    copy = tmp_path / shipped.name
    shutil.copytree(shipped.folder, copy)
    weights = copy / shipped.sha256[0][0]  # the first weights file
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1  # one bit of one weight
        weights.write_bytes(bytes(data))
    else:
        weights.unlink()
    monkeypatch.setattr(spec_benchmark, "BASES", tmp_path)
    with pytest.raises(UserError) as e:
        base_model.check_init_base(bench, tier, None)
    msg = str(e.value)
    assert "\n" not in msg and str(weights) in msg and shipped.name in msg and "reinstall timetotrain" in msg
    assert ("is missing" if damage == "missing" else "has sha256") in msg


def test_a_tier_without_a_shipped_base_still_needs_ttt_base():
    bench = get("llama2_70b_lora")
    tier = bench.tier("tiny")
    tier = dataclasses.replace(tier, base=dataclasses.replace(tier.base, shipped=None))
    with pytest.raises(UserError, match="fine-tunes a base model: make it with `ttt base llama2_70b_lora"):
        base_model.check_init_base(bench, tier, None)


def test_a_base_of_other_bits_runs_with_a_note(tmp_path):
    """A `ttt base` folder from another CPU (other bits, same recipe) is accepted with `--init-checkpoint`,
    and the run says it is not the base the target was set on."""
    bench = get("llama2_70b_lora")
    tier = bench.tier("tiny")
    other = tmp_path / "other"
    shutil.copytree(tier.base.shipped.folder, other)
    _join(other, other / "model.safetensors")
    for shard in [*other.glob("model-*-of-*.safetensors"), other / "model.safetensors.index.json"]:
        shard.unlink()  # a `ttt base` folder: one weights file (the loader would read an index first)
    data = bytearray((other / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (other / "model.safetensors").write_bytes(bytes(data))
    doc = json.loads((other / base_model.BASE_JSON).read_text())
    doc["weights_sha256"] = base_model.sha256_file(other / "model.safetensors")
    (other / base_model.BASE_JSON).write_text(json.dumps(doc))
    got = base_model.check_init_base(bench, tier, other)
    assert got.folder == other and got.shipped is None and got.sha256 == doc["weights_sha256"]
    assert "is not the shipped" in got.note and tier.base.shipped.name in got.note


def _join(folder, out):
    """The shards of a shipped base written as one file, the way `ttt base` writes its weights."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(folder / shard, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(tensors) == set(index["weight_map"])
    save_file(tensors, out, metadata={"format": "pt"})


@pytest.mark.parametrize("name", TIERS)
def test_the_shards_are_the_bits_ttt_base_made(name, tmp_path):
    """Shipped as shards under 5 MB a file, joined they are byte for byte the `model.safetensors` that
    `ttt base` wrote (its sha256 in base.json and in the run logs)."""
    shipped = get(name).tier("tiny").base.shipped
    if not (shipped.folder / "model.safetensors.index.json").exists():  # small enough to ship whole
        assert dict(shipped.sha256)["model.safetensors"] == shipped.weights_sha256
        return
    _join(shipped.folder, tmp_path / "model.safetensors")
    assert base_model.sha256_file(tmp_path / "model.safetensors") == shipped.weights_sha256


# --- `--init-checkpoint` with a shipped base (issue 37) ---

INIT = ["llama2_70b_lora", "deepseekv3_671b"]


def _copy(tier, tmp_path):
    copy = tmp_path / "copy"  # a plain copy, as `cp -r` of the installed folder makes
    shutil.copytree(tier.base.shipped.folder, copy)
    return copy


@pytest.mark.parametrize("where", ["shipped", "copy"])
@pytest.mark.parametrize("name", INIT)
def test_init_checkpoint_takes_the_shipped_base_or_a_copy(name, where, tmp_path):
    """The shipped folder, sharded, passed by its path (or copied): every file is checked against the pins in
    the suite and the run goes on to load it, logged as the shipped base (its bits, whatever the path)."""
    bench = get(name)
    tier = bench.tier("tiny")
    shipped = tier.base.shipped
    folder = shipped.folder if where == "shipped" else _copy(tier, tmp_path)
    got = base_model.check_init_base(bench, tier, folder)
    assert (got.folder, got.sha256, got.shipped, got.note) == (
        folder,
        shipped.weights_sha256,
        shipped.name,
        None,
    )
    assert check_init_source(folder, bench.family, tier.model) == "hf"  # the run's next preflight step


def _reverse_table(folder):
    """A consistent tamper: the vocabulary table reversed and base.json's sha256 of it updated to match."""
    table = folder / base_model.VOCAB_TABLE
    np.save(table, np.load(table)[::-1].copy())
    doc = json.loads((folder / base_model.BASE_JSON).read_text())
    doc["vocab_table_sha256"] = base_model.sha256_file(table)
    (folder / base_model.BASE_JSON).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return table


@pytest.mark.bad_input
@pytest.mark.parametrize("layout", ["shards", "joined"])
@pytest.mark.parametrize("name", INIT)
def test_a_reversed_table_with_its_base_json_updated_is_refused(name, layout, tmp_path):
    """base.json is no pin of its own files: the shipped base's pins (outside the folder) cover base.json
    itself and, in any base of the recipe, the table and config, which no host's rounding changes. Joined:
    the folder `ttt base` would write (one model.safetensors) with the shipped weights."""
    bench = get(name)
    tier = bench.tier("tiny")
    copy = _copy(tier, tmp_path)
    if layout == "joined":
        _join(copy, copy / "model.safetensors")
        for f in [*copy.glob("model-*-of-*.safetensors"), copy / "model.safetensors.index.json"]:
            f.unlink()
    _reverse_table(copy)
    with pytest.raises(UserError) as e:
        base_model.check_init_base(bench, tier, copy)
    msg = str(e.value)
    assert "\n" not in msg and str(copy) in msg and "--init-checkpoint" in msg
    assert "delete" not in msg and "rm " not in msg


@pytest.mark.bad_input
@pytest.mark.parametrize("tamper", ["table", "description"])
def test_a_tampered_base_json_of_the_installed_base_is_refused(tamper, tmp_path, monkeypatch):
    """base.json is pinned too: the table reversed with base.json updated, or base.json alone edited (what a
    run logs of the base, e.g. its steps), is refused before anything parses it."""
    bench = get("llama2_70b_lora")
    tier = bench.tier("tiny")
    folder = tmp_path / tier.base.shipped.name
    shutil.copytree(tier.base.shipped.folder, folder)
    if tamper == "table":
        _reverse_table(folder)
    else:
        doc = json.loads((folder / base_model.BASE_JSON).read_text())
        doc["steps"] += 1
        (folder / base_model.BASE_JSON).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    monkeypatch.setattr(spec_benchmark, "BASES", tmp_path)  # as if the installed folder were edited
    with pytest.raises(UserError, match=r"base.json has sha256 .* reinstall timetotrain"):
        base_model.check_init_base(bench, tier, None)


@pytest.mark.bad_input
@pytest.mark.parametrize("name", INIT)
def test_a_damaged_copy_is_refused_without_advice_to_delete(name, tmp_path):
    bench = get(name)
    tier = bench.tier("tiny")
    copy = _copy(tier, tmp_path)
    shard = copy / tier.base.shipped.sha256[0][0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        base_model.check_init_base(bench, tier, copy)
    msg = str(e.value)
    assert "\n" not in msg and f"{shard} has sha256" in msg and tier.base.shipped.name in msg
    assert "leave out --init-checkpoint" in msg and "delete" not in msg


@pytest.mark.bad_input
def test_a_file_no_pin_covers_is_refused(tmp_path):
    """A second weights file beside the shards (the loader would read the index, not it) or any other
    unpinned file: nothing in a base folder goes unchecked."""
    bench = get("llama2_70b_lora")
    tier = bench.tier("tiny")
    copy = _copy(tier, tmp_path)
    (copy / "model.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match=r"model.safetensors is not a file of the base"):
        base_model.check_init_base(bench, tier, copy)


@pytest.mark.slow
@pytest.mark.e2e
def test_ttt_run_from_a_copy_of_the_shipped_base_takes_a_step(tmp_path, capsys):
    """`ttt run llama2_70b_lora --tier tiny --init-checkpoint COPY`: the run starts, trains a step from the
    copy, and logs it as the shipped base (about 4 s)."""
    src = require_file(shared_data_dir() / "govreport" / "gov_report.validation.scrolls_format.jsonl")
    spm = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")
    govreport.prepare_tiny(src, spm, tmp_path / "gov")
    tier = get("llama2_70b_lora").tier("tiny")
    copy = _copy(tier, tmp_path)
    args = ["run", "llama2_70b_lora", "--tier", "tiny", "--data", str(tmp_path / "gov")]
    args += [
        "--logdir",
        str(tmp_path / "logs"),
        "--max-steps",
        "1",
        "--quiet",
        "--init-checkpoint",
        str(copy),
    ]
    assert main(args) == 1, capsys.readouterr().err  # aborted at the step limit, after one step
    keys = {
        r["key"]: r["value"] for r in mllog(tmp_path / "logs" / "llama2_70b_lora" / "tiny" / "result_0.txt")
    }
    assert keys["ttt_init_base"] == tier.base.shipped.name
    assert keys["ttt_init_checkpoint_sha256"] == tier.base.shipped.weights_sha256


@pytest.mark.bad_input
def test_a_base_json_whose_sha256_is_not_one_is_refused(tmp_path):
    bench = get("llama2_70b_lora")
    tier = bench.tier("tiny")
    copy = _copy(tier, tmp_path)
    doc = json.loads((copy / base_model.BASE_JSON).read_text())
    doc["vocab_table_sha256"] = 5  # compared as a digest, it was a TypeError traceback
    (copy / base_model.BASE_JSON).write_text(json.dumps(doc))
    with pytest.raises(UserError, match=r"base.json: vocab_table_sha256 is not a sha256"):
        base_model.check_init_base(bench, tier, copy)
