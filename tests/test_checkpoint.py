"""Checkpoints: HF safetensors streamed into our Llama (logits equal HF's; the per-tensor mapping equals
`from_hf_state_dict`; truncation; errors), and DCP save/load, including an FSDP2 resume on 2 gloo ranks
that continues bit for bit. Run as a script (by torchrun) this file is the FSDP2 worker."""

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import free_port, random_hf_llama, require, small_llama
from forked import run_ranks

from timetotrain.errors import UserError
from timetotrain.models.llama import Llama, LlamaConfig
from timetotrain.models.llama.hf import from_hf_state_dict, hf_mapping
from timetotrain.suite.llama31_8b import TINY
from timetotrain.train import checkpoint as ckpt
from timetotrain.train.checkpoint import load_checkpoint, load_hf_checkpoint, save_checkpoint
from timetotrain.train.optim import build_adamw

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

CFG = small_llama(rope_scaling=TINY.model.rope_scaling)  # Llama 3.1 RoPE scaling active


def _tokens(seed: int, shape=(2, CFG.max_seq_len)) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _meta_llama(cfg: LlamaConfig = CFG) -> Llama:
    with torch.device("meta"):
        model = Llama(cfg)
    return model.to_empty(device="cpu")


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_llama(CFG)


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(out, safe_serialization=True, max_shard_size=300_000)
    return out


def test_sharded_hf_checkpoint_gives_hf_logits(hf_model, hf_dir):
    index = json.loads((hf_dir / ckpt.HF_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert all((hf_dir / s).is_file() for s in shards)

    model = _meta_llama()
    report = load_hf_checkpoint(model, hf_dir, hf_mapping(CFG))
    assert sorted(report.loaded) == sorted(n for n, _ in model.named_parameters())
    assert report.ignored == []
    # Streaming: never more HF tensors in hand than the largest shard holds.
    assert report.peak_held_bytes <= max((hf_dir / s).stat().st_size for s in shards)
    tokens = _tokens(1)
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(input_ids=tokens).logits
    assert ours.abs().max() > 0.5
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_mapping_equals_from_hf_state_dict(hf_model, hf_dir):
    hf_sd = hf_model.state_dict()
    whole = from_hf_state_dict(hf_sd, CFG)
    mapping = hf_mapping(CFG)
    assert mapping.keys() == whole.keys()
    for name, src in mapping.items():
        assert torch.equal(src.combine([hf_sd[n] for n in src.hf_names]), whole[name]), name
    model = _meta_llama()
    load_hf_checkpoint(model, hf_dir, mapping)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[n], whole[n]) for n in whole)


def test_truncate_rows(hf_model, hf_dir):
    small = replace(CFG, vocab_size=100)
    model = _meta_llama(small)
    rows = {"embed.weight": 100, "head.weight": 100}
    load_hf_checkpoint(model, hf_dir, hf_mapping(small), truncate_rows=rows)
    assert torch.equal(model.embed.weight, hf_model.model.embed_tokens.weight[:100])
    assert torch.equal(model.head.weight, hf_model.lm_head.weight[:100])
    with pytest.raises(UserError, match=r"embed\.weight expects shape \[100, 64\] but .* give \[256, 64\]"):
        load_hf_checkpoint(_meta_llama(small), hf_dir, hf_mapping(small))
    with pytest.raises(
        UserError, match=r"truncate_rows\[embed\.weight\]=300 but the checkpoint has 256 rows"
    ):
        load_hf_checkpoint(_meta_llama(), hf_dir, hf_mapping(CFG), truncate_rows={"embed.weight": 300})


def test_inputs_split_across_shards_single_file_and_extras(hf_model, tmp_path):
    """q/gate in one shard, k/v/up in the other: a parameter is held open across shards, then freed.
    Also the single-file layout, extra tensors (ignored, counted) and a bf16 checkpoint cast to fp32."""
    safetensors = require("safetensors.torch")
    hf_sd = {n: t.to(torch.bfloat16) for n, t in hf_model.state_dict().items()}
    first = {n: t for n, t in hf_sd.items() if "q_proj" in n or "gate_proj" in n}
    second = {n: t for n, t in hf_sd.items() if n not in first} | {"model.extra.bias": torch.zeros(3)}
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    sharded.mkdir(), single.mkdir()
    weight_map = {}
    for i, part in enumerate((first, second), 1):
        name = f"model-0000{i}-of-00002.safetensors"
        safetensors.save_file(part, sharded / name)
        weight_map |= dict.fromkeys(part, name)
    (sharded / ckpt.HF_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    safetensors.save_file(hf_sd | {"model.extra.bias": torch.zeros(3)}, single / ckpt.HF_SINGLE)

    expected = {n: t.float() for n, t in from_hf_state_dict(hf_sd, CFG).items()}
    peaks = []
    for folder in (sharded, single):
        model = _meta_llama()
        report = load_hf_checkpoint(model, folder, hf_mapping(CFG))
        assert report.ignored == ["model.extra.bias"]
        assert all(torch.equal(model.state_dict()[n], expected[n]) for n in expected)
        peaks.append(report.peak_held_bytes)
    # Sharded: the first shard's q/gate wait for the second shard, plus the tensor being read; never all.
    assert peaks[0] <= sum(t.nbytes for t in first.values()) + max(t.nbytes for t in second.values())
    assert peaks[1] == max(t.nbytes for t in hf_sd.values())  # single file: each tensor used when read


def test_hf_errors_name_the_file(hf_dir, tmp_path):
    mapping = hf_mapping(CFG)
    with pytest.raises(UserError, match="no such checkpoint folder"):
        load_hf_checkpoint(_meta_llama(), tmp_path / "nowhere", mapping)
    with pytest.raises(UserError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_hf_checkpoint(_meta_llama(), tmp_path, mapping)
    with torch.device("meta"):
        with pytest.raises(UserError, match="is on the meta device; call model.to_empty"):
            load_hf_checkpoint(Llama(CFG), hf_dir, mapping)

    one_kv = replace(CFG, n_kv_heads=1)  # k_proj/v_proj have twice the rows this config expects
    with pytest.raises(
        UserError, match=r"cannot build layers\.0\.attn\.qkv\.weight from .*k_proj.* \[\[64, 64\], \[32, 64\]"
    ):
        load_hf_checkpoint(_meta_llama(one_kv), hf_dir, hf_mapping(one_kv))

    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match=r"model-00002-of-00002\.safetensors: shard listed in .* is missing"):
        load_hf_checkpoint(_meta_llama(), broken, mapping)

    def edit_index(change) -> Path:
        folder = tmp_path / f"edited{len(list(tmp_path.iterdir()))}"
        shutil.copytree(hf_dir, folder)
        index = json.loads((folder / ckpt.HF_INDEX).read_text())
        change(index["weight_map"])
        (folder / ckpt.HF_INDEX).write_text(json.dumps(index))
        return folder

    missing = edit_index(lambda wm: wm.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        UserError, match=r"index\.json: tensor model\.layers\.1\.self_attn\.k_proj\.weight .* missing"
    ):
        load_hf_checkpoint(_meta_llama(), missing, mapping)

    def misplace(wm):  # the index points lm_head at a shard that does not hold it
        wm["lm_head.weight"] = next(s for s in sorted(set(wm.values())) if s != wm["lm_head.weight"])

    with pytest.raises(
        UserError, match=r"safetensors: tensor lm_head\.weight listed in .* is not in this shard"
    ):
        load_hf_checkpoint(_meta_llama(), edit_index(misplace), mapping)


def test_names_load_a_base_into_an_adapted_model(hf_dir, tmp_path):
    """LoRA applied before loading (as the sharded build must): `lora.base_names` reads `...qkv.base.weight`
    from the checkpoint's `...qkv.weight` and leaves the adapters alone, from HF and from a ttt checkpoint
    (which also casts into a bf16 base)."""
    from timetotrain.models.common.lora import apply_lora, base_names, lora_state_dict

    plain = _meta_llama()
    load_hf_checkpoint(plain, hf_dir, hf_mapping(CFG))
    save_checkpoint(tmp_path / "ttt", plain, None, step=0)
    for source, base_dtype in ((hf_dir, None), (tmp_path / "ttt", torch.bfloat16)):
        adapted = apply_lora(_meta_llama(), generator=torch.Generator().manual_seed(1), base_dtype=base_dtype)
        adapters = {n: t.clone() for n, t in lora_state_dict(adapted).items()}
        names = base_names(adapted)
        assert names["layers.1.attn.proj.base.weight"] == "layers.1.attn.proj.weight"
        assert names["layers.1.attn.proj.lora_B.weight"] is None
        assert "layers.1.ffn.fc1.weight" not in names  # unchanged names are not listed
        if source == hf_dir:
            report = load_hf_checkpoint(adapted, source, hf_mapping(CFG), names=names)
            assert sorted(report.loaded) == sorted(plain.state_dict())
        else:
            load_checkpoint(source, adapted, None, names=names)
        loaded = {names.get(n, n): t for n, t in adapted.state_dict().items()}
        for n, t in plain.state_dict().items():
            assert torch.equal(loaded[n], t.to(loaded[n].dtype)), n
        assert loaded["layers.0.attn.qkv.weight"].dtype == (base_dtype or torch.float32)
        assert all(torch.equal(t, adapters[n]) for n, t in lora_state_dict(adapted).items())
    with pytest.raises(UserError, match="model parameters without a source"):
        load_hf_checkpoint(apply_lora(_meta_llama()), hf_dir, hf_mapping(CFG))  # without names


# --- our own checkpoints ------------------------------------------------------------------------------


def _train_step(model, opt, tokens) -> torch.Tensor:
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _build(cfg: LlamaConfig, seed: int, shard: bool = False):
    torch.manual_seed(seed)
    model = Llama(cfg)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    return model, build_adamw(model, 1e-3, (0.9, 0.95), 1e-5, 0.1, fused=False)


def test_single_process_save_load_and_atomicity(tmp_path, monkeypatch):
    model, opt = _build(CFG, 0)
    _train_step(model, opt, _tokens(0))
    path = tmp_path / "step1"
    save_checkpoint(path, model, opt, step=1, extra={"samples": 2})
    save_checkpoint(path, model, opt, step=1, extra={"samples": 2})  # replacing an existing one works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1"]

    fresh, fresh_opt = _build(CFG, 1)
    assert load_checkpoint(path, fresh, fresh_opt) == (1, {"samples": 2})
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    tokens = _tokens(5)
    assert torch.equal(_train_step(model, opt, tokens), _train_step(fresh, fresh_opt, tokens))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))

    other, other_opt = _build(replace(CFG, ffn_dim=96), 0)
    with pytest.raises(UserError, match=r"ffn\.fc1\.weight is \[256, 64\] in the checkpoint but \[192, 64\]"):
        load_checkpoint(path, other, other_opt)
    model_only = tmp_path / "model_only"
    save_checkpoint(model_only, model, None, step=3)
    with pytest.raises(UserError, match="no optimizer state; load it with optimizer=None"):
        load_checkpoint(model_only, fresh, fresh_opt)
    assert load_checkpoint(model_only, fresh, None) == (3, {})
    # The metadata is untrusted: a malformed record of stacked (TP) row layouts is one line.
    meta = model_only / ckpt.META
    meta.write_text(json.dumps({"step": 3, "extra": {}, "stacked": {"layers.0.ffn.fc1.weight": "tp=2"}}))
    with pytest.raises(UserError, match="'stacked' is not a map of names to \\[parts, tp\\]"):
        load_checkpoint(model_only, fresh, None)
    # Rows saved stacked for tp=2 are not put back into optimizer moments (a resume reads its own layout).
    with pytest.raises(UserError, match="saved with its rows stacked for tp=2 and is read here for tp=1"):
        ckpt._restacking(
            path, dict(fresh.named_parameters()), {}, {"layers.0.ffn.fc1.weight": (2, 2)}, {}, True
        )

    # A crash after the shards are written but before the rename leaves only the .partial folder.
    real_save = ckpt.dcp.save

    def crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise OSError("killed")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path / "step2", model, opt, step=2)
    assert not (tmp_path / "step2").exists()
    with pytest.raises(UserError, match=r"not a complete checkpoint .*step2\.partial exists"):
        load_checkpoint(tmp_path / "step2", fresh, fresh_opt)


@pytest.mark.slow
def test_fsdp2_resume_is_bit_exact(tmp_path):
    run_ranks(__file__, [str(tmp_path)], 2, free_port())
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["resumed_at"] == [2, {"samples": 8}]
    assert len(out["a"]) == 5 and out["b"][:2] == out["a"][:2]
    assert out["b"][2:] == out["a"][2:]  # steps 3, 4, 5 after the resume: bit for bit
    assert out["a"][4] < out["a"][0]  # it did train
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "result.json"]  # no .partial left
    # One file per rank, each about half of the state: nothing was gathered onto one rank.
    shards = sorted((tmp_path / "ckpt").glob("*.distcp"))
    assert len(shards) == 2
    sizes = [p.stat().st_size for p in shards]
    assert max(sizes) < 1.2 * min(sizes)
    assert "layers.0.ffn.fc1.weight is [256, 64] in the checkpoint but [192, 64]" in out["shape_error"]


def _worker(out: Path) -> None:
    """One rank of `test_fsdp2_resume_is_bit_exact`: run A trains 5 steps; run B trains 2, saves, and a
    fresh FSDP2 model and optimizer (another init seed) load the checkpoint and train steps 3-5."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [_tokens(100 + s, (4, 33)).chunk(world)[rank] for s in range(5)]  # this rank's half

    def train(model, opt, steps) -> list[float]:
        losses = []
        for s in steps:
            loss = _train_step(model, opt, batches[s - 1])
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        return losses

    a = train(*_build(CFG, 0, shard=True), range(1, 6))
    model, opt = _build(CFG, 0, shard=True)
    b = train(model, opt, range(1, 3))
    save_checkpoint(out / "ckpt", model, opt, step=2, extra={"samples": 8})
    model, opt = _build(CFG, 1, shard=True)
    step, extra = load_checkpoint(out / "ckpt", model, opt)
    b += train(model, opt, range(step + 1, 6))

    other, other_opt = _build(replace(CFG, ffn_dim=96), 0, shard=True)
    try:
        load_checkpoint(out / "ckpt", other, other_opt)
        shape_error = ""
    except UserError as exc:
        shape_error = str(exc)
    if rank == 0:
        result = {"a": a, "b": b, "resumed_at": [step, extra], "shape_error": shape_error}
        (out / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
