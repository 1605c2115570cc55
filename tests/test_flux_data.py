"""flux1 data: the WebDataset reader, `ttt data prepare flux` with the stand-in encoders on the shared
fixtures and with the real encoder classes (tiny random configs saved locally), the encoded layout's reader,
and bad input."""

import io
import json
import tarfile
import warnings

import numpy as np
import pytest
import torch
from conftest import require, require_file, shared_data_dir

from timetotrain.data import flux_encoders, flux_prepare
from timetotrain.data import flux_encodings as enc
from timetotrain.data.webdataset import Skips, read_pairs
from timetotrain.errors import UserError
from timetotrain.spec.registry import get
from timetotrain.tasks.rectified_flow import shapes_of

pytestmark = pytest.mark.parity

CC12M = shared_data_dir() / "cc12m" / "cc12m-train-0000.tar"
COCO = shared_data_dir() / "coco_mini" / "coco-captions-mini-0000.tar"
LLAMA2_SP = shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model"
TINY = get("flux1").tier("tiny")


def small_tar(path, n=3, drop=(), corrupt=()):
    """The first `n` CC12M samples re-packed; `drop` = (key, ext) members left out, `corrupt` = keys whose
    jpg is cut to half its bytes."""
    src = require_file(CC12M)
    keys = []
    with tarfile.open(src) as tin, tarfile.open(path, "w") as tout:
        for m in tin:
            key, ext = m.name.split(".", 1)
            if key not in keys:
                if len(keys) == n:
                    break
                keys.append(key)
            if (key, ext) in drop:
                continue
            data = tin.extractfile(m).read()
            if key in corrupt and ext == "jpg":
                data = data[: len(data) // 2]
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
    return path, keys


def standin(shapes=None):
    return flux_encoders.StandInEncoders(shapes or shapes_of(TINY.model), require_file(LLAMA2_SP))


def test_reader_pairs_in_order():
    pairs = list(read_pairs([require_file(CC12M)]))
    assert len(pairs) == 32
    assert pairs[0].key == "000000003" and pairs[0].caption and pairs[0].image.size == (512, 512)


def test_standin_prepare_of_the_fixtures(tmp_path, capsys):
    out = tmp_path / "enc"
    info = flux_prepare.prepare([require_file(COCO)], "validation", standin(), out, select="tiny")
    assert info["samples"] == 51 and info["skips"].count == 0
    # Into a pipe the last line says what was written (it said "16 samples encoded", the first batch).
    assert capsys.readouterr().err.splitlines()[-1] == "flux validation: 51 samples encoded, 0 skipped"
    info = flux_prepare.prepare([require_file(CC12M), COCO], "train", standin(), out, select="tiny")
    assert info["samples"] == 82  # 32 CC12M + 50 COCO train2017
    shapes = shapes_of(TINY.model)
    with warnings.catch_warnings():  # torch's "not writable" warning reached every run's stderr
        warnings.simplefilter("error")
        split = enc.EncodedSplit(out, "train", shapes)
    assert split.keys[:2] == ["000000003", "000000004"] and split.keys[-1].startswith("0000")
    assert split.arrays["vae_mean"].dtype == np.uint16 and split.dtypes["vae_mean"] == "bfloat16"
    man = json.loads((out / "train" / "manifest.json").read_text())
    assert man["fields"]["t5"] == {"shape": [32, 64], "dtype": "bfloat16"} and man["encoders"] == "standin"
    rows = split.rows(np.array([0, 1]))
    assert rows["vae_logvar"].unique().tolist() == [pytest.approx(flux_encoders.STANDIN_LOGVAR, rel=1e-2)]
    assert rows["t5"][0].abs().sum() > 0 and not torch.equal(rows["t5"][0], rows["t5"][1])
    t5_empty, clip_empty = enc.read_empty(out, shapes)
    assert t5_empty.abs().sum() == 0 and clip_empty.abs().sum() == 0
    # deterministic: fresh encoders give the same bits
    tar, _ = small_tar(tmp_path / "s.tar", n=2)
    flux_prepare.prepare([tar], "train", standin(), tmp_path / "again")
    for f in enc.FIELDS:
        a = np.load(out / "train" / f"{f}.npy")[:2]
        assert np.array_equal(a, np.load(tmp_path / "again" / "train" / f"{f}.npy")), f


def test_corrupt_jpg_is_skipped_and_counted(tmp_path):
    tar, keys = small_tar(tmp_path / "bad.tar", corrupt={"000000004"})
    skips = Skips()
    got = [p.key for p in read_pairs([tar], skips)]
    assert "000000004" in keys and "000000004" not in got and len(got) == 2
    assert skips.count == 1 and "000000004" in skips.report()


def test_tar_missing_txt_names_the_sample(tmp_path):
    tar, _ = small_tar(tmp_path / "bad.tar", drop={("000000004", "txt")})
    with pytest.raises(UserError, match=r"bad\.tar: sample '000000004' has no caption \(\.txt\)"):
        list(read_pairs([tar]))


def test_wrong_shape_encodings_name_the_sample(tmp_path):
    tar, _ = small_tar(tmp_path / "s.tar")

    class Wrong:  # encoders that produce other latents than the tier's
        name, shapes = "wrong", shapes_of(TINY.model)
        inner = standin(enc.Shapes((32, 64), (64,), (16, 8, 8)))
        images, texts, identity = inner.images, inner.texts, inner.identity

    wrong = Wrong()
    with pytest.raises(UserError, match=r"sample '000000003': vae_mean encoding has shape \[16, 8, 8\]"):
        flux_prepare.prepare([tar], "train", wrong, tmp_path / "out")
    # a dataset prepared for other shapes: the reader names the file and its first sample
    flux_prepare.prepare([tar], "train", standin(enc.Shapes((32, 64), (64,), (16, 8, 8))), tmp_path / "o")
    with pytest.raises(UserError, match=r"vae_mean\.npy: encodings of shape \[3, 16, 8, 8\].*'000000003'"):
        enc.EncodedSplit(tmp_path / "o", "train", shapes_of(TINY.model))


def _save_real_encoders(folder, shapes):
    """Tiny random-config T5EncoderModel, CLIPTextModel and AutoencoderKL, with a word-level tokenizer,
    saved as `save_pretrained` writes them."""
    transformers = require("transformers")
    diffusers = require("diffusers")
    tokenizers = require("tokenizers")
    words = ["<pad>", "</s>", "<unk>"] + sorted(
        {w for w in "a photo of the dog cat on red car man with".split()}
    )
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    L, d_t5 = shapes.t5
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=len(words), d_model=d_t5, d_kv=4, num_heads=2, num_layers=1, d_ff=32)
    )
    clip = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=len(words), hidden_size=shapes.clip[0], intermediate_size=24, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=16, eos_token_id=1, pad_token_id=0,
        )
    )  # fmt: skip
    vae = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 8),
        latent_channels=shapes.latent[0], norm_num_groups=4, layers_per_block=1, sample_size=8,
    )  # fmt: skip
    for name, model in (("t5", t5), ("clip", clip), ("vae", vae)):
        model.save_pretrained(folder / name)
    fast.save_pretrained(folder / "t5")
    fast.save_pretrained(folder / "clip")
    return vae


def test_real_encoder_classes(tmp_path):
    shapes = enc.Shapes(t5=(8, 16), clip=(12,), latent=(4, 4, 4))
    vae = _save_real_encoders(tmp_path / "encoders", shapes)
    encoders = flux_encoders.RealEncoders(tmp_path / "encoders", shapes)
    tar, keys = small_tar(tmp_path / "s.tar", n=2)
    flux_prepare.prepare([tar], "train", encoders, tmp_path / "out")
    split = enc.EncodedSplit(tmp_path / "out", "train", shapes)
    assert split.keys == keys
    rows = split.rows(np.array([0, 1]))
    pairs = list(read_pairs([tar]))
    with torch.no_grad():  # the VAE posterior of the image at 8 x 8 (the VAE downsamples by 2 here)
        want = vae.eval().encode(flux_encoders._pixels([pairs[0].image], 8)).latent_dist
    torch.testing.assert_close(rows["vae_mean"][0], want.mean[0].to(torch.bfloat16).float())
    torch.testing.assert_close(rows["vae_logvar"][0], want.logvar[0].to(torch.bfloat16).float())
    assert rows["t5"].shape == (2, 8, 16) and rows["clip"].abs().sum() > 0


def test_real_encoders_folder_checked(tmp_path):
    with pytest.raises(UserError, match="no t5/config.json"):
        flux_encoders.RealEncoders(tmp_path, shapes_of(TINY.model))


def test_cli_prepare_errors(tmp_path, capsys):
    from timetotrain.cli import main

    tar, _ = small_tar(tmp_path / "s.tar", drop={("000000004", "txt")})
    base = ["data", "prepare", "flux", "--split", "train", "--out", str(tmp_path / "o")]
    cases = [
        (["--src", str(tar)], "flux needs --encoders"),
        (["--src", str(tar), "--encoders", "standin"], "--encoders standin needs --tokenizer-model"),
        (["--src", str(tar), "--encoders", str(tmp_path)], "no t5/config.json"),
        (["--src", str(tmp_path / "none.tar"), "--encoders", "standin", "--tokenizer-model", str(LLAMA2_SP)],
         "none.tar does not exist"),
        (["--src", str(tar), "--encoders", "standin", "--tokenizer-model", str(LLAMA2_SP)],
         "sample '000000004' has no caption"),
    ]  # fmt: skip
    for extra, message in cases:
        assert main([*base, *extra]) != 0
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def _recaption(src, dst, key, caption: bytes):
    """`src` with the caption of sample `key` replaced by these bytes."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for m in tin:
            data = caption if m.name == f"{key}.txt" else tin.extractfile(m).read()
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
    return dst


def test_caption_not_utf8_is_kept_counted_and_named(tmp_path, capsys):
    from timetotrain.cli import main

    tar, _ = small_tar(tmp_path / "s.tar")
    bad = _recaption(tar, tmp_path / "latin1.tar", "000000004", "a caf\xe9 by the sea".encode("latin-1"))
    skips = Skips()
    pairs = {p.key: p.caption for p in read_pairs([bad], skips)}
    assert len(pairs) == 3 and pairs["000000004"] == "a caf\ufffd by the sea"
    assert skips.bad_utf8 == ["000000004"] and skips.count == 0
    assert skips.report() == "1 caption(s) not valid UTF-8, kept with U+FFFD for the bad bytes: 000000004"
    out = tmp_path / "out"
    argv = ["data", "prepare", "flux", "--src", str(bad), "--split", "train", "--encoders", "standin",
            "--tokenizer-model", str(require_file(LLAMA2_SP)), "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert (
        "1 caption(s) not valid UTF-8, kept with U+FFFD for the bad bytes: 000000004"
        in capsys.readouterr().out
    )
    assert json.loads((out / "train" / "manifest.json").read_text())["captions_not_utf8"] == ["000000004"]


def test_shards_without_samples_are_one_line_naming_them(tmp_path, capsys):
    from timetotrain.cli import main

    empty = tmp_path / "empty.tar"
    tarfile.open(empty, "w").close()
    argv = ["data", "prepare", "flux", "--src", str(empty), "--split", "train", "--encoders", "standin",
            "--tokenizer-model", str(require_file(LLAMA2_SP)), "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ttt: error: --src {empty}: no train samples found"), err
    assert not (tmp_path / "out" / "train").exists() or not any((tmp_path / "out" / "train").iterdir())


def test_sigterm_while_writing_removes_the_staged_split(tmp_path, capsys, monkeypatch):
    """`ttt data prepare flux` under SIGTERM: exit 128 + 15 with one line, and of the split whose files were
    being written, nothing: not the files renamed so far, not the temporaries."""
    import os
    import signal

    from timetotrain.cli import main

    def unhandled(signum, frame):  # without ttt's handler the default would end pytest itself
        raise AssertionError("SIGTERM reached no handler of ttt's")

    old = signal.signal(signal.SIGTERM, unhandled)
    real_save, saved = enc.npy.save, []

    def save_then_signal(f, a, *args, **kwargs):
        real_save(f, a, *args, **kwargs)
        saved.append(1)
        if len(saved) == 2:  # two of the four fields staged
            os.kill(os.getpid(), signal.SIGTERM)

    tar, _ = small_tar(tmp_path / "s.tar")
    out = tmp_path / "out"
    monkeypatch.setattr(enc.npy, "save", save_then_signal)
    argv = ["data", "prepare", "flux", "--src", str(tar), "--split", "train", "--encoders", "standin",
            "--tokenizer-model", str(require_file(LLAMA2_SP)), "--out", str(out)]  # fmt: skip
    try:
        code = main(argv)
    finally:
        signal.signal(signal.SIGTERM, old)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err  # the progress line may come first; then the one line of ttt's
    assert [ln for ln in err.splitlines() if ln.startswith("ttt:")] == [
        "ttt: interrupted by SIGTERM: stopped, temporary files removed"
    ], err
    assert len(saved) == 2
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == []


def test_sample_name_not_utf8_is_one_line_naming_the_tar(tmp_path):
    """A member name with a byte that is not UTF-8 (tarfile keeps it as a lone surrogate) would fail when
    keys.txt is written, after all the encoding work: it is named at once instead."""
    tar, keys = small_tar(tmp_path / "s.tar", n=2)
    bad = tmp_path / "latin1-names.tar"
    with tarfile.open(tar) as tin, tarfile.open(bad, "w", format=tarfile.GNU_FORMAT) as tout:
        for m in tin:
            data = tin.extractfile(m).read()
            name = m.name.replace(keys[1], keys[1] + b"-caf\xe9".decode("utf-8", "surrogateescape"))
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
    with pytest.raises(UserError) as e:
        list(read_pairs([bad]))
    msg = str(e.value)
    assert msg.startswith(f"{bad}: sample name b'{keys[1]}-caf\\xe9' is not valid UTF-8"), msg
