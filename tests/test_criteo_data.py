"""The multi-hot Criteo layout: `ttt data synth-criteo` writes what the reference's reader maps (np.load of
the .npy files, the .npz members), deterministically per seed with a manifest; the preflight names the
bad file in one line before init_start (truncated .npy, an id beyond its table, a label not 0/1, a missing
day file); the reader's rows cross day boundaries in order."""

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest

from timetotrain.cli import main
from timetotrain.data import criteo, criteo_synth
from timetotrain.errors import UserError
from timetotrain.models.dlrm_dcnv2 import CRITEO_MULTI_HOT, CRITEO_TABLE_SIZES
from timetotrain.spec.task import Share

MICRO = dataclasses.replace(
    criteo_synth.SCALES["tiny"], table_sizes=tuple(min(n, 50) for n in criteo_synth.SCALES["tiny"].table_sizes),
    train_day_rows=(40,) * 23, last_day_rows=61, chunk=32,
)  # fmt: skip


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("criteo") / "d"
    criteo_synth.generate(out, MICRO, seed=0, log=lambda *a: None)
    return out


def _digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_layout_is_what_the_reference_reads(micro):
    for d in range(criteo.DAYS):
        dense = np.load(criteo.dense_file(micro, d), allow_pickle=False)
        labels = np.load(criteo.labels_file(micro, d), allow_pickle=False)
        rows = 61 if d == 23 else 40
        assert dense.dtype == np.float32 and dense.shape == (rows, 13)
        assert labels.dtype == np.int32 and labels.shape == (rows, 1)
        assert dense.min() >= np.log(3) - 1e-6  # log(x + 3) of counts >= 0
        with zipfile.ZipFile(criteo.sparse_file(micro, d)) as zf:
            assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        z = np.load(criteo.sparse_file(micro, d), allow_pickle=False)
        assert sorted(z.files, key=int) == [str(t) for t in range(26)]
        for t, k in enumerate(MICRO.multi_hot):
            ids = z[str(t)]
            assert ids.dtype == np.int32 and ids.shape == (rows, k)
            assert ids.min() >= 0 and ids.max() < MICRO.table_sizes[t]
    files = criteo.open_files(micro, MICRO.table_sizes, MICRO.multi_hot)
    assert files.train_rows == 23 * 40 and files.val_rows == 31  # ceil(61 / 2)
    assert criteo.verify(files)
    # Rows run across days in order; the mapped reader equals np.load.
    dense, labels, sparse = criteo.Rows(files.days[:-1]).take(35, 10)
    d0 = np.load(criteo.dense_file(micro, 0))
    d1 = np.load(criteo.dense_file(micro, 1))
    assert np.array_equal(dense, np.concatenate([d0[35:], d1[:5]]))
    z1 = np.load(criteo.sparse_file(micro, 1))
    assert np.array_equal(sparse[5:, :3], z1["0"][:5]) and labels.dtype == np.float32
    files.close()


def test_the_dataset_facts_are_the_models():
    assert criteo.TABLE_SIZES == CRITEO_TABLE_SIZES and criteo.MULTI_HOT == CRITEO_MULTI_HOT


def test_deterministic_per_seed(micro, tmp_path):
    criteo_synth.generate(tmp_path / "again", MICRO, seed=0, log=lambda *a: None)
    criteo_synth.generate(tmp_path / "other", MICRO, seed=1, log=lambda *a: None)
    ours = _digest(micro)
    assert _digest(tmp_path / "again") == ours
    other = _digest(tmp_path / "other")
    assert other["day_0_dense.npy"] != ours["day_0_dense.npy"]


def test_the_planted_model_is_learnable_but_not_trivial():
    h = criteo_synth.hidden(criteo_synth.SCALES["tiny"], 0)
    _, labels, _, logit = criteo_synth.chunk(criteo_synth.SCALES["tiny"], h, 0, 23, 0, 20_000)
    ceiling = criteo_synth._auc(logit, labels[:, 0])
    assert 0.75 < ceiling < 0.9
    assert 0.15 < labels.mean() < 0.4


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _rewrite_member(path: Path, t: int, fn) -> None:
    z = np.load(path, allow_pickle=False)
    arrays = {k: z[k] for k in z.files}
    arrays[str(t)] = fn(arrays[str(t)].copy())
    path.unlink()
    np.savez(path, **arrays)


def _truncate(d):
    p = criteo.dense_file(d, 5)
    p.write_bytes(p.read_bytes()[:-7])
    return p


def _id_beyond(d):
    p = criteo.sparse_file(d, 7)

    def bump(a):
        a[3, 0] = 5_000  # beyond table 2 of MICRO (50 rows) and of the tiny tier (2,000)
        return a

    _rewrite_member(p, 2, bump)
    return p


def _bad_label(d):
    p = criteo.labels_file(d, 23)
    a = np.load(p)
    a[4, 0] = 2
    p.unlink()
    np.save(p, a)
    return p


def _missing(d):
    p = criteo.sparse_file(d, 11)
    p.unlink()
    return p


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "damage,words",
    [
        (_truncate, "truncated"),
        (_id_beyond, "outside table 2"),
        (_bad_label, "not 0 or 1"),
        (_missing, "missing"),
    ],
    ids=["truncated-npy", "id-beyond-table", "label-not-0-1", "missing-day-file"],
)
def test_preflight_names_the_file_in_one_line_before_init_start(micro, tmp_path, capsys, damage, words):
    d = _copy(micro, tmp_path / "d")
    bad = damage(d)
    with pytest.raises(UserError) as e:
        criteo.open_files(d, MICRO.table_sizes, MICRO.multi_hot)
    assert str(bad) in str(e.value) and words in str(e.value)
    logs = tmp_path / "logs"
    code = main(["run", "dlrm_dcnv2", "--tier", "tiny", "--data", str(d), "--logdir", str(logs)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(bad) in err[0] and words in err[0], err
    assert not list(logs.rglob("result_*"))  # nothing logged: the check ran before init_start


@pytest.mark.bad_input
def test_the_wrong_dataset_size_names_the_fix(micro, tmp_path, capsys):
    code = main(["run", "dlrm_dcnv2", "--tier", "tiny", "--data", str(micro), "--logdir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "synth-criteo --scale tiny" in err[0], err


def test_eval_shares_are_equal_chunks_and_cover_the_validation_rows_once(micro, monkeypatch):
    """Sharded tables run collectives in every forward, so each rank scores the same chunks; the 31
    validation rows over 3 ranks are 11 + 11 + 9, the last share padded and the padding dropped."""
    import torch

    from timetotrain.spec.registry import get
    from timetotrain.tasks import click_through_rate as ctr

    bench = get("dlrm_dcnv2")
    tier = bench.tier("tiny")
    spec = dataclasses.replace(tier.data, eval_batch=4)
    calls, seen = [], []
    monkeypatch.setattr(ctr, "gather", lambda t, world: t)
    monkeypatch.setattr(ctr, "auc", lambda s, y: seen.append((s, y)) or 0.5)

    class Model(torch.nn.Module):
        def forward(self, dense, sparse):
            calls[-1].append(tuple(dense.shape))
            return dense[:, 0] + sparse[:, 0].float()

    out = []
    for world in (1, 3):
        for rank in range(world):
            files = criteo.open_files(micro, MICRO.table_sizes, MICRO.multi_hot)
            days = ctr._Days(files, spec, 6, Share.of(6, rank, world), torch.device("cpu"))
            calls.append([])
            days.evaluate(Model())
            files.close()
        out.append(torch.cat([s for s, _ in seen[-world:]]))
    assert calls[1] == calls[2] == calls[3] == [(4, 13), (4, 13), (3, 13)]
    assert torch.equal(out[0], out[1]) and len(out[0]) == 31


def test_the_auroc_ranks_fp32_probabilities_as_the_reference_does(micro):
    """The reference scores sigmoid(logits) in fp32 (dlrm_main.py:392-406): logits 20 and 25 are both 1.0
    there, a tie worth half, so a model that tells the classes apart only at such logits has AUC 0.5."""
    import torch

    from timetotrain.spec.registry import get
    from timetotrain.tasks import click_through_rate as ctr
    from timetotrain.tasks.auc import auc

    assert torch.sigmoid(torch.tensor([20.0, 25.0])).tolist() == [1.0, 1.0]
    spec = get("dlrm_dcnv2").tier("tiny").data
    files = criteo.open_files(micro, MICRO.table_sizes, MICRO.multi_hot)
    days = ctr._Days(files, spec, 6, Share.of(6), torch.device("cpu"))
    labels = torch.from_numpy(days.val.take(0, len(days.val))[1]).float()
    by_row = {
        tuple(d): y for d, y in zip(days.val.take(0, len(days.val))[0].tolist(), labels.tolist(), strict=True)
    }

    class Model(torch.nn.Module):  # 25 for every click, 20 for every other row: a perfect ranking in logits
        def forward(self, dense, sparse):
            return torch.tensor([20.0 + 5.0 * by_row[tuple(d)] for d in dense.tolist()])

    try:
        assert 0 < labels.sum() < len(labels)
        assert auc(20.0 + 5.0 * labels, labels) == 1.0  # what scoring the logits gave
        assert days.evaluate(Model()) == 0.5
    finally:
        files.close()
