"""Bad input fails before init_start with one line naming the problem and the fix; no result file is left."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ttt_run

from timetotrain.cli import main
from timetotrain.data import tokenizer

pytestmark = pytest.mark.bad_input


def results(logdir: Path) -> list[Path]:
    """Result files, finished or live (`.partial`): a preflight failure leaves neither."""
    return sorted(logdir.rglob("result_*")) if logdir.exists() else []


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("ttt: error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def data_copy(c4_prepared, tmp_path) -> Path:
    dst = tmp_path / "c4"
    shutil.copytree(c4_prepared, dst)
    return dst


def tiny(data, logdir, *extra):
    return ["run", "llama31_8b", "--tier", "tiny", "--data", str(data), "--logdir", str(logdir), *extra]


@pytest.mark.slow
def test_unwritable_logdir_fails_fast_before_init(c4_prepared, tmp_path):
    t0 = time.monotonic()
    proc = ttt_run(*tiny(c4_prepared, "/proc/ttt-forbidden"))
    seconds = time.monotonic() - t0
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--logdir /proc/ttt-forbidden" in proc.stderr and "not writable" in proc.stderr
    assert ":::MLLOG" not in proc.stdout  # nothing logged: it failed before init_start
    print(f"unwritable logdir rejected in {seconds:.2f} s (a forked process: imports excluded)")


def test_missing_data_dir(capsys, tmp_path):
    code, err = run_cli(capsys, *tiny(tmp_path / "nope", tmp_path / "logs"))
    assert_one_line_error(code, err, "--data", "ttt data prepare")
    assert results(tmp_path / "logs") == []


def test_data_dir_without_split(capsys, data_copy, tmp_path):
    for f in data_copy.glob("c4-validation*"):
        f.unlink()
    code, err = run_cli(capsys, *tiny(data_copy, tmp_path / "logs"))
    assert_one_line_error(code, err, "no validation split", "--split validation")
    assert results(tmp_path / "logs") == []


def test_checksum_mismatch(capsys, data_copy, tmp_path):
    binf = data_copy / "c4-train_text_document.bin"
    raw = bytearray(binf.read_bytes())
    raw[1000] ^= 0xFF
    binf.write_bytes(bytes(raw))
    code, err = run_cli(capsys, *tiny(data_copy, tmp_path / "logs"))
    assert_one_line_error(code, err, "c4-train_text_document.bin", "checksum mismatch")
    assert results(tmp_path / "logs") == []


def test_truncated_bin_found_by_manifest(capsys, data_copy, tmp_path):
    binf = data_copy / "c4-validation_text_document.bin"
    binf.write_bytes(binf.read_bytes()[:-100])
    code, err = run_cli(capsys, *tiny(data_copy, tmp_path / "logs"))
    assert_one_line_error(code, err, "c4-validation_text_document.bin", "incomplete")
    assert results(tmp_path / "logs") == []


@pytest.mark.parametrize("suffix,cut", [(".idx", 7), (".bin", 4)])
def test_truncated_files_without_manifest(capsys, data_copy, tmp_path, suffix, cut):
    # Data from elsewhere (no manifest): the index/header checks still catch truncation.
    for m in data_copy.glob("*.manifest.json"):
        m.unlink()
    f = data_copy / f"c4-train_text_document{suffix}"
    f.write_bytes(f.read_bytes()[:-cut])
    code, err = run_cli(capsys, *tiny(data_copy, tmp_path / "logs"))
    assert_one_line_error(code, err, f"c4-train_text_document{suffix}")
    assert results(tmp_path / "logs") == []


def test_corrupt_idx_magic(capsys, data_copy, tmp_path):
    for m in data_copy.glob("*.manifest.json"):
        m.unlink()
    f = data_copy / "c4-train_text_document.idx"
    raw = bytearray(f.read_bytes())
    raw[0:4] = b"JUNK"
    f.write_bytes(bytes(raw))
    code, err = run_cli(capsys, *tiny(data_copy, tmp_path / "logs"))
    assert_one_line_error(code, err, "c4-train_text_document.idx")


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["run", "llama99", "--tier", "tiny"], ["unknown benchmark", "ttt list"]),
        (["run", "llama31_8b", "--tier", "huge"], ["--tier 'huge'", "tiny"]),
        (["run", "llama31_8b", "--tier", "tiny", "--set", "lr_max=1"], ["--set 'lr_max'", "choose from"]),
        (["run", "llama31_8b", "--tier", "tiny", "--max-steps", "0"], ["--max-steps"]),
    ],
)
def test_bad_arguments(capsys, tmp_path, argv, needles):
    code, err = run_cli(capsys, *argv, "--data", str(tmp_path), "--logdir", str(tmp_path / "logs"))
    assert_one_line_error(code, err, *needles)
    assert results(tmp_path / "logs") == []


def test_tokenizer_not_installed(capsys, monkeypatch, c4_src, tmp_path):
    tokenizer.load.cache_clear()
    monkeypatch.setitem(sys.modules, "llama_models", None)  # import now raises ImportError
    try:
        code, err = run_cli(
            capsys,
            "data",
            "prepare",
            "c4",
            "--src",
            str(c4_src),
            "--split",
            "train",
            "--out",
            str(tmp_path / "o"),
        )
    finally:
        tokenizer.load.cache_clear()
    assert_one_line_error(code, err, "pip install llama-models==0.3.0")
    assert not (tmp_path / "o").exists()


def test_prepare_bad_src(capsys, tmp_path):
    code, err = run_cli(
        capsys, "data", "prepare", "c4", "--src", str(tmp_path), "--split", "train", "--out", "x"
    )
    assert_one_line_error(code, err, "--src", "c4-train")


# -- seeds, --set values, devices: checked before the data and before any log line --


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_seed_out_of_range(capsys, c4_prepared, tmp_path, seed):
    code, err = run_cli(capsys, *tiny(c4_prepared, tmp_path / "logs", "--seed", str(seed)))
    assert_one_line_error(code, err, f"--seed {seed}", "2**32")
    assert results(tmp_path / "logs") == []


def test_seed_range_covers_every_run_of_a_set(capsys, c4_prepared, tmp_path):
    code, err = run_cli(
        capsys, *tiny(c4_prepared, tmp_path / "logs", "--seed", str(2**32 - 1), "--runs", "2")
    )
    assert_one_line_error(code, err, "--runs 2", str(2**32))
    assert results(tmp_path / "logs") == []


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_set_non_finite(capsys, c4_prepared, tmp_path, value):
    code, err = run_cli(capsys, *tiny(c4_prepared, tmp_path / "logs", "--set", f"lr={value}"))
    assert_one_line_error(code, err, f"--set lr={value}", "finite")
    assert results(tmp_path / "logs") == []


@pytest.mark.parametrize(
    "device,needle",
    [
        pytest.param(
            "cuda", "no CUDA device", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="GPU")
        ),
        pytest.param(
            "cuda:7", "cuda:7", marks=pytest.mark.skipif(torch.cuda.device_count() > 7, reason="8 GPUs")
        ),
        pytest.param("mps", "MPS", marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS")),
        ("foo", "not a torch device name"),
        ("meta", "cannot train"),
    ],
)
def test_device_not_present(capsys, c4_prepared, tmp_path, device, needle):
    code, err = run_cli(capsys, *tiny(c4_prepared, tmp_path / "logs", "--device", device))
    assert_one_line_error(code, err, f"--device {device}" if device != "foo" else "--device 'foo'", needle)
    assert results(tmp_path / "logs") == []


def test_device_index_beyond_the_host(monkeypatch):
    # What a GPU host with one device says to cuda:7, and to a torchrun rank whose local GPU is missing.
    from timetotrain.errors import UserError
    from timetotrain.train.device import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"1 CUDA device\(s\), cuda:0..cuda:0, not cuda:7"):
        resolve("cuda:7")
    with pytest.raises(UserError, match="local rank 3"):
        resolve("cuda", local_rank=3)
    assert resolve("cuda:0") == torch.device("cuda", 0)


# -- prepared data: empty, out-of-vocabulary ids, malformed manifests --


def drop_manifests(data: Path) -> None:
    for m in data.glob("*.manifest.json"):
        m.unlink()


@pytest.mark.parametrize("docs", [0, 3])
def test_empty_prepared_split(capsys, data_copy, tmp_path, docs):
    from timetotrain.data.indexed import IndexedWriter

    drop_manifests(data_copy)  # data from elsewhere: the structural checks alone must catch it
    with IndexedWriter(data_copy / "c4-train_text_document") as w:
        for _ in range(docs):
            w.add_document([])
    code, err = run_cli(capsys, *tiny(data_copy, tmp_path / "logs"))
    assert_one_line_error(code, err, "c4-train_text_document.bin", "holds no tokens", f"({docs} documents)")
    assert results(tmp_path / "logs") == []


def test_validation_split_too_small_fails_before_init(capsys, data_copy, tmp_path):
    from timetotrain.data.indexed import IndexedWriter

    drop_manifests(data_copy)
    with IndexedWriter(data_copy / "c4-validation_text_document") as w:
        w.add_document(list(range(1000)))  # 3 windows of 257 tokens; the tiny tier evaluates 64
    code, err = run_cli(capsys, *tiny(data_copy, tmp_path / "logs"))
    assert_one_line_error(code, err, "c4-validation_text_document.bin", "64 validation windows")
    assert results(tmp_path / "logs") == []


def test_token_id_beyond_a_narrowed_vocabulary(capsys, data_copy, tmp_path):
    # The tiny tier maps raw ids through a table as long as the training counts file: an id past it (data
    # from a larger tokenizer) is found by the bounded scan, as no counts file covers this split.
    from timetotrain.data.indexed import IndexedWriter

    drop_manifests(data_copy)
    (data_copy / "c4-validation_token_counts.npy").unlink()
    with IndexedWriter(data_copy / "c4-validation_text_document") as w:
        for _ in range(80):
            w.add_document([*range(100, 356), 200_000])
    code, err = run_cli(capsys, *tiny(data_copy, tmp_path / "logs"))
    assert_one_line_error(code, err, "c4-validation_text_document.bin", "token id 200,000", "all its tokens")
    assert results(tmp_path / "logs") == []


def test_token_ids_against_the_model_vocabulary(c4_prepared, data_copy):
    """Without narrowing, raw ids must be below the model's vocabulary: from the counts file where there is
    one, else from a scan. With narrowing (the tiny tier) the same data is fine: ids are mapped."""
    import dataclasses

    from timetotrain.data import loader
    from timetotrain.errors import UserError
    from timetotrain.spec import registry

    tiny_data = registry.get("llama31_8b").tier("tiny").data
    loader.resolve(tiny_data, c4_prepared, verify=False, vocab_size=4096, eval_samples=64)
    raw = dataclasses.replace(tiny_data, vocab_keep=None)
    with pytest.raises(UserError, match=r"c4-train_token_counts.npy.*model's vocabulary of 4,096"):
        loader.resolve(raw, c4_prepared, verify=False, vocab_size=4096, eval_samples=64)
    loader.resolve(raw, c4_prepared, verify=False, vocab_size=128_256, eval_samples=64)
    drop_manifests(data_copy)
    for counts in data_copy.glob("*_token_counts.npy"):
        counts.unlink()
    with pytest.raises(UserError, match="from all its tokens"):
        loader.resolve(raw, data_copy, verify=False, vocab_size=4096, eval_samples=64)


def test_bounded_scan_reads_spread_chunks(tmp_path, monkeypatch):
    from timetotrain.data import loader
    from timetotrain.data.indexed import IndexedDataset, IndexedWriter

    monkeypatch.setattr(loader, "_SCAN_TOKENS", 64 * 10)
    with IndexedWriter(tmp_path / "d") as w:
        w.add_document([5] * 10_000 + [9_999])  # the last token: the last chunk ends at the file's end
    lo, hi, how = loader.max_token_id(IndexedDataset(tmp_path / "d"))
    assert (lo, hi) == (5, 9_999) and "a scan of 640 of its 10,001 tokens" == how


@pytest.mark.parametrize(
    "mangle,needle",
    [
        (lambda t: t[: len(t) // 2], "unreadable (JSONDecodeError"),
        (lambda t: b"\xff\xfe" + t, "unreadable (UnicodeDecodeError"),
        (lambda t: b"[]", "a JSON list, not an object"),
        (lambda t: b'{"tokenizer": {"name": "llama3"}}', "no `files` object"),
        (lambda t: t.replace(b'"sha256"', b'"sha"', 1), ".sha256` is missing"),
        (lambda t: t.replace(b'"bytes"', b'"size"', 1), ".bytes` is missing"),
        (lambda t: t.replace(b'"c4-train_text_document.bin"', b'"../x.bin"', 1), "not a plain name"),
        (lambda t: t.replace(b'"tokenizer"', b'"tok"', 1), "no `tokenizer.name`"),
    ],
)
def test_malformed_manifest(capsys, data_copy, tmp_path, mangle, needle):
    m = data_copy / "c4-train.manifest.json"
    m.write_bytes(mangle(m.read_bytes()))
    code, err = run_cli(capsys, *tiny(data_copy, tmp_path / "logs"))
    assert_one_line_error(code, err, "c4-train.manifest.json is not a valid manifest", needle)
    assert results(tmp_path / "logs") == []


# -- `ttt data prepare c4` on bad input: one line with the file (and line), no output left --


def _c4_src(folder: Path, lines: list[bytes] | None) -> Path:
    import gzip

    folder.mkdir()
    path = folder / "c4-train.00000-of-00001.json.gz"
    if lines is None:
        path.write_bytes(b"")  # not even a gzip header
    else:
        with gzip.open(path, "wb") as f:
            f.writelines(lines)
    return folder


@pytest.mark.parametrize(
    "lines,needles",
    [
        ([], ["holds no documents"]),
        (None, ["holds no documents"]),
        ([b'{"text": "hello"}\n', b'{"text": "caf\xe9"}\n'], [".json.gz:2 ", "not valid UTF-8"]),
    ],
    ids=["empty-gzip", "zero-bytes", "latin-1"],
)
def test_prepare_c4_bad_input(capsys, tmp_path, lines, needles):
    src = _c4_src(tmp_path / "src", lines)
    out = tmp_path / "out"
    code, err = run_cli(
        capsys,
        "data",
        "prepare",
        "c4",
        "--src",
        str(src),
        "--split",
        "train",
        "--out",
        str(out),
        "--workers",
        "1",
    )
    assert_one_line_error(code, err, "c4-train.00000-of-00001.json.gz", *needles)
    assert sorted(p.name for p in out.iterdir()) == []  # nothing half-written, no temporaries


def test_seed_check_imports_no_torch():
    # The CLI checks --seed/--runs before it blocks SIGTERM/SIGINT (run_set's Aborter); torch imported
    # earlier starts threads that would take SIGTERM with its default action (test_e2e_tiny's SIGTERM test).
    code = (
        "import sys; from timetotrain.cli import run; run.run_seeds(7, 3); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_the_cli_starts_no_thread_before_it_blocks_the_signals():
    # SIGTERM/SIGINT reach only the abort watcher because every thread inherits their blocking from the
    # main thread (train/abort.py); a thread started at import (numpy's BLAS pool, through mlperf_logging)
    # keeps them unblocked, the kernel may hand it the signal, and its default action ends the run with no
    # run_stop (test_e2e_tiny's SIGTERM test failed so).
    code = "import os, timetotrain.cli; n = len(os.listdir('/proc/self/task')); assert n == 1, n"
    subprocess.run([sys.executable, "-c", code], check=True)
