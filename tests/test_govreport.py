"""GovReport preparation for llama2_70b_lora: token layout, packing, parquet import, manifests, CLI, bad input."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import require, require_file, shared_data_dir, ttt_run

from timetotrain.data import govreport as g
from timetotrain.data import sentencepiece_tok as spt
from timetotrain.errors import UserError

pytestmark = pytest.mark.parity

FIXTURE_SHA256 = "38ea8b96b4192b4f84b2ae17a84c46d8f715cf7faa85c8315c7917433fc4e697"
# "<s>### Summarize the following text:\n The quick brown fox jumps over the lazy dog.\n ### Summary:\n
# A fox jumps.</s>" with the Llama 2 tokenizer. The report's ids are the ones PROVENANCE.md lists for that
# sentence encoded alone: after "\n" the template's space merges into "▁The" exactly as at a string start.
PINNED_IDS = [
    1,  # <s>
    835, 6991, 3034, 675, 278, 1494, 1426, 29901, 13,  # ▁### ▁Sum mar ize ▁the ▁following ▁text : \n
    450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203, 29889,  # ▁The quick ... dog .
    13, 835, 6991, 5219, 29901, 13,  # \n ▁### ▁Sum mary : \n
    319, 1701, 29916, 432, 17204, 29889,  # ▁A ▁fo x ▁j umps .
    2,  # </s>
]  # fmt: skip
PINNED_PROMPT_LEN = 28  # BOS + "### Summarize ... ### Summary:\n"


@pytest.fixture(scope="module")
def tok_path() -> Path:
    require("sentencepiece")
    return require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")


@pytest.fixture(scope="module")
def tok(tok_path):
    return spt.load(tok_path)


@pytest.fixture(scope="module")
def gov() -> Path:
    return require_file(shared_data_dir() / "govreport" / "gov_report.validation.scrolls_format.jsonl")


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def ttt(*argv):
    return ttt_run(*argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)


# -------------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_identity(tok):
    assert tok.name == "llama2" and tok.sha256 == spt.LLAMA2_SHA256
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (32000, 1, 2)
    # No BOS/EOS from encode; a literal "</s>" stays text (the recipe's EOS is appended as an id).
    assert tok.encode("The quick brown fox jumps over the lazy dog.") == PINNED_IDS[10:22]
    assert 2 not in tok.encode("end </s>")


# ----------------------------------------------------------------------------------------------------- layout


def test_pinned_token_layout(tok):
    report, summary = "The quick brown fox jumps over the lazy dog.", "A fox jumps."
    assert g.example_text(report, summary) == (
        "### Summarize the following text:\n The quick brown fox jumps over the lazy dog.\n ### Summary:\n A fox jumps."
    )
    ids, train_labels = g.encode_example(tok, report, summary, "train")
    assert ids == PINNED_IDS
    assert train_labels == ids  # loss on every token, BOS and EOS included
    ids_v, labels = g.encode_example(tok, report, summary, "validation")
    assert ids_v == PINNED_IDS
    assert labels[:PINNED_PROMPT_LEN] == [-100] * PINNED_PROMPT_LEN
    assert labels[PINNED_PROMPT_LEN] == ids[PINNED_PROMPT_LEN] == tok.encode(summary)[0] == 319  # ▁A
    assert labels[PINNED_PROMPT_LEN:-1] == ids[PINNED_PROMPT_LEN:-1] == tok.encode(summary)
    assert ids[-1] == tok.eos_id and labels[-1] == -100  # EOS is in the input but not scored


def test_real_example_mask_covers_exactly_the_prompt(tok, gov):
    row = min(g.iter_rows(gov), key=lambda r: len(r.input))
    ids, labels = g.encode_example(tok, row.input, row.output, "validation")
    first = next(i for i, v in enumerate(labels) if v != -100)
    assert ids[0] == 1 and ids[-1] == 2 and labels[-1] == -100
    assert ids[first - 1] == 13  # the "\n" ending "### Summary:\n"
    assert ids[first] == tok.encode(row.output)[0]
    assert tok.decode(labels[first:-1]) == row.output  # the scored span is the summary, all of it
    assert all(v != -100 for v in labels[first:-1])


def test_matches_hugging_face_llama_tokenizer(tok, tok_path, gov, tmp_path):
    """The reference tokenizes with transformers' Llama tokenizer: BOS added, literal "</s>" read as EOS."""
    require("google.protobuf")  # transformers needs it to read a SentencePiece file
    transformers = require("transformers")
    (tmp_path / "tokenizer.model").write_bytes(tok_path.read_bytes())
    cfg = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    rows = sorted(g.iter_rows(gov), key=lambda r: len(r.input))[:2]
    for r in rows:
        ids, labels = g.encode_example(tok, r.input, r.output, "validation")
        assert hf(g.example_text(r.input, r.output) + hf.eos_token).input_ids == ids
        n_prompt = len(hf(g.prompt_text(r.input)).input_ids)
        assert labels[:n_prompt] == [-100] * n_prompt and labels[n_prompt] != -100


# ---------------------------------------------------------------------------------------------------- packing


def test_pack_block_boundaries_and_remainder():
    ex = [np.arange(n, dtype=np.int32) + 100 * k for k, n in enumerate([5, 7, 3])]
    ids, labels, dropped = g.pack(ex, [e.copy() for e in ex], block=4)
    flat = np.concatenate(ex)
    assert ids.shape == (3, 4) and dropped == 3  # 15 tokens: three blocks, remainder 3
    np.testing.assert_array_equal(ids.ravel(), flat[:12])
    np.testing.assert_array_equal(labels, ids)
    # Two groups pack separately: [5+7] -> 3 blocks, [3] -> none, its 3 tokens dropped.
    ids2, _, dropped2 = g.pack(ex, ex, block=4, groups=[2, 1])
    assert ids2.shape == (3, 4) and dropped2 == 3
    ids3, _, dropped3 = g.pack(ex, ex, block=4, groups=[1, 2])  # [5] -> 1 (+1), [7+3] -> 2 (+2)
    assert ids3.shape == (3, 4) and dropped3 == 3
    np.testing.assert_array_equal(ids3[1], [100, 101, 102, 103])  # the second group starts a new block


def test_reference_groups():
    assert g.reference_groups(12, "train") == [2, 2, 2, 2, 1, 1, 1, 1]  # 8 contiguous shards
    assert g.reference_groups(12, "validation") == [6, 6]
    assert g.reference_groups(3, "train") == [1, 1, 1]  # num_proc lowered to the row count
    assert g.reference_groups(2500, "validation") == [1000, 250, 1000, 250]  # 1,000-row map batches
    assert sum(g.reference_groups(9001, "train")) == 9001
    assert g.reference_groups(0, "train") == []


def test_too_long_dropped_and_counted(tok, tmp_path, capsys):
    from timetotrain.cli import main

    short = {"id": "a", "input": "Short report.", "output": "Short."}
    long_ = {"id": "b", "input": "word " * 200, "output": "Long."}
    n_short = len(g.encode_example(tok, short["input"], short["output"], "train")[0])
    src = write_jsonl(tmp_path / "x.jsonl", [short, long_, short, short])
    # block == an example's length keeps it (the reference drops only longer ones). The command's summary
    # line and the manifest both count the drop.
    argv = [
        "data",
        "prepare",
        "govreport",
        "--src",
        str(src),
        "--split",
        "train",
        "--tokenizer-model",
        str(tok.path),
    ]
    argv += ["--out", str(tmp_path / "out"), "--block", str(n_short), "--packing", "whole"]
    assert main(argv) == 0
    assert f"4 examples, 1 longer than {n_short:,} tokens dropped, 3 blocks" in capsys.readouterr().out
    info = json.loads((tmp_path / "out" / "govreport-train.manifest.json").read_text())
    c = info["counts"]
    assert (c["examples"], c["dropped_too_long"], c["examples_packed"]) == (4, 1, 3)
    assert (c["blocks"], c["remainder_tokens_dropped"], c["tokens"]) == (3, 0, 3 * n_short)
    ids, labels, _ = g.load_prepared(tmp_path / "out", "train")
    assert ids.shape == (3, n_short) and (ids[:, 0] == 1).all() and (ids[:, -1] == 2).all()
    np.testing.assert_array_equal(ids, labels)
    # One token less and every example is too long: nothing to train on is an error, not an empty file.
    with pytest.raises(UserError, match=f"no complete {n_short - 1}-token block .0 examples kept, 4 longer"):
        g.prepare(src, "train", tok.path, tmp_path / "out2", block=n_short - 1)


def test_validation_packing_keeps_masks_aligned(tok, tmp_path):
    recs = [{"id": str(i), "input": f"Report number {i} " * 5, "output": f"Summary {i}."} for i in range(6)]
    src = write_jsonl(tmp_path / "v.jsonl", recs)
    info = g.prepare(src, "validation", tok.path, tmp_path / "out", block=64, packing="whole")
    ids, labels, _ = g.load_prepared(tmp_path / "out", "validation")
    per = [g.encode_example(tok, r["input"], r["output"], "validation") for r in recs]
    flat_ids = np.concatenate([p[0] for p in per])
    flat_lab = np.concatenate([p[1] for p in per])
    n = (flat_ids.size // 64) * 64
    np.testing.assert_array_equal(ids.ravel(), flat_ids[:n])
    np.testing.assert_array_equal(labels.ravel(), flat_lab[:n])
    assert info["counts"]["label_tokens"] == int((labels != -100).sum()) > 0
    assert info["counts"]["mask_not_prefix"] == 0


# ---------------------------------------------------------------------------------------------------- parquet


def test_mlcommons_parquet_round_trip(tok, tmp_path):
    pa = require("pyarrow")
    pq = require("pyarrow.parquet")
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 32000, size=(3, 16)).astype(np.int64)
    labels = ids.copy()
    labels[1, :5] = -100
    table = pa.table(
        {
            "input_ids": [list(map(int, r)) for r in ids],
            "labels": [list(map(int, r)) for r in labels],
            "attention_mask": [[1] * 16] * 3,
        }
    )
    path = tmp_path / "validation-00000-of-00001.parquet"
    pq.write_table(table, path)
    got_ids, got_labels, info = g.read_mlcommons_parquet(path, vocab_size=32000)
    assert got_ids.dtype == np.int32 and got_ids.shape == (3, 16)
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_labels, labels)
    assert info == {"rows": 3, "block": 16, "attention_mask": True, "labels_not_input_or_ignore": 0}
    # `ttt data prepare govreport --src FOLDER` imports it as it is, into the same files as a tokenized run.
    out = tmp_path / "out"
    proc = ttt(
        "data", "prepare", "govreport", "--src", str(tmp_path), "--split", "validation",
        "--tokenizer-model", tok.path, "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    a, b, doc = g.load_prepared(out, "validation")
    np.testing.assert_array_equal(a, ids)
    np.testing.assert_array_equal(b, labels)
    assert doc["source_format"] == "mlcommons-parquet" and doc["counts"]["blocks"] == 3
    assert doc["sources"][path.name] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_mlcommons_parquet_bad_rows(tmp_path):
    pa = require("pyarrow")
    pq = require("pyarrow.parquet")
    uneven = tmp_path / "uneven.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [1, 2]], "labels": [[1, 2, 3], [1, 2]]}), uneven)
    with pytest.raises(UserError, match=r"uneven.parquet row 1 \(0-based\) has 2 `input_ids`"):
        g.read_mlcommons_parquet(uneven)
    padded = tmp_path / "padded.parquet"
    cols = {"input_ids": [[1, 2], [1, 2]], "labels": [[1, 2], [1, 2]], "attention_mask": [[1, 1], [1, 0]]}
    pq.write_table(pa.table(cols), padded)
    with pytest.raises(UserError, match=r"padded.parquet row 1 .*attention_mask"):
        g.read_mlcommons_parquet(padded)
    nolabels = tmp_path / "nolabels.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), nolabels)
    with pytest.raises(UserError, match=r"nolabels.parquet has no `labels` column"):
        g.read_mlcommons_parquet(nolabels)


def test_scrolls_parquet_equals_jsonl(tok, gov, tmp_path):
    pa = require("pyarrow")
    pq = require("pyarrow.parquet")
    rows = list(g.iter_rows(gov))[:4]
    path = tmp_path / "gov.parquet"
    cols = {"id": [r.id for r in rows], "input": [r.input for r in rows], "output": [r.output for r in rows]}
    pq.write_table(pa.table(cols), path)
    a = g.prepare(path, "validation", tok.path, tmp_path / "pq")
    b = g.prepare(gov, "validation", tok.path, tmp_path / "js", rows="0:4")
    for name in g.array_names("validation"):
        np.testing.assert_array_equal(np.load(tmp_path / "pq" / name), np.load(tmp_path / "js" / name))
    assert a["counts"] == b["counts"] and a["source_format"] == "scrolls-parquet"
    assert a["counts"]["blocks"] >= 1 and b["selection"]["rows"] == "0:4"


# ---------------------------------------------------------------------------------------------- manifest, CLI


@pytest.fixture(scope="module")
def tiny_prepared(gov, tok_path, tmp_path_factory):
    """The tiny tier's two splits, prepared through the CLI as a user would."""
    out = tmp_path_factory.mktemp("govreport_tiny")
    procs = {}
    for split in g.SPLITS:
        procs[split] = ttt(
            "data", "prepare", "govreport", "--src", str(gov), "--split", split,
            "--tokenizer-model", str(tok_path), "--out", str(out), "--select", "tiny",
        )  # fmt: skip
    return out, procs


def test_cli_tiny_split(tiny_prepared, tok, gov, tmp_path):
    out, procs = tiny_prepared
    for split, proc in procs.items():
        assert proc.returncode == 0, proc.stderr
        last = proc.stdout.strip().splitlines()[-1]
        assert last.startswith(f"govreport {split}: ") and "blocks of 1,024 tokens" in last
    train = json.loads((out / "govreport-train.manifest.json").read_text())
    val = json.loads((out / "govreport-validation.manifest.json").read_text())
    # Distinct rows in id order; _13 repeats _06, so it is in neither split.
    assert train["selection"]["ids"] == [f"leval_gov_report_{i:02d}" for i in range(10)]
    assert val["selection"]["ids"] == ["leval_gov_report_10", "leval_gov_report_11", "leval_gov_report_12"]
    assert train["block"] == val["block"] == 1024
    assert train["counts"]["dropped_too_long"] == 0 and train["counts"]["inputs_truncated"] == 10
    assert train["counts"]["blocks"] >= 8 and val["counts"]["blocks"] >= 2
    ids, labels, _ = g.load_prepared(out, "validation")
    assert ids.shape == (val["counts"]["blocks"], 1024) and ids.dtype == np.int32
    assert 0 < (labels != -100).sum() == val["counts"]["label_tokens"]
    # The report was cut to fit, the summary was not: the first scored span is all of row _10's summary.
    flat = np.asarray(labels).ravel()
    start = int(np.flatnonzero(flat != -100)[0])
    stop = start + int(np.flatnonzero(flat[start:] == -100)[0])
    assert flat[stop - 1] != 2 and np.asarray(ids).ravel()[stop] == 2  # the EOS right after it is masked
    row10 = next(r for r in g.iter_rows(gov) if r.id == "leval_gov_report_10")
    assert tok.decode(flat[start:stop].tolist()) == row10.output
    # The Python helper gives the same bytes as the CLI (deterministic, one code path).
    again = g.prepare_tiny(gov, tok.path, tmp_path)
    for split in g.SPLITS:
        cli = json.loads((out / f"govreport-{split}.manifest.json").read_text())
        assert again[split]["counts"] == cli["counts"]
        for name in g.array_names(split):
            assert (tmp_path / name).read_bytes() == (out / name).read_bytes()


def test_manifest_checksums(tiny_prepared, tok_path, gov):
    out, _ = tiny_prepared
    for split in g.SPLITS:
        doc = json.loads((out / f"govreport-{split}.manifest.json").read_text())
        assert set(doc["files"]) == set(g.array_names(split))
        for name, entry in doc["files"].items():
            data = (out / name).read_bytes()
            assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert doc["sources"] == {gov.name: FIXTURE_SHA256}
        assert doc["tokenizer"]["sha256"] == hashlib.sha256(tok_path.read_bytes()).hexdigest()
        assert (doc["tokenizer"]["bos_id"], doc["tokenizer"]["eos_id"]) == (1, 2)
    # A flipped byte is caught before training.
    copy = out.parent / "govreport_corrupt"
    copy.mkdir(exist_ok=True)
    for p in out.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    target = copy / g.array_names("train")[0]
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch"):
        g.load_prepared(copy, "train")


def test_full_recipe_on_shared_file(tok, gov, tmp_path):
    info = g.prepare(gov, "validation", tok.path, tmp_path)
    c = info["counts"]
    # leval_gov_report_03 (12,674 tokens) and _10 (27,438) exceed 8,192; the other 12 are kept.
    assert (c["rows_read"], c["dropped_too_long"], c["examples_packed"]) == (14, 2, 12)
    assert c["blocks"] * 8192 == c["tokens"] and c["mask_not_prefix"] == 0 and c["special_strings"] == 0
    assert info["recipe"]["packing"] == "reference" and c["packing_groups"] == 2


# -------------------------------------------------------------------------------------------------- bad input


def _bad_inputs(tmp_path: Path) -> dict:
    ok = {"id": "a", "input": "A report.", "output": "A summary."}
    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(json.dumps(ok).encode() + b"\n" + b'{"input": "caf\xe9", "output": "x"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text(json.dumps(ok) + "\n{not json\n")
    return {
        "no_output": (write_jsonl(tmp_path / "no_output.jsonl", [ok, {"input": "r"}]), "no_output.jsonl:2"),
        "no_input": (write_jsonl(tmp_path / "no_input.jsonl", [{"output": "s"}]), "no_input.jsonl:1"),
        "not_utf8": (bad_utf8, "latin1.jsonl:2 is not valid UTF-8"),
        "empty": (empty, "empty.jsonl has no records"),
        "not_json": (garbage, "garbage.jsonl:2 is not JSON"),
    }


@pytest.mark.parametrize("case", ["no_output", "no_input", "not_utf8", "empty", "not_json", "bad_tokenizer"])
def test_bad_input_is_one_line(case, tok_path, tmp_path):
    cases = _bad_inputs(tmp_path)
    tokenizer = str(tok_path)
    if case == "bad_tokenizer":
        src, needle = cases["no_output"][0], "bad.model cannot be parsed as a SentencePiece model"
        (tmp_path / "bad.model").write_text("not a model")
        tokenizer = str(tmp_path / "bad.model")
    else:
        src, needle = cases[case]
    proc = ttt(
        "data", "prepare", "govreport", "--src", str(src), "--split", "train",
        "--tokenizer-model", tokenizer, "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ttt: error: "), proc.stderr
    assert needle in lines[0]
    assert not (tmp_path / "out" / "govreport-train.manifest.json").exists()


def test_no_complete_block_is_an_error(tok, tmp_path):
    src = write_jsonl(tmp_path / "one.jsonl", [{"input": "A report.", "output": "A summary."}])
    with pytest.raises(UserError, match="no complete 1,024-token block"):
        g.prepare(src, "train", tok.path, tmp_path / "out", block=1024)


def test_sigterm_while_writing_leaves_the_split_as_it_was(gov, tok_path, tmp_path, capsys, monkeypatch):
    """In the middle of writing a split (its input ids staged, the labels not yet): exit 128 + 15 with one
    line, the previous files of that split untouched, no temporary left."""
    import signal

    from timetotrain.cli import main

    out = tmp_path / "out"
    argv = ["data", "prepare", "govreport", "--src", str(gov), "--split", "validation",
            "--tokenizer-model", str(tok_path), "--out", str(out), "--select", "tiny"]  # fmt: skip
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    def unhandled(signum, frame):  # without ttt's handler the default would end pytest itself
        raise AssertionError("SIGTERM reached no handler of ttt's")

    real_save, saved = g.npy.save, []

    def save_then_signal(f, a, *args, **kwargs):
        real_save(f, a, *args, **kwargs)
        saved.append(1)
        os.kill(os.getpid(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, unhandled)
    monkeypatch.setattr(g.npy, "save", save_then_signal)
    try:
        code = main(argv)
    finally:
        signal.signal(signal.SIGTERM, old)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM and saved == [1], err
    assert "Traceback" not in err  # the progress line may come first; then the one line of ttt's
    assert [ln for ln in err.splitlines() if ln.startswith("ttt:")] == [
        "ttt: interrupted by SIGTERM: stopped, temporary files removed"
    ], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
