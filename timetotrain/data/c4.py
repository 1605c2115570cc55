"""`ttt data prepare c4`: allenai/c4 `*.json.gz` → Megatron indexed files + manifest + token counts.

Document order is kept (files in name order, lines in file order) so a prepared validation split is the
same stream the reference evaluates on. Each document is followed by the tokenizer's end-of-text id.
Decision (docs/benchmarks/llama31_8b.md, "Data": whether the hosted stream has separators is
unconfirmed): we append EOD, as Megatron's `--append-eod` does, because without a separator the model cannot tell where one unrelated
web page ends and the next begins, and gpt_oss_20b's EOD loss mask needs them. `--no-eod` turns it off.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from timetotrain import fileio, interrupt, lifeline
from timetotrain.data import npy, sentencepiece_tok
from timetotrain.data import tokenizer as tok
from timetotrain.data.indexed import IndexedWriter, best_dtype
from timetotrain.data.manifest import ensure_writable, sha256_file, write_manifest
from timetotrain.data.workers import OrderedWorkers
from timetotrain.errors import UserError
from timetotrain.progress import LiveLine

SPLITS = ("train", "validation")
_BATCH_DOCS = 128


def prefix_name(split: str) -> str:
    return f"c4-{split}_text_document"


def dataset_name(split: str) -> str:
    return f"c4-{split}"


def counts_name(split: str) -> str:
    return f"c4-{split}_token_counts.npy"


def source_files(src: Path, split: str) -> list[Path]:
    if not src.is_dir():
        raise UserError(
            f"--src {src} is not a directory: point it at the folder holding c4-{split}.*.json.gz"
        )
    files = sorted(src.glob(f"c4-{split}.*.json.gz"))
    if not files:
        raise UserError(
            f"--src {src} has no c4-{split}.*.json.gz files: point it at allenai/c4's `en` folder"
        )
    return files


def _iter_texts(files: list[Path]) -> Iterator[list[str]]:
    """Batches of document texts. Bad input stops the prepare with its file and line: invalid UTF-8 is an
    error, not replaced (decision: a replacement character would tokenize into ids the reference's data
    never holds, silently; C4 is valid UTF-8, so bad bytes mean a corrupt or foreign file), and so is a
    file without any document (an empty or truncated download)."""
    batch: list[str] = []
    for path in files:
        lineno = 0
        try:
            with gzip.open(path, "rb") as f:  # bytes: a decoding error is then tied to its line
                for lineno, raw in enumerate(fileio.bounded_lines(f, fileio.LINE, str(path)), 1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise UserError(
                            f"{path}:{lineno} is not valid UTF-8 (byte {e.start} of the line: {e.reason}): C4 is UTF-8; "
                            "download the file again"
                        ) from None
                    try:
                        text = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise UserError(
                            f"{path}:{lineno} is not a C4 record with a `text` field ({e})"
                        ) from e
                    if not isinstance(text, str):  # a worker's tokenizer would raise it as a traceback
                        raise UserError(
                            f"{path}:{lineno}: its `text` field is {_json_kind(text)}, not a string: C4 records "
                            "hold text; download the file again"
                        )
                    batch.append(text)
                    if len(batch) == _BATCH_DOCS:
                        yield batch
                        batch = []
        except (OSError, EOFError) as e:
            raise UserError(f"{path} cannot be read as gzip ({e}): download it again") from e
        if lineno == 0:
            raise UserError(f"{path} holds no documents (an empty or truncated download): download it again")
    if batch:
        yield batch


def _json_kind(value) -> str:
    """What a JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    return "an array" if isinstance(value, list) else "an object"


_worker_tok = None


def load_tokenizer(name: str, model_file: Path | None = None):
    """`llama3` is the file shipped by llama-models; a SentencePiece tokenizer (`llama2`, `mixtral`) is a file
    the user names with --tokenizer-model, checked to be the one asked for (its sha256), so the manifest's name
    is true. SentencePiece documents are encoded without BOS and followed by EOS, like Llama 3's. Decision
    (whether MLCommons' preprocessed Mixtral C4 carries BOS is unconfirmed): Megatron's and NeMo's
    preprocessing scripts tokenize each document without special tokens and append only the end-of-document
    id (`--append-eod`), which is what this does."""
    if model_file is None:
        if name != "llama3":
            raise UserError(f"--tokenizer {name} needs --tokenizer-model FILE (its tokenizer.model)")
        return tok.load(name)
    t = sentencepiece_tok.load(model_file)
    if t.name != name:
        raise UserError(
            f"--tokenizer-model {model_file} is not the {name} tokenizer (sha256 {t.sha256[:12]}…, "
            f"recognised as {t.name!r}): pass the right file or --tokenizer {t.name}"
        )
    return t


def _worker_init(name: str, model_file: Path | None) -> None:
    global _worker_tok
    _worker_tok = load_tokenizer(name, model_file)


def _encode_batch(job: tuple[list[str], bool]) -> tuple[np.ndarray, np.ndarray]:
    """One flat array per batch (not a list per document) keeps pickling and the parent's work small."""
    texts, eod = job
    docs = _worker_tok.encode_batch(texts)
    if eod:
        for d in docs:
            d.append(_worker_tok.eos_id)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    flat = np.fromiter((i for d in docs for i in d), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def prepare(
    src: Path,
    split: str,
    tokenizer: str,
    out: Path,
    workers: int | None = None,
    eod: bool = True,
    tokenizer_model: Path | None = None,
) -> dict:
    if split not in SPLITS:
        raise UserError(f"--split {split!r} is not one of {', '.join(SPLITS)}")
    files = source_files(src, split)
    t = load_tokenizer(tokenizer, tokenizer_model)  # fail here, before any output, if it is missing
    ensure_writable(out)

    workers = workers or min(os.cpu_count() or 1, 8)
    dtype = best_dtype(t.vocab_size)
    counts = np.zeros(t.vocab_size, dtype=np.int64)
    n_docs = n_tokens = 0
    live = LiveLine()
    t0 = time.monotonic()
    prefix = out / prefix_name(split)
    bin_path, idx_path, counts_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx"), out / counts_name(split)
    # The workers exist before our signal handlers do (a forked worker must not inherit them). Every
    # output stays under a temporary name until all are complete (Staged): SIGTERM/SIGINT, an error or a
    # full disk anywhere before that kills the workers (OrderedWorkers.__exit__) and removes the temporaries.
    # A SIGKILL gives us no such chance: the workers then die with us and the guardian (lifeline.py, forked
    # first, so it is no worker's child) removes the temporaries.
    with (
        lifeline.guard_temporaries(out),
        OrderedWorkers(workers, _encode_batch, _worker_init, (tokenizer, tokenizer_model)) as pool,
        interrupt.raise_on_signals(),
        fileio.Staged() as staged,
    ):
        # IndexedWriter renames its own temporaries to this dot-prefix; Staged renames those at the end.
        hidden = out / f".{prefix.name}.{os.getpid()}"
        staged.add(f"{hidden}.bin", bin_path)
        staged.add(f"{hidden}.idx", idx_path)
        try:
            with IndexedWriter(hidden, dtype) as writer:
                # Results come in input order while both cores tokenize.
                jobs = ((texts, eod) for texts in _iter_texts(files))
                for flat, lengths in pool.map(jobs):
                    flat = flat.astype(dtype, copy=False)
                    writer.add_documents(flat, lengths)
                    counts += np.bincount(flat, minlength=t.vocab_size)
                    n_docs += lengths.size
                    n_tokens += flat.size
                    rate = n_tokens / max(time.monotonic() - t0, 1e-9)
                    live.update(
                        f"c4 {split}: {n_docs:,} documents, {n_tokens:,} tokens, {rate:,.0f} tokens/s"
                    )
        except BaseException:
            live.close()  # the error line goes below the progress line, not over it
            raise
        live.update(f"c4 {split}: {n_docs:,} documents, {n_tokens:,} tokens", force=True)
        live.close()

        with staged.open(counts_path, "wb") as f:  # a file object: np.save adds no second .npy
            npy.save(f, counts)
        info = {
            "split": split,
            "documents": n_docs,
            "tokens": n_tokens,
            "eod_appended": eod,
            "dtype": np.dtype(dtype).name,
            "tokenizer": t.identity(),
            "sources": {p.name: sha256_file(p) for p in files},
        }
        write_manifest(out, dataset_name(split), [bin_path, idx_path, counts_path], info, staged)
    return info
