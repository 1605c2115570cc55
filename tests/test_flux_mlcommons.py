"""flux1: importing MLCommons' preprocessed encodings (data/flux_mlcommons.py) from small files written in
exactly that layout: `datasets.Dataset.save_to_disk` folders (the download) and the per-rank Parquet files
they are made from, every cell the `np.save` bytes of a bfloat16 tensor's uint16 bits, as the reference's
preprocessing writes them. Checked: bit-exact values, keys and order (against `datasets.load_from_disk`),
stored eval timesteps driving the eval sampler, the empty encodings with their batch dim, and bad input."""

import dataclasses
import io
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import require

from timetotrain.data import flux_encodings as enc
from timetotrain.data import flux_mlcommons as mlc
from timetotrain.errors import UserError
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.tasks import rectified_flow as rf

SHAPES = enc.Shapes(t5=(8, 32), clip=(16,), latent=(4, 8, 8))
BENCH = get("flux1")
SCHEMA = pa.schema(
    [("__key__", pa.string())] + [(c, pa.binary()) for c in mlc.COLUMNS.values()] + [("timestep", pa.int32())]
)
# Edge bit patterns the import must keep exactly: the largest finite bf16, its negative, -0, a subnormal.
# (NaN and inf are refused when a run opens the data: tests/test_bad_input.py [flux1-nan-encodings].)
SPECIAL = np.array([0x7F7F, 0xFF7F, 0x8000, 0x0001], np.uint16)


def blob(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def make(n, shapes=SHAPES, seed=0, timesteps=None, prefix="cc"):
    """`n` samples as the reference stores them: per field `tensor.to(bfloat16).view(uint16).numpy()` (the
    first T5 row starts with SPECIAL's edge values), `np.save`d into each cell. Returns the keys,
    the stored bits per field `[n, ...]` and the columns."""
    g = torch.Generator().manual_seed(seed)
    keys = [f"{prefix}{seed}_{i:05d}" for i in range(n)]
    bits = {
        f: (torch.randn(n, *shapes.of(f), generator=g) * 3).to(torch.bfloat16).view(torch.uint16).numpy()
        for f in enc.FIELDS
    }
    bits["t5"][0, 0, :4] = SPECIAL
    cols = {"__key__": keys, **{c: [blob(a) for a in bits[f]] for f, c in mlc.COLUMNS.items()}}
    cols["timestep"] = list(timesteps) if timesteps is not None else [None] * n
    return keys, bits, cols


def save_to_disk(path, cols, num_shards=1):
    """The download's layout, written by `datasets` itself."""
    datasets = require("datasets")
    datasets.disable_progress_bars()
    value = datasets.Value
    features = datasets.Features(
        {
            "__key__": value("string"),
            **{c: value("binary") for c in mlc.COLUMNS.values()},
            "timestep": value("int32"),
        }
    )
    datasets.Dataset.from_dict(cols, features=features).save_to_disk(str(path), num_shards=num_shards)
    return path


def write_parquet(path, cols, schema=SCHEMA):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols, schema=schema), path)
    return path


def sliced(cols, start, stop):
    return {k: v[start:stop] for k, v in cols.items()}


def imported(src, out, split="train", shapes=SHAPES):
    parts = mlc.find_sources(str(src))
    assert parts is not None
    info = mlc.import_split(parts, split, shapes, out)
    return info, enc.EncodedSplit(out, split, shapes)


def assert_bits(split, bits):
    for f in enc.FIELDS:
        assert split.arrays[f].dtype == np.uint16 and np.array_equal(split.arrays[f], bits[f]), f
    # and the fp32 the training loop sees is the bfloat16 value of those bits
    rows = split.rows(np.arange(split.n))
    want = torch.from_numpy(bits["t5"]).view(torch.bfloat16).float()
    assert torch.equal(rows["t5"].view(torch.int32), want.view(torch.int32))  # -0 and the subnormal included


def test_save_to_disk_import_is_bit_exact_and_keeps_order(tmp_path):
    keys, bits, cols = make(10)
    src = save_to_disk(tmp_path / "cc12m_preprocessed", cols, num_shards=2)
    assert sorted(p.name for p in src.iterdir()) == [
        "data-00000-of-00002.arrow", "data-00001-of-00002.arrow", "dataset_info.json", "state.json",
    ]  # fmt: skip
    info, split = imported(src, tmp_path / "out")
    assert info["samples"] == 10 and info["files"] == 2 and info["timesteps"] is None
    datasets = require("datasets")
    assert split.keys == keys == datasets.load_from_disk(str(src))["__key__"]
    assert_bits(split, bits)
    assert split.timesteps is None and not (tmp_path / "out" / "train" / enc.TIMESTEP_FILE).exists()
    man = json.loads((tmp_path / "out" / "train" / "manifest.json").read_text())
    assert man["source_format"] == "mlcommons-preprocessed" and man["samples"] == 10
    assert man["fields"]["vae_mean"] == {"shape": [4, 8, 8], "dtype": "bfloat16"}
    assert not [p for p in (tmp_path / "out" / "train").iterdir() if p.name.startswith(".")]  # no temporaries


def test_parquet_files_and_a_folder_of_datasets(tmp_path):
    """The per-rank Parquet files, the save_to_disk that `Dataset.from_parquet` of their glob makes (as the
    reference does), and a folder of two save_to_disk datasets: the same samples in the same order."""
    datasets = require("datasets")
    keys, bits, cols = make(12, timesteps=[i % 8 for i in range(12)])
    pq_dir = tmp_path / "tmp"
    for name, (a, b) in {"data_0_0000": (0, 5), "data_10_0000": (5, 8), "data_2_0000": (8, 12)}.items():
        write_parquet(pq_dir / f"{name}.parquet", sliced(cols, a, b))
    saved = tmp_path / "coco_preprocessed"
    datasets.Dataset.from_parquet(str(pq_dir / "*.parquet"), cache_dir=str(tmp_path / "cache")).save_to_disk(
        str(saved)
    )
    several = tmp_path / "several"
    save_to_disk(several / "part_b", sliced(cols, 6, 12))
    save_to_disk(several / "part_a", sliced(cols, 0, 6))
    for n, src in enumerate((pq_dir, saved, several, pq_dir / "data_0_0000.parquet")):
        info, split = imported(src, tmp_path / f"out{n}", "validation")
        m = 5 if src.suffix == ".parquet" else 12
        assert split.keys == keys[:m], src
        assert_bits(split, {f: b[:m] for f, b in bits.items()})
        assert split.timesteps.tolist() == [i % 8 for i in range(m)]
    assert datasets.load_from_disk(str(saved))["__key__"] == keys
    # comma-separated --src parts are read in the order given
    parts = mlc.find_sources(f"{several / 'part_b'},{several / 'part_a'}")
    mlc.import_split(parts, "train", SHAPES, tmp_path / "swapped")
    assert enc.EncodedSplit(tmp_path / "swapped", "train", SHAPES).keys == keys[6:] + keys[:6]


def test_what_is_not_the_mlcommons_layout(tmp_path):
    (tmp_path / "tars").mkdir()
    (tmp_path / "tars" / "a.tar").write_bytes(b"")
    assert mlc.find_sources(str(tmp_path / "tars")) is None
    assert mlc.find_sources(str(tmp_path / "nothing")) is None
    write_parquet(tmp_path / "pq" / "data_0_0000.parquet", make(2)[2])
    with pytest.raises(UserError, match=r"tars is not MLCommons' preprocessed encodings"):
        mlc.find_sources(f"{tmp_path / 'pq'},{tmp_path / 'tars'}")
    # the download's root holds training and validation: refused, not imported as one split
    root = tmp_path / "download"
    for name in ("cc12m_preprocessed", "coco_preprocessed"):
        save_to_disk(root / name, make(2)[2])
    with pytest.raises(UserError, match=r"both cc12m_preprocessed/ \(training\) and coco_preprocessed/"):
        mlc.find_sources(str(root))


def tier_for(n_val, eval_repeats=1):
    tiny = BENCH.tier("tiny")
    cfg = dataclasses.replace(
        tiny.model, dim=32, n_heads=2, axes_dim=(4, 6, 6), latent_channels=4, latent_size=8, txt_len=8,
        txt_dim=32, vec_dim=16,
    )  # fmt: skip
    assert rf.shapes_of(cfg) == SHAPES
    # MLCommons' files come from the real encoders: the tier names none (tiny's own wants its stand-ins)
    data = dataclasses.replace(
        tiny.data, eval_repeats=eval_repeats, eval_batch=4, encoders=None, tokenizer=None
    )
    return dataclasses.replace(tiny, model=cfg, data=data, eval_samples=n_val * eval_repeats)


def test_stored_timesteps_drive_the_eval_and_empty_encodings_keep_their_batch_dim(tmp_path):
    stored = [3, 1, 4, 1, 5, 0, 2, 6, 7, 7]  # not i mod 8
    _, _, val = make(10, seed=1, timesteps=stored, prefix="coco")
    _, _, train = make(6, seed=2)
    root = tmp_path / "data"
    empty = tmp_path / "dl" / "empty_encodings"  # MLCommons': float32, leading batch dim of 1
    empty.mkdir(parents=True)
    t5_empty = np.random.default_rng(0).standard_normal((1, *SHAPES.t5)).astype(np.float32)
    np.save(empty / "t5_empty.npy", t5_empty)
    np.save(empty / "clip_empty.npy", np.zeros((1, *SHAPES.clip), np.float32))
    src = save_to_disk(tmp_path / "dl" / "coco_preprocessed", val)
    assert mlc.find_empty(str(src), None) == empty  # found beside --src
    assert mlc.import_empty(empty, SHAPES, root) == "float32"
    info, _ = imported(src, root, "validation")
    imported(save_to_disk(tmp_path / "dl" / "cc12m_preprocessed", train), root, "train")
    ts = info["timesteps"]
    assert ts["counts"] == [1, 2, 1, 1, 1, 1, 1, 2] and ts["equal_to_index_mod_divisor"] is False
    assert np.load(root / "validation" / "timestep.npy").tolist() == stored

    tier = tier_for(10)
    resolved = BENCH.task.resolve(tier, root)
    assert torch.equal(resolved.empty[0], torch.from_numpy(t5_empty[0]))  # stored without the batch dim
    assert np.load(root / "empty_encodings" / "t5_empty.npy").shape == SHAPES.t5
    data = BENCH.task.open(tier, resolved, 0, Share.of(tier.global_batch_size), torch.device("cpu"))
    t = torch.cat([data.eval_chunk(c)["t"] for c in range(3)])
    assert t.tolist() == [s / 8 for s in stored]
    with pytest.raises(UserError, match=r"fixes one eval timestep per sample .* evaluates each sample at 8"):
        BENCH.task.resolve(tier_for(10, eval_repeats=8), root)

    # stored timesteps equal to i mod 8 give exactly what the sampler computes without them
    _, _, val = make(10, seed=1, timesteps=[i % 8 for i in range(10)], prefix="coco")
    info, _ = imported(save_to_disk(tmp_path / "modulo", val), root, "validation")
    assert info["timesteps"]["equal_to_index_mod_divisor"] is True
    data = BENCH.task.open(
        tier, BENCH.task.resolve(tier, root), 0, Share.of(tier.global_batch_size), torch.device("cpu")
    )
    assert torch.equal(data.eval_chunk(1)["t"], rf.eval_timesteps(torch.arange(4, 8)))

    # MLCommons' empty encodings read directly (no dtype.txt, batch dim kept) give the same tensors
    direct = tmp_path / "direct"
    (direct / "empty_encodings").mkdir(parents=True)
    for name in ("t5_empty.npy", "clip_empty.npy"):
        (direct / "empty_encodings" / name).write_bytes((empty / name).read_bytes())
    assert torch.equal(enc.read_empty(direct, SHAPES)[0], resolved.empty[0])
    np.save(empty / "clip_empty.npy", np.zeros((1, 17), np.float32))
    with pytest.raises(UserError, match=r"empty-prompt encodings \[8, 32\], \[17\]; this tier needs"):
        mlc.import_empty(empty, SHAPES, root)
    np.save(empty / "clip_empty.npy", np.zeros((1, 16), np.uint16))
    with pytest.raises(UserError, match=r"dtype float32, uint16 and no dtype.txt"):
        mlc.import_empty(empty, SHAPES, root)


def corrupt(cols, i, col, value):
    cols = {k: list(v) for k, v in cols.items()}
    cols[col][i] = value
    return cols


BAD = [  # (change to sample 3, message)
    (
        ("t5_encodings", blob(np.zeros((8, 16), np.uint16))),
        r"t5_encodings is \[8, 16\] uint16, expected \[8, 32\]",
    ),
    (
        ("clip_encodings", blob(np.zeros(16, np.float32))),
        r"clip_encodings is \[16\] float32, expected \[16\] uint16",
    ),
    (("mean", b"\x93NUMPY garbage"), r"mean is not an np\.save array"),
    (
        ("logvar", blob(np.zeros((4, 8, 8), np.uint16))[:-2]),
        r"logvar is not an np\.save array \(510 data bytes",
    ),
    (("logvar", None), r"logvar is null"),
    (("timestep", 9), r"timestep 9 is outside 0\.\.7"),
    (("timestep", 2), r"'cc0_00000' has no timestep while 'cc0_00003'"),
    (("__key__", "cc0 00003"), r"sample key 'cc0 00003' \(after 'cc0_00002'\) is empty or has whitespace"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[b[0][0] + str(i) for i, b in enumerate(BAD)])
def test_bad_cells_name_the_file_and_the_sample(tmp_path, change, message):
    _, _, cols = make(6)
    src = save_to_disk(tmp_path / "src", corrupt(cols, 3, *change))
    with pytest.raises(UserError, match=message) as e:
        imported(src, tmp_path / "out")
    text = str(e.value)
    assert "\n" not in text and "data-00000-of-00001.arrow" in text and ("'cc0_0000" in text), text
    assert not (tmp_path / "out" / "train").exists() or not list((tmp_path / "out" / "train").iterdir())


def test_missing_column_and_unreadable_file(tmp_path):
    _, _, cols = make(2)
    del cols["logvar"]
    schema = pa.schema([f for f in SCHEMA if f.name != "logvar"])
    src = write_parquet(tmp_path / "pq" / "data_0_0000.parquet", cols, schema)
    with pytest.raises(UserError, match=r"data_0_0000\.parquet: no column 'logvar' \(it has __key__, "):
        imported(src, tmp_path / "out")
    bad = tmp_path / "pq2" / "data_0_0000.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match=r"data_0_0000\.parquet: not a Parquet file"):
        imported(bad, tmp_path / "out")


def test_cli_import(tmp_path, capsys):
    from timetotrain.cli import main

    tiny = BENCH.tier("tiny")
    shapes = rf.shapes_of(tiny.model)
    keys, bits, cols = make(4, shapes=shapes, timesteps=[0, 1, 2, 3], prefix="coco")
    src = save_to_disk(tmp_path / "dl" / "coco_preprocessed", cols)
    base = [
        "data",
        "prepare",
        "flux",
        "--src",
        str(src),
        "--split",
        "validation",
        "--out",
        str(tmp_path / "o"),
    ]
    errors = [
        ([], "no empty_encodings/ beside it: pass --empty-encodings DIR"),
        (["--encoders", "standin"], "is already encoded (MLCommons' preprocessed layout): drop --encoders"),
        (["--tier", "tiny", "--empty-encodings", str(tmp_path / "none")], "--empty-encodings"),
    ]
    for extra, message in errors:
        assert main([*base, *extra]) != 0
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    empty = tmp_path / "dl" / "empty_encodings"
    empty.mkdir()
    np.save(empty / "t5_empty.npy", np.zeros((1, *shapes.t5), np.float32))
    np.save(empty / "clip_empty.npy", np.zeros((1, *shapes.clip), np.float32))
    assert main([*base, "--tier", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert (
        "flux validation: 4 samples imported bit for bit from 1 MLCommons file(s) (tier tiny shapes)" in out
    )
    assert "stored eval timesteps [1, 1, 1, 1, 0, 0, 0, 0] per value, equal to i mod 8" in out
    assert "flux import validation:" in err  # the progress line
    split = enc.EncodedSplit(tmp_path / "o", "validation", shapes)
    assert split.keys == keys and np.array_equal(split.arrays["t5"], bits["t5"])
    # at the reference tier's shapes (the default), the same files are refused, naming the first sample
    shutil.rmtree(empty)  # (the empty encodings imported above stay in --out)
    assert main(base) != 0
    assert (
        "sample 'coco0_00000': t5_encodings is [32, 64] uint16, expected [256, 4096]"
        in capsys.readouterr().err
    )
