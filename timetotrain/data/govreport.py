"""`ttt data prepare govreport`: SCROLLS GovReport → packed Llama 2 token blocks for llama2_70b_lora.

The recipe (docs/benchmarks/llama2_70b_lora.md; MLCommons `llama2_70b_lora/scripts/utils.py:create_datasets`, read for facts):

* text = "### Summarize the following text:\\n {input}\\n ### Summary:\\n {output}" followed by EOS;
* training labels = input_ids (loss on every token);
* validation labels = input_ids with the prompt ("### Summarize … ### Summary:\\n", tokenized on its own) and
  the final EOS set to -100, so the eval loss is the loss on the summary only;
* examples longer than the block (8,192) are dropped, not truncated;
* both splits are packed: examples are concatenated (labels alongside) and cut into `block`-token rows, the
  remainder dropped. Validation is packed too: an eval row may start mid-report, and the masked labels make
  only summary tokens count, wherever the block boundaries fall.

Decisions:

* **BOS.** The reference tokenizes with Hugging Face's Llama tokenizer, which puts `<s>` (1) in front of every
  string it encodes and reads the literal "</s>" the recipe appends as EOS (2). The prompt it masks is tokenized
  the same way, so the masked length includes BOS. We build [BOS] + sp.encode(text) + [EOS] and mask
  1 + len(sp.encode(prompt)) positions. Checked against transformers' LlamaTokenizer built from the same
  tokenizer.model: identical ids for the full text and the prompt on all 14 fixture rows. Known difference: a
  literal "<s>" or "</s>" inside a report would be a special token to Hugging Face and plain text here; such
  examples are counted in the manifest (`special_strings`) rather than silently diverging.
* **Packing groups.** The reference packs inside `datasets.map(batched=True, num_proc=P)`: the rows are cut
  into P contiguous shards (P = 8 for train, 2 for validation, lowered to the row count if fewer), each shard
  into batches of 1,000 rows, and every batch is concatenated and cut on its own, each dropping its own
  remainder. `packing="reference"` (the default) reproduces those groups so the blocks match the reference's,
  block for block; `packing="whole"` concatenates every example into one stream (fewer tokens lost).
* **Output.** Per split two int32 `.npy` arrays `[n_blocks, block]`, `govreport-{split}_input_ids.npy` and
  `govreport-{split}_labels.npy` (int32 holds the 32,000-id vocab and -100; `.npy` can be memory-mapped by every
  rank), and `govreport-{split}.manifest.json` with their sha256s, the source's and tokenizer's sha256s and the
  counts. MLCommons' preprocessed parquet (`scrolls_gov_report_8k/{train,validation}-00000-of-00001.parquet`,
  columns `input_ids`, `labels`, optional `attention_mask`) is read straight into the same arrays
  (`read_mlcommons_parquet`; `ttt data prepare govreport --src` that parquet, or the folder holding it).

Tiny tier (`select="tiny"`, `--select tiny`): the shared fixture has 14 real report/summary rows, two of them
(`leval_gov_report_06` and `_13`) the same document. We sort the rows by `id` (file order does not matter),
drop exact (input, output) repeats so no document is in both splits (a validation loss on a document seen in
training measures memorisation), and take the first 10 distinct rows for train and the next 3 for validation:
10 keep most data for training (9 blocks); 3 pack into 2 validation blocks whose ~700 summary tokens carry the
eval loss (the third report's summary falls in the dropped remainder, as the recipe drops remainders). Every
fixture report is 3,200-27,000 tokens, so the tiny block (1,024, to keep a tiny model's steps fast) would drop
them all; the tiny selection therefore cuts the *report* (at a whitespace, from its end) until the templated
example fits the block, keeping the template, BOS, the whole summary and EOS, so the token layout and label
mask are the recipe's. Tiny packs with `packing="whole"`: the reference's 8 shards would leave 1-2 rows per
group and lose most tokens to remainders.

Bad input: a non-UTF-8 line, a line that is not a JSON object, a record without a string `input` or
`output` or with an empty `output`, an empty file, or no complete block at the end are each one-line
UserErrors naming the file (and line or row) and the fix; so is a --tokenizer-model other than Llama 2's
(the Mixtral one), at prepare time rather than when the run reads the manifest. Examples longer than the block are dropped and counted (`dropped_too_long`).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field as _field
from itertools import islice
from pathlib import Path

import numpy as np

from timetotrain import fileio
from timetotrain.data import npy
from timetotrain.data import sentencepiece_tok as spt
from timetotrain.data.manifest import (
    REPREPARE,
    ensure_writable,
    read_manifest,
    sha256_file,
    verify_manifest,
    write_manifest,
)
from timetotrain.data.mapped import MappedFiles
from timetotrain.errors import UserError
from timetotrain.progress import LiveLine

SPLITS = ("train", "validation")
DEFAULT_BLOCK = 8192
TINY_BLOCK = 1024
TINY_TRAIN_ROWS = 10
TINY_VALIDATION_ROWS = 3
IGNORE_INDEX = -100
PROMPT_HEAD = "### Summarize the following text:\n "
PROMPT_TAIL = "\n ### Summary:\n"
# datasets.map's num_proc per split in the reference, and its default batch size.
REFERENCE_NUM_PROC = {"train": 8, "validation": 2}
REFERENCE_BATCH_ROWS = 1000
PACKINGS = ("reference", "whole")
SELECTS = ("all", "tiny")
_SPECIAL_STRINGS = ("<s>", "</s>", "<unk>")
_BATCH_ROWS = 32

# Where a missing --src comes from, for the error that names it (no file here fetches it).
WHERE_FROM = (
    "SCROLLS gov_report is the `gov_report` config of the Hugging Face dataset tau/scrolls "
    "(https://huggingface.co/datasets/tau/scrolls); MLCommons' packed scrolls_gov_report_8k parquet is for "
    "MLCommons Members (https://llama2.mlcommons.org, `ttt data download --for llama2_70b_lora` says how); the "
    "tiny tier's 14 rows: `ttt data download fixtures --only govreport --out DIR`"
)


def prompt_text(report: str) -> str:
    """The part of an example the validation labels mask (BOS is added on top)."""
    return f"{PROMPT_HEAD}{report}{PROMPT_TAIL}"


def example_text(report: str, summary: str) -> str:
    """The templated example without EOS (EOS is appended as an id, not as the string "</s>")."""
    return f"{prompt_text(report)} {summary}"


def dataset_name(split: str) -> str:
    return f"govreport-{split}"


def array_names(split: str) -> tuple[str, str]:
    return f"govreport-{split}_input_ids.npy", f"govreport-{split}_labels.npy"


# ---------------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Row:
    where: str  # "FILE:LINE" or "FILE row N" for messages
    id: str | None
    input: str
    output: str


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"--split {split!r} is not one of {', '.join(SPLITS)}")


def _record(where: str, rec: object) -> Row:
    if not isinstance(rec, dict):
        raise UserError(
            f"{where} is not a JSON object: each line must be one SCROLLS record with `input` and `output`"
        )
    for field in ("input", "output"):
        if not isinstance(rec.get(field), str):
            what = "has no" if rec.get(field) is None else "has a non-string"
            raise UserError(
                f"{where} {what} `{field}` field: every record needs `input` (the report) and `output` "
                "(the summary) as strings; fix or remove that record"
            )
    if not rec["output"].strip():
        # Its example would hold no summary token: no loss to train on, and in validation nothing to score.
        raise UserError(
            f"{where} has an empty `output` field (the summary): every record needs one; fix or remove that record"
        )
    rid = rec.get("id")
    return Row(where, None if rid is None else str(rid), rec["input"], rec["output"])


def _iter_jsonl(src: Path) -> Iterator[Row]:
    with open(src, "rb") as f:
        for lineno, raw in enumerate(fileio.bounded_lines(f, fileio.LINE, str(src)), 1):
            where = f"{src}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{where} is not valid UTF-8 (byte {e.start}): re-encode the file as UTF-8 "
                    "(e.g. `iconv -f latin1 -t utf-8`) or remove that line"
                ) from None
            if not line.strip():
                continue  # a trailing or blank line carries no record
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{where} is not JSON ({e.msg}, column {e.colno}): each line must be one SCROLLS record"
                ) from None
            yield _record(where, rec)


def _parquet_file(src: Path):
    try:
        import pyarrow.parquet as pq  # heavy (0.2 s): only a .parquet source
    except ImportError as e:
        raise UserError("pyarrow is not installed: run `pip install pyarrow` to read .parquet") from e
    try:
        return pq.ParquetFile(src)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError subclasses for every kind of bad file
        raise UserError(f"{src} cannot be read as parquet ({type(e).__name__}): download it again") from None


def _iter_parquet_text(src: Path, pf) -> Iterator[Row]:
    names = set(pf.schema_arrow.names)
    cols = ["input", "output"] + (["id"] if "id" in names else [])
    row = 0
    for batch in pf.iter_batches(batch_size=256, columns=cols):
        d = batch.to_pydict()
        for i in range(batch.num_rows):
            yield _record(f"{src} row {row} (0-based)", {c: d[c][i] for c in cols})
            row += 1


def _is_mlcommons_parquet(pf) -> bool:
    return "input_ids" in pf.schema_arrow.names


def iter_rows(src: Path) -> Iterator[Row]:
    """SCROLLS records from a `.jsonl` (fields `input`, `output`, optional `id`) or a `.parquet` with those
    columns, in file order."""
    if not src.is_file():
        raise UserError(
            f"--src {src} does not exist: point it at a SCROLLS gov_report .jsonl or .parquet file ({WHERE_FROM})"
        )
    suffix = src.suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from _iter_jsonl(src)
    elif suffix == ".parquet":
        pf = _parquet_file(src)
        names = pf.schema_arrow.names
        if not {"input", "output"} <= set(names):
            raise UserError(
                f"{src} has columns {names}, not `input` and `output`: pass a SCROLLS gov_report parquet "
                "(or MLCommons' preprocessed one with `input_ids` and `labels`)"
            )
        yield from _iter_parquet_text(src, pf)
    else:
        raise UserError(f"--src {src} is neither .jsonl nor .parquet: pass a SCROLLS gov_report file")


def tiny_rows(rows: list[Row], split: str, src: Path | str = "--src") -> list[Row]:
    """The tiny tier's rows of `split` (see the module docstring): distinct rows in `id` order, the first 10
    for train, the next 3 for validation."""
    _check_split(split)
    for r in rows:
        if r.id is None:
            raise UserError(f"{r.where} has no `id`: the tiny selection orders rows by id; add ids")
    seen: set[tuple[str, str]] = set()
    distinct = []
    for r in sorted(rows, key=lambda r: r.id):
        if (r.input, r.output) not in seen:
            seen.add((r.input, r.output))
            distinct.append(r)
    need = TINY_TRAIN_ROWS + TINY_VALIDATION_ROWS
    if len(distinct) < need:
        raise UserError(
            f"{src} has {len(distinct)} distinct records; the tiny selection needs {need}: "
            "pass the shared gov_report fixture"
        )
    if split == "train":
        return distinct[:TINY_TRAIN_ROWS]
    return distinct[TINY_TRAIN_ROWS:need]


def parse_rows(spec: str) -> tuple[int, int | None]:
    """`START:STOP` (0-based, STOP exclusive, either may be empty) as in a Python slice of the file's records."""
    try:
        a, b = spec.split(":")
        start = int(a) if a.strip() else 0
        stop = int(b) if b.strip() else None
    except ValueError:
        raise UserError(f"--rows {spec!r} is not START:STOP (e.g. 0:10): give two record numbers") from None
    if start < 0 or (stop is not None and stop <= start):
        raise UserError(f"--rows {spec!r} selects nothing: use 0 <= START < STOP")
    return start, stop


# ------------------------------------------------------------------------------------------------- tokenizing


def encode_example(tok, report: str, summary: str, split: str) -> tuple[list[int], list[int]]:
    """One example's (input_ids, labels) as the recipe lays them out, without length checks."""
    ids = [tok.bos_id, *tok.encode(example_text(report, summary)), tok.eos_id]
    if split == "train":
        return ids, list(ids)
    n_prompt = 1 + len(tok.encode(prompt_text(report)))
    labels = [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
    labels[-1] = IGNORE_INDEX
    return ids, labels


def fit_report(tok, report: str, summary: str, block: int) -> str | None:
    """Cut the report from its end, at whitespace, until the templated example is at most `block` tokens.
    None when even an empty report does not fit (the summary alone is too long)."""
    while True:
        n = len(tok.encode(example_text(report, summary))) + 2
        if n <= block:
            return report
        if not report:
            return None
        # Chars per token of this text estimate how much to cut; a short cut just takes another round.
        per_token = len(example_text(report, summary)) / max(n - 2, 1)
        cut = len(report) - max(1, math.ceil((n - block) * per_token))
        if cut <= 0:
            report = ""
            continue
        space = max(report.rfind(c, 0, cut) for c in " \n\t")
        report = report[: space if space > 0 else cut].rstrip()


def reference_groups(n: int, split: str) -> list[int]:
    """Sizes of the consecutive example groups the reference packs separately (see the module docstring)."""
    if n == 0:
        return []
    shards = min(REFERENCE_NUM_PROC[split], n)  # datasets lowers num_proc to the row count
    div, mod = divmod(n, shards)
    sizes: list[int] = []
    for rank in range(shards):
        full, rest = divmod(div + (1 if rank < mod else 0), REFERENCE_BATCH_ROWS)
        sizes += [REFERENCE_BATCH_ROWS] * full + ([rest] if rest else [])
    return sizes


def pack(
    ids: list[np.ndarray], labels: list[np.ndarray], block: int, groups: list[int] | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Concatenate each group of consecutive examples and cut it into `block`-token rows, dropping each
    group's remainder. Returns (input_ids, labels, tokens dropped as remainders). groups=None: one group."""
    if groups is None:
        groups = [len(ids)] if ids else []
    if sum(groups) != len(ids):
        raise ValueError(f"groups cover {sum(groups)} examples, not {len(ids)}")
    out_ids, out_lab = [], []
    dropped = start = 0
    for g in groups:
        cat = np.concatenate(ids[start : start + g])
        lab = np.concatenate(labels[start : start + g])
        start += g
        keep = (cat.size // block) * block
        dropped += cat.size - keep
        out_ids.append(cat[:keep].reshape(-1, block))
        out_lab.append(lab[:keep].reshape(-1, block))
    if not out_ids:
        empty = np.zeros((0, block), dtype=np.int32)
        return empty, empty.copy(), 0
    return np.concatenate(out_ids), np.concatenate(out_lab), dropped


# ----------------------------------------------------------------------------------- MLCommons parquet reader


def _list_column(src: Path, table, name: str) -> np.ndarray:
    import pyarrow as pa  # heavy (0.2 s): only a .parquet source

    col = table.column(name).combine_chunks()
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise UserError(
            f"{src} column `{name}` is {col.type}, not a list of token ids: is this the right file?"
        )
    if col.null_count:
        row = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
        raise UserError(f"{src} row {row} (0-based) has no `{name}`: download the file again")
    lengths = np.diff(col.offsets.to_numpy())
    if lengths.size and (lengths != lengths[0]).any():
        row = int(np.flatnonzero(lengths != lengths[0])[0])
        raise UserError(
            f"{src} row {row} (0-based) has {lengths[row]} `{name}`, row 0 has {lengths[0]}: "
            "rows must be packed blocks of one length; download the file again"
        )
    flat = col.flatten()
    if flat.null_count:
        raise UserError(f"{src} column `{name}` has null ids inside a row: download the file again")
    values = flat.to_numpy()
    if values.size and (values.min() < np.iinfo(np.int32).min or values.max() > np.iinfo(np.int32).max):
        raise UserError(f"{src} column `{name}` holds ids outside int32: is this the right file?")
    width = int(lengths[0]) if lengths.size else 0
    return values.astype(np.int32, copy=False).reshape(len(col), width)


def read_mlcommons_parquet(
    src: Path | str, vocab_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, dict]:
    """MLCommons' preprocessed `scrolls_gov_report_8k/{split}-00000-of-00001.parquet` as (input_ids, labels)
    int32 arrays `[rows, block]`, plus counts. Every row must have one length; an `attention_mask`, if
    present, must be all ones (the rows are packed; a zero would mean padding these arrays cannot carry)."""
    src = Path(src)
    pf = _parquet_file(src)
    names = pf.schema_arrow.names
    missing = [c for c in ("input_ids", "labels") if c not in names]
    if missing:
        raise UserError(
            f"{src} has no {', '.join(f'`{c}`' for c in missing)} column (columns: {names}): pass MLCommons' "
            "scrolls_gov_report_8k parquet, or a SCROLLS text file to tokenize"
        )
    cols = ["input_ids", "labels"] + (["attention_mask"] if "attention_mask" in names else [])
    table = pf.read(columns=cols)
    if table.num_rows == 0:
        raise UserError(f"{src} has no rows: download the file again")
    input_ids = _list_column(src, table, "input_ids")
    labels = _list_column(src, table, "labels")
    if labels.shape != input_ids.shape:
        raise UserError(
            f"{src} has `labels` rows of {labels.shape[1]} and `input_ids` rows of {input_ids.shape[1]}: "
            "download the file again"
        )
    if "attention_mask" in cols:
        mask = _list_column(src, table, "attention_mask")
        bad = np.flatnonzero((mask != 1).any(axis=1)) if mask.shape == input_ids.shape else [0]
        if len(bad):
            raise UserError(
                f"{src} row {int(bad[0])} (0-based) has an attention_mask that is not all ones: "
                "only packed rows without padding are supported; prepare from the SCROLLS text instead"
            )
    if vocab_size is not None and input_ids.size and (input_ids.min() < 0 or input_ids.max() >= vocab_size):
        raise UserError(
            f"{src} has token ids outside [0, {vocab_size}): it was not made with this --tokenizer-model"
        )
    # The recipe's labels are the ids or -100; anything else means a different preprocessing. The hosted
    # file's provenance is unconfirmed, so we say so and count it rather than refuse the official data.
    odd = int(((labels != input_ids) & (labels != IGNORE_INDEX)).sum())
    if odd:
        warnings.warn(
            f"{src}: {odd:,} labels are neither the input id nor -100 (not the create_datasets layout)",
            stacklevel=2,
        )
    info = {
        "rows": int(input_ids.shape[0]),
        "block": int(input_ids.shape[1]),
        "attention_mask": "attention_mask" in cols,
        "labels_not_input_or_ignore": odd,
    }
    return input_ids, labels, info


def mlcommons_files(src: Path, split: str) -> list[Path]:
    """A parquet file, or the folder holding `{split}*.parquet` (the reference globs `train*.parquet`)."""
    if src.is_dir():
        files = sorted(src.glob(f"{split}*.parquet"))
        if not files:
            raise UserError(
                f"--src {src} has no {split}*.parquet: point it at MLCommons' scrolls_gov_report_8k folder "
                "or at a SCROLLS gov_report .jsonl"
            )
        return files
    return [src]


# -------------------------------------------------------------------------------------------------- preparing


def _save(out: Path, split: str, input_ids: np.ndarray, labels: np.ndarray, info: dict) -> None:
    """Both arrays and the manifest, renamed into place together (a signal or an error before that leaves
    the previous files as they were and no temporaries)."""
    paths = [out / name for name in array_names(split)]
    with fileio.Staged() as staged:
        for path, arr in zip(paths, (input_ids, labels), strict=True):
            with staged.open(path, "wb") as f:  # a file object, so np.save does not append another .npy
                npy.save(f, np.ascontiguousarray(arr, dtype=np.int32))
        write_manifest(out, dataset_name(split), paths, info, staged)


def _import_parquet(src: Path, split: str, tok, out: Path, block: int | None) -> dict:
    files = mlcommons_files(src, split)
    parts = [read_mlcommons_parquet(f, tok.vocab_size) for f in files]
    widths = sorted({p[2]["block"] for p in parts})
    if len(widths) != 1:
        raise UserError(
            f"--src {src} mixes rows of {widths} tokens across {len(files)} files: keep one split's files only"
        )
    if block is not None and block != widths[0]:
        raise UserError(
            f"--src {src} holds blocks of {widths[0]} tokens, not --block {block}: drop --block to import them"
        )
    input_ids = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    ensure_writable(out)
    info = {
        "dataset": "govreport",
        "split": split,
        "block": int(input_ids.shape[1]),
        "dtype": "int32",
        "source_format": "mlcommons-parquet",
        "sources": {f.name: sha256_file(f) for f in files},
        "tokenizer": tok.identity(),
        "counts": {
            "blocks": int(input_ids.shape[0]),
            "tokens": int(input_ids.size),
            "label_tokens": int((labels != IGNORE_INDEX).sum()),
            "labels_not_input_or_ignore": sum(p[2]["labels_not_input_or_ignore"] for p in parts),
        },
    }
    _save(out, split, input_ids, labels, info)
    return info


def prepare(
    src: Path | str,
    split: str,
    tokenizer_model: Path | str,
    out: Path | str,
    block: int | None = None,
    select: str = "all",
    rows: str | None = None,
    truncate_input: bool | None = None,
    packing: str | None = None,
    threads: int | None = None,
) -> dict:
    """Tokenize, filter and pack one split; write the two arrays and the manifest into `out`; return the
    manifest's info. `select="tiny"` takes the tiny tier's rows and defaults block to 1,024, truncated
    reports and whole-stream packing. A parquet with `input_ids` is imported as it is."""
    src, out = Path(src), Path(out)
    _check_options(src, split, block, select, rows, packing)
    tiny = select == "tiny"
    tok = _llama2_tokenizer(tokenizer_model)  # fail before any output if the tokenizer is wrong

    pretokenized = (
        src.suffix.lower() == ".parquet" and src.is_file() and _is_mlcommons_parquet(_parquet_file(src))
    )
    if src.is_dir() or pretokenized:
        if tiny or rows is not None or truncate_input:
            raise UserError(
                f"--src {src} is already tokenized and packed: --select, --rows and --truncate-input "
                "apply to SCROLLS text only"
            )
        return _import_parquet(src, split, tok, out, block)

    block = block or (TINY_BLOCK if tiny else DEFAULT_BLOCK)
    truncate = tiny if truncate_input is None else truncate_input
    packing = packing or ("whole" if tiny else "reference")
    threads = threads or min(os.cpu_count() or 1, 8)
    ensure_writable(out)

    selected, n_read = _selected_rows(src, split, tiny, rows)
    kept = _encode(selected, tok, split, block, truncate, threads)
    if kept.examples == 0 and rows is not None:
        raise UserError(f"--rows {rows} selects no record of {src}: it has fewer records; choose other rows")
    if kept.examples == 0:
        raise UserError(f"{src} has no records: it is empty; pass the SCROLLS gov_report file")

    groups = reference_groups(len(kept.ids), split) if packing == "reference" else None
    input_ids, labels, remainder = pack(kept.ids, kept.labels, block, groups)
    if input_ids.shape[0] == 0:
        raise UserError(
            f"{src}: no complete {block:,}-token block ({len(kept.ids)} examples kept, {kept.too_long} longer "
            f"than the block dropped): use more rows, a smaller --block, or --truncate-input"
        )
    counts = {
        "rows_read": n_read if n_read is not None else kept.examples,
        "examples": kept.examples,
        "dropped_too_long": kept.too_long,
        "inputs_truncated": kept.truncated,
        "examples_packed": len(kept.ids),
        "tokens_before_packing": int(sum(a.size for a in kept.ids)),
        "packing_groups": len(groups) if groups is not None else 1,
        "remainder_tokens_dropped": int(remainder),
        "blocks": int(input_ids.shape[0]),
        "tokens": int(input_ids.size),
        "label_tokens": int((labels != IGNORE_INDEX).sum()),
        "mask_not_prefix": int(kept.mismatched),
        "special_strings": int(kept.specials),
    }
    info = {
        "dataset": "govreport",
        "split": split,
        "block": block,
        "dtype": "int32",
        "source_format": "scrolls-" + src.suffix.lower().lstrip("."),
        "sources": {src.name: sha256_file(src)},
        "tokenizer": tok.identity(),
        "recipe": {
            "template": example_text("{input}", "{output}") + "</s>",
            "bos": True,
            "labels": "input_ids" if split == "train" else "input_ids; BOS+prompt and final EOS = -100",
            "drop_longer_than_block": not truncate,
            "truncate_input_to_block": truncate,
            "packing": packing,
        },
        "selection": {"select": select, "rows": rows, "ids": kept.row_ids if tiny else None},
        "counts": counts,
    }
    _save(out, split, input_ids, labels, info)
    return info


def _check_options(src: Path, split: str, block: int | None, select: str, rows: str | None, packing) -> None:
    """The flags' values, before the tokenizer loads or anything is read."""
    _check_split(split)
    if select not in SELECTS:
        raise UserError(f"--select {select!r} is not one of {', '.join(SELECTS)}")
    if packing is not None and packing not in PACKINGS:
        raise UserError(f"--packing {packing!r} is not one of {', '.join(PACKINGS)}")
    if block is not None and block < 2:
        raise UserError(f"--block {block} is too small: use at least 2 (the reference uses {DEFAULT_BLOCK})")
    if select == "tiny" and rows is not None:
        raise UserError("--rows and --select tiny both choose rows: give one of them")
    if not src.exists():
        raise UserError(
            f"--src {src} does not exist: point it at a SCROLLS gov_report .jsonl or .parquet file ({WHERE_FROM})"
        )


def _llama2_tokenizer(tokenizer_model: Path | str):
    tok = spt.load(tokenizer_model)
    if tok.name != "llama2":  # llama2_70b_lora's only tokenizer: its run refuses blocks of any other
        what = (
            "the Mixtral 8x22B tokenizer"
            if tok.name == "mixtral"
            else f"not a tokenizer we know (sha256 {tok.sha256[:12]}…)"
        )
        raise UserError(
            f"--tokenizer-model {tokenizer_model} is {what}: GovReport is tokenized with the Llama 2 tokenizer.model "
            "(meta-llama/Llama-2-70b-hf/tokenizer.model), which llama2_70b_lora needs"
        )
    return tok


def _selected_rows(src: Path, split: str, tiny: bool, rows: str | None) -> tuple[Iterator[Row], int | None]:
    """The records to encode, and how many were read where all of them were (tiny), else None."""
    if tiny:
        all_rows = list(iter_rows(src))
        if not all_rows:
            raise UserError(f"{src} has no records: it is empty; pass the SCROLLS gov_report file")
        return iter(tiny_rows(all_rows, split, src)), len(all_rows)
    if rows is not None:
        start, stop = parse_rows(rows)
        return islice(iter_rows(src), start, stop), None
    return iter_rows(src), None


@dataclass
class _Kept:
    """The examples `_encode` kept (one int32 array each, with its labels and its record id) and what it
    counted on the way."""

    ids: list = _field(default_factory=list)
    labels: list = _field(default_factory=list)
    row_ids: list = _field(default_factory=list)
    examples: int = 0
    too_long: int = 0
    truncated: int = 0
    mismatched: int = 0
    specials: int = 0
    tokens: int = 0


def _encode(selected: Iterator[Row], tok, split: str, block: int, truncate: bool, threads: int) -> _Kept:
    """Tokenize the records in batches: BOS + example + EOS, dropped or truncated past `block`; labels
    masked over BOS + prompt and the final EOS outside train."""
    kept = _Kept()
    live = LiveLine()
    t0 = time.monotonic()
    while batch := list(islice(selected, _BATCH_ROWS)):
        texts = [example_text(r.input, r.output) for r in batch]
        encoded = tok.encode_batch(texts, threads)
        prompts = (
            tok.encode_batch([prompt_text(r.input) for r in batch], threads) if split != "train" else None
        )
        for i, r in enumerate(batch):
            kept.examples += 1
            kept.specials += any(s in r.input or s in r.output for s in _SPECIAL_STRINGS)
            body = encoded[i]
            kept.tokens += len(body) + 2
            prompt = prompts[i] if prompts is not None else None
            if len(body) + 2 > block:
                report = fit_report(tok, r.input, r.output, block) if truncate else None
                if report is None:
                    kept.too_long += 1
                    continue
                kept.truncated += 1
                body = tok.encode(example_text(report, r.output))
                prompt = tok.encode(prompt_text(report)) if prompts is not None else None
            ids = np.array([tok.bos_id, *body, tok.eos_id], dtype=np.int32)
            if split == "train":
                lab = ids  # loss on every token; the packed labels are a copy
            else:
                p = [tok.bos_id, *prompt]
                # The reference masks len(prompt tokens) positions whether or not they are a prefix of the
                # example's tokens; we do the same and count the examples where they are not.
                kept.mismatched += list(ids[: len(p)]) != p
                lab = ids.copy()
                lab[: len(p)] = IGNORE_INDEX
                lab[-1] = IGNORE_INDEX
            kept.ids.append(ids)
            kept.labels.append(lab)
            kept.row_ids.append(r.id)
        rate = kept.tokens / max(time.monotonic() - t0, 1e-9)
        live.update(
            f"govreport {split}: {kept.examples:,} examples, {kept.tokens:,} tokens, {rate:,.0f} tokens/s"
        )
    live.close()
    return kept


def prepare_tiny(src: Path | str, tokenizer_model: Path | str, out: Path | str) -> dict[str, dict]:
    """Both splits of the tiny tier from the shared 14-row fixture (what `--select tiny` does per split)."""
    return {split: prepare(src, split, tokenizer_model, out, select="tiny") for split in SPLITS}


def load_prepared(
    data_dir: Path | str, split: str, verify: bool = True, mapped: MappedFiles | None = None
) -> tuple[np.ndarray, np.ndarray, dict]:
    """The prepared (input_ids, labels) of `split`, memory-mapped, after checking the manifest's sha256s.
    With `mapped`, the maps are its own, so a run can check them before each read (no SIGBUS)."""
    data_dir = Path(data_dir)
    _check_split(split)
    doc = read_manifest(data_dir, dataset_name(split))
    if doc is None:
        raise UserError(
            f"{data_dir} has no {dataset_name(split)}.manifest.json: run "
            f"`ttt data prepare govreport --split {split} --out {data_dir} ...`"
        )
    if verify:
        verify_manifest(data_dir, doc)
    ids_name, lab_name = array_names(split)
    load = mapped.load if mapped is not None else (lambda p: np.load(p, mmap_mode="r", allow_pickle=False))
    ids, labels = load(data_dir / ids_name), load(data_dir / lab_name)
    for name, a in ((ids_name, ids), (lab_name, labels)):
        if a.dtype.kind not in "iu":  # float token ids or labels would be cast silently
            raise UserError(f"{data_dir / name} holds {a.dtype} values, not token ids: {REPREPARE}")
    return ids, labels, doc
