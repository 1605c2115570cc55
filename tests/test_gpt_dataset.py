import numpy as np
import pytest
import torch
from conftest import require

from timetotrain.data import gpt_dataset
from timetotrain.data.gpt_dataset import GPTWindows, build_sample_index
from timetotrain.data.indexed import IndexedDataset, IndexedWriter

# Importing megatron-core emits optional-dependency and deprecation notices that are not ours.
pytestmark = [
    pytest.mark.parity,
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex:UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def write_corpus(prefix, seed: int, n_docs: int, dtype, vocab: int, empty: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 601, n_docs)
    if empty:
        # Empty documents, including the first, exercise megatron's pinned (0, 0) start.
        lengths[[0, 1, n_docs // 3, n_docs - 1]] = 0
    docs = [rng.integers(0, vocab, size=k) for k in lengths]
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt")
    out = {}
    for name, seed, n, dtype, vocab, empty in [
        ("u16", 0, 240, np.uint16, 32000, False),
        ("i32", 1, 160, np.int32, 128256, True),
    ]:
        docs = write_corpus(root / name, seed, n, dtype, vocab, empty)
        out[name] = (str(root / name), np.concatenate(docs))
    return out


class _Tokenizer:
    """The few attributes megatron's dataset code reads off a tokenizer."""

    vocab_size = 128256
    eod = 0
    unique_identifiers = {"class": "TestTokenizer"}


def megatron_gpt(prefix: str, seed: int, seq_length: int, num_samples, cache):
    gd = require("megatron.core.datasets.gpt_dataset")
    bb = require("megatron.core.datasets.blended_megatron_dataset_builder")
    config = gd.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="1,0,0",
        path_to_cache=str(cache),
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, valid, test = bb.BlendedMegatronDatasetBuilder(
        gd.GPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    assert valid is None and test is None
    return train


def _num_samples(kind: str, tokens: int, seq: int):
    per_epoch = (tokens - 1) // seq
    return {
        "one_epoch": per_epoch // 2,
        "exact_epoch": per_epoch,
        "merged_final_epoch": 2 * per_epoch - 2,  # final epoch supplies >= 80%: one global shuffle
        "separate_final_epoch": per_epoch + 3,  # final epoch supplies a few: shuffled on its own
        "three_epochs_separate": (2 * tokens - 1) // seq + 5,
        "whole_epoch": None,
    }[kind]


CASES = [
    ("u16", 1234, 64, "one_epoch", 1, False),
    ("u16", 7, 128, "exact_epoch", 1, False),
    ("u16", 99, 100, "merged_final_epoch", 2, False),
    ("u16", 1234, 257, "separate_final_epoch", 2, True),
    ("i32", 5, 32, "three_epochs_separate", 3, True),
    ("i32", 42, 511, "separate_final_epoch", 2, True),
    ("i32", 3, 77, "merged_final_epoch", 2, False),
    ("i32", 11, 200, "whole_epoch", 1, False),
]


@pytest.mark.parametrize(("name", "seed", "seq", "kind", "epochs", "separate"), CASES)
def test_matches_megatron(corpus, tmp_path, name, seed, seq, kind, epochs, separate):
    prefix, stream = corpus[name]
    num_samples = _num_samples(kind, stream.size, seq)
    ours = GPTWindows(IndexedDataset(prefix), seq, num_samples, seed=seed, shuffle=True)
    theirs = megatron_gpt(prefix, seed, seq, num_samples, tmp_path / "cache")

    assert (ours.num_epochs, ours.separate_final_epoch) == (epochs, separate)
    assert ours.total_samples == len(theirs)
    assert len(ours) == (len(theirs) if num_samples is None else num_samples)
    for mine, ref in [
        (ours.document_index, theirs.document_index),
        (ours.sample_index, theirs.sample_index),
        (ours.shuffle_index, theirs.shuffle_index),
    ]:
        assert mine.dtype == ref.dtype
        np.testing.assert_array_equal(mine, ref)

    windows = ours.batch(range(len(ours)))
    assert windows.dtype == torch.int64 and windows.shape == (len(ours), seq + 1)
    for i in range(len(ours)):
        text, _ = theirs._query_document_sample_shuffle_indices(i)
        np.testing.assert_array_equal(windows[i].numpy(), text)
    for i in (0, len(ours) // 2, len(ours) - 1):
        sample = theirs[i]
        np.testing.assert_array_equal(ours[i][:-1], sample["tokens"].numpy())
        np.testing.assert_array_equal(ours[i][1:], sample["labels"].numpy())


def test_sample_index_matches_cpp_across_chunks(monkeypatch):
    helpers = require("megatron.core.datasets.helpers")
    rng = np.random.default_rng(9)
    sizes = rng.integers(0, 40, 500).astype(np.int32)
    sizes[rng.integers(0, 500, 60)] = 0
    sizes[0] = 0
    # Tiny chunks put window boundaries on every kind of chunk edge.
    monkeypatch.setattr(gpt_dataset, "_CHUNK", 7)
    tokens = int(sizes.sum())
    for epochs, seq in [(1, 5), (3, 16), (2, 39)]:
        doc_index = np.tile(np.arange(500, dtype=np.int32), epochs)
        np.random.RandomState(epochs).shuffle(doc_index)
        ref = helpers.build_sample_idx(sizes, doc_index, seq, epochs, tokens, True, True)
        mine = build_sample_index(sizes, doc_index, seq, (epochs * tokens - 1) // seq)
        np.testing.assert_array_equal(mine, ref)


def test_windows_concatenate_documents(corpus):
    prefix, stream = corpus["i32"]
    w = GPTWindows(IndexedDataset(prefix), 300, None, seed=0)
    # Every sample id appears once, and window k is stream slice [k*L, k*L+L+1) of its epoch order.
    assert sorted(w.shuffle_index.tolist()) == list(range(len(w)))
    docs = [IndexedDataset(prefix)[int(d)] for d in w.document_index]
    shuffled_stream = np.concatenate(docs)
    for i in range(0, len(w), 7):
        k = w.sample_id(i)
        np.testing.assert_array_equal(w[i], shuffled_stream[k * 300 : k * 300 + 301])


@pytest.mark.parametrize("name", ["u16", "i32"])
def test_validation_in_document_order(corpus, name):
    prefix, stream = corpus[name]
    ds = IndexedDataset(prefix)
    seq = 256
    w = GPTWindows(ds, seq, 40, shuffle=False)
    assert len(w) == 40 and w.shuffle_index is None
    expected = np.stack([stream[i * seq : i * seq + seq + 1] for i in range(40)])
    np.testing.assert_array_equal(w.batch(range(40)).numpy(), expected)
    np.testing.assert_array_equal(w[39], expected[39])
    np.testing.assert_array_equal(w[-1], expected[39])

    # The seed does not matter, and a longer request starts with the same windows.
    other = GPTWindows(ds, seq, 60, seed=1234, shuffle=False)
    np.testing.assert_array_equal(other.batch(range(40)).numpy(), expected)

    everything = GPTWindows(ds, seq, None, shuffle=False)
    assert len(everything) == (stream.size - 1) // seq
    last = len(everything) - 1
    np.testing.assert_array_equal(everything[last], stream[last * seq : last * seq + seq + 1])
    with pytest.raises(ValueError, match="requested"):
        GPTWindows(ds, seq, len(everything) + 1, shuffle=False)
    with pytest.raises(IndexError):
        w[40]


def test_argument_checks(corpus):
    ds = IndexedDataset(corpus["u16"][0])
    with pytest.raises(ValueError, match="seed"):
        GPTWindows(ds, 64, 10, shuffle=True)
    with pytest.raises(ValueError, match="seq_length"):
        GPTWindows(ds, 1, 10, seed=0)


def megatron_blend(prefixes, weights, seed: int, seq_length: int, num_samples: int):
    gd = require("megatron.core.datasets.gpt_dataset")
    bb = require("megatron.core.datasets.blended_megatron_dataset_builder")
    config = gd.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend_per_split=[(list(prefixes), list(weights)), None, None],
        path_to_cache=None,  # BlendedDataset would ask torch.distributed for the rank that writes a cache
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, _, _ = bb.BlendedMegatronDatasetBuilder(
        gd.GPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    return train


@pytest.mark.parametrize(("weights", "num_samples", "seed"), [((50, 50), 301, 5), ((30.0, 70.0), 257, 11)])
def test_blend_matches_megatron(tmp_path, weights, num_samples, seed):
    """The llama31_405b training split: two files blended 50/50 (and an unequal blend, which runs the greedy
    rule itself), through the loader's path, against megatron-core's BlendedDataset: which file and which
    of its samples every window is, and the tokens."""
    from timetotrain.data import loader

    prefixes = []
    for i, n_docs in enumerate((90, 130)):
        write_corpus(tmp_path / f"part{i}", 20 + i, n_docs, np.uint16, 32768)
        prefixes.append(tmp_path / f"part{i}")
    seq = 128
    res = loader.ResolvedData(prefixes[0], prefixes[0], None, tuple(zip(prefixes, weights, strict=True)))
    ours = loader.open_train(res, seq, num_samples, seed)
    theirs = megatron_blend([str(p) for p in prefixes], weights, seed, seq, num_samples)

    assert len(ours) == len(theirs)
    assert ours.dataset_index.dtype == theirs.dataset_index.dtype
    np.testing.assert_array_equal(ours.dataset_index, theirs.dataset_index)
    np.testing.assert_array_equal(ours.dataset_sample_index, theirs.dataset_sample_index)
    for mine, ref in zip(ours.parts, theirs.datasets, strict=True):
        assert mine.total_samples == len(ref)
        np.testing.assert_array_equal(mine.shuffle_index, ref.shuffle_index)
    windows = ours.batch(range(len(ours)))
    for i in range(len(ours)):
        sample = theirs[i]
        np.testing.assert_array_equal(windows[i, :-1].numpy(), sample["tokens"].numpy())
        np.testing.assert_array_equal(windows[i, 1:].numpy(), sample["labels"].numpy())
