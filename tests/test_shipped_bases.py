"""The shipped bases (issue 29): the tiers that fine-tune or continue a base of ours load it from the package,
pinned by sha256, so every host starts from the same bits; a changed or missing file is refused in one line
before anything parses it; `ttt base` stays the record of how each was made."""

import dataclasses
import json
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from timetotrain.errors import UserError
from timetotrain.suite import base as suite_base
from timetotrain.suite import get
from timetotrain.train import base_model

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
    monkeypatch.setattr(suite_base, "BASES", tmp_path)
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
