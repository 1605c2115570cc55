"""C4 tokenized with the Mixtral 8x22B tokenizer (llama31_405b's data): the file is recognised by content, each
document is SentencePiece's ids followed by EOS (no BOS), and the wrong file for the name is refused."""

import gzip
import json

import pytest
from conftest import require_file, shared_data_dir

from timetotrain.data import c4, sentencepiece_tok
from timetotrain.data.indexed import IndexedDataset
from timetotrain.errors import UserError


@pytest.fixture(scope="module")
def mixtral():
    return require_file(shared_data_dir() / "tokenizers" / "mixtral-8x22b" / "tokenizer.model")


def test_the_mixtral_file_is_known_and_encodes_as_published(mixtral):
    t = sentencepiece_tok.load(mixtral)
    assert (t.name, t.vocab_size, t.bos_id, t.eos_id) == ("mixtral", 32_768, 1, 2)
    # The ids the fixture's provenance records for this sentence (no BOS).
    assert t.encode("The quick brown fox jumps over the lazy dog.") == [
        1183, 3704, 9828, 1053, 1910, 1229, 11343, 1522, 1040, 18666, 4682, 29491,
    ]  # fmt: skip


def test_c4_prepare_with_mixtral(c4_src, mixtral, tmp_path):
    import sentencepiece as spm

    c4.prepare(c4_src, "validation", "mixtral", tmp_path, workers=2, tokenizer_model=mixtral)
    manifest = json.loads((tmp_path / "c4-validation.manifest.json").read_text())
    assert manifest["tokenizer"]["name"] == "mixtral" and manifest["tokenizer"]["vocab_size"] == 32_768
    sp = spm.SentencePieceProcessor(model_file=str(mixtral))
    ds = IndexedDataset(tmp_path / "c4-validation_text_document")
    with gzip.open(next(c4_src.glob("c4-validation.*.json.gz")), "rt") as f:
        for i in range(3):
            assert ds[i].tolist() == sp.encode(json.loads(next(f))["text"]) + [2]
    llama2 = shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model"
    with pytest.raises(UserError, match="is not the mixtral tokenizer.*--tokenizer llama2"):
        c4.prepare(c4_src, "validation", "mixtral", tmp_path / "x", tokenizer_model=llama2)
