import os
import pickle

import numpy as np
import pytest
from conftest import require

from timetotrain.data.indexed import (
    DEFAULT_REMEDY,
    IndexedDataError,
    IndexedDataset,
    IndexedWriter,
    best_dtype,
)

# Importing megatron-core emits optional-dependency and deprecation notices that are not ours.
pytestmark = [
    pytest.mark.parity,
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex:UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

VOCAB = {np.uint16: 32000, np.int32: 128256}


def make_docs(seed: int, n: int, vocab: int, empty: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 601, n)
    if empty:
        lengths[[0, n // 2]] = 0
    return [rng.integers(0, vocab, size=k) for k in lengths]


def write(prefix, docs, dtype) -> None:
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)


def megatron_write(prefix, docs, dtype) -> None:
    mi = require("megatron.core.datasets.indexed_dataset")
    builder = mi.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        builder.add_document(d, [len(d)])
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_roundtrip(tmp_path, dtype):
    vocab = min(VOCAB.get(dtype, 200), 200) if dtype is np.uint8 else VOCAB.get(dtype, 1 << 40)
    docs = make_docs(0, 150, vocab, empty=True)
    write(tmp_path / "d", docs, dtype)
    ds = IndexedDataset(tmp_path / "d", verify=True)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == ds.num_documents == len(docs)
    assert ds.sizes.dtype == np.int32 and ds.pointers.dtype == np.int64
    assert ds.sizes.tolist() == [len(d) for d in docs]
    itemsize = np.dtype(dtype).itemsize
    assert ds.pointers.tolist() == (np.cumsum([0] + [len(d) for d in docs[:-1]]) * itemsize).tolist()
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    d = docs[3]
    np.testing.assert_array_equal(ds.get(3, offset=5), d[5:])
    np.testing.assert_array_equal(ds.get(3, offset=2, length=7), d[2:9])
    np.testing.assert_array_equal(ds.get(-1), docs[-1])
    with pytest.raises(IndexError):
        ds.get(len(docs))
    with pytest.raises(IndexError):
        ds.get(3, offset=1, length=len(d))


def test_bulk_add_is_identical(tmp_path):
    docs = make_docs(1, 80, 32000, empty=True)
    write(tmp_path / "one", docs, np.uint16)
    with IndexedWriter(tmp_path / "bulk", np.uint16) as w:
        w.add_documents(np.concatenate(docs[:40]), [len(d) for d in docs[:40]])
        w.add_documents(np.concatenate(docs[40:]), [len(d) for d in docs[40:]])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"bulk{ext}").read_bytes()


def test_empty_dataset(tmp_path):
    with IndexedWriter(tmp_path / "e", np.uint16):
        pass
    ds = IndexedDataset(tmp_path / "e", verify=True)
    assert len(ds) == 0 and ds.num_tokens == 0


def test_best_dtype():
    assert best_dtype(32000) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32  # megatron's cut-off, not 65536
    assert best_dtype(128256) == np.int32
    assert best_dtype(None) == np.int32


def test_writer_rejects_bad_tokens(tmp_path):
    with IndexedWriter(tmp_path / "w", np.uint16) as w:
        with pytest.raises(ValueError, match="does not fit uint16"):
            w.add_document(np.array([1, 70000]))
        with pytest.raises(ValueError, match="does not fit uint16"):
            w.add_document(np.array([-1, 3]))
        with pytest.raises(ValueError, match="integers"):
            w.add_document(np.array([1.0, 2.0]))
        with pytest.raises(ValueError, match="1-D"):
            w.add_document(np.zeros((2, 2), dtype=np.uint16))
        with pytest.raises(ValueError, match="sum to"):
            w.add_documents(np.arange(5), [2, 2])
        w.add_document(np.array([0, 65535], dtype=np.int64))
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "w")[0], [0, 65535])
    with pytest.raises(ValueError, match="unsupported token dtype"):
        IndexedWriter(tmp_path / "f", np.float32)


def test_writer_is_atomic(tmp_path):
    prefix = tmp_path / "a"
    write(prefix, make_docs(2, 10, 100), np.uint16)
    old = {ext: (tmp_path / f"a{ext}").read_bytes() for ext in (".bin", ".idx")}

    w = IndexedWriter(prefix, np.uint16)
    w.add_document(np.arange(50))
    # Until close, the previous pair is untouched and nothing new carries the final names.
    assert {ext: (tmp_path / f"a{ext}").read_bytes() for ext in (".bin", ".idx")} == old
    w.close()
    assert IndexedDataset(prefix).sizes.tolist() == [50]

    with pytest.raises(RuntimeError), IndexedWriter(tmp_path / "b", np.uint16) as w:
        w.add_document(np.arange(10))
        raise RuntimeError("crash")
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]


def test_pickle_reopens(tmp_path):
    docs = make_docs(3, 20, 1000)
    write(tmp_path / "p", docs, np.uint16)
    ds = pickle.loads(pickle.dumps(IndexedDataset(tmp_path / "p")))
    np.testing.assert_array_equal(ds[7], docs[7])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_interop(tmp_path, dtype):
    mi = require("megatron.core.datasets.indexed_dataset")
    docs = make_docs(4, 200, VOCAB[dtype])
    megatron_write(tmp_path / "mg", docs, dtype)
    write(tmp_path / "ours", docs, dtype)

    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"mg{ext}").read_bytes()

    ours = IndexedDataset(tmp_path / "mg", verify=True)
    assert ours.dtype == np.dtype(dtype)
    assert ours.sizes.tolist() == [len(d) for d in docs]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ours[i], d)

    theirs = mi.IndexedDataset(str(tmp_path / "ours"))
    assert theirs.index.dtype == dtype
    np.testing.assert_array_equal(theirs.sequence_lengths, [len(d) for d in docs])
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
    np.testing.assert_array_equal(theirs.get(5, offset=3, length=4), docs[5][3:7])


# --- corruption -------------------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path):
    prefix = tmp_path / "c4" / "train_text_document"
    prefix.parent.mkdir()
    write(prefix, make_docs(5, 30, 32000), np.uint16)
    return prefix


def _patch(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _append(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


CORRUPTIONS = {
    "missing_idx": (".idx", lambda p: os.remove(p), "is missing"),
    "missing_bin": (".bin", lambda p: os.remove(p), "is missing"),
    "bad_magic": (".idx", lambda p: _patch(p, 0, b"NOTANIDX\x00"), "bad magic"),
    "bad_version": (".idx", lambda p: _patch(p, 9, (2).to_bytes(8, "little")), "version 2"),
    "float_dtype": (".idx", lambda p: _patch(p, 17, bytes([7])), "float32"),
    "unknown_dtype": (".idx", lambda p: _patch(p, 17, bytes([42])), "dtype code 42"),
    "empty_idx": (".idx", lambda p: _truncate(p, 0), "truncated"),
    "short_header": (".idx", lambda p: _truncate(p, 20), "truncated"),
    "truncated_idx": (".idx", lambda p: _truncate(p, os.path.getsize(p) - 8), "truncated"),
    "oversized_idx": (".idx", lambda p: _append(p, b"\x00" * 30), "oversized"),
    "truncated_bin": (".bin", lambda p: _truncate(p, os.path.getsize(p) - 2), "truncated"),
    "oversized_bin": (".bin", lambda p: _append(p, b"\x00\x00"), "larger than its index"),
    "bad_doc_index": (
        ".idx",
        lambda p: _patch(p, os.path.getsize(p) - 8, (99).to_bytes(8, "little")),
        "document",
    ),
    "bad_last_pointer": (
        ".idx",
        lambda p: _patch(p, 34 + 4 * 30 + 8 * 29, (1 << 40).to_bytes(8, "little")),
        "pointers",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corruption_is_reported(pair, case):
    ext, damage, phrase = CORRUPTIONS[case]
    path = f"{pair}{ext}"
    damage(path)
    with pytest.raises(IndexedDataError) as info:
        IndexedDataset(pair, remedy="re-run `ttt data prepare c4`")
    message = str(info.value)
    assert "\n" not in message
    assert path in message
    assert phrase in message
    assert message.endswith("re-run `ttt data prepare c4`")


def test_verify_catches_inconsistent_pointers(pair):
    # Swap two interior pointers: header, sizes and .bin size all still look right.
    idx = f"{pair}.idx"
    at = 34 + 4 * 30 + 8 * 5
    raw = open(idx, "rb").read()
    _patch(idx, at, raw[at + 8 : at + 16] + raw[at : at + 8])
    IndexedDataset(pair)  # the cheap checks cannot see it
    with pytest.raises(IndexedDataError, match="disagree") as info:
        IndexedDataset(pair, verify=True)
    assert idx in str(info.value) and DEFAULT_REMEDY in str(info.value)
