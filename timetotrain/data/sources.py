"""Where the raw files of a dataset lie in a folder of sources laid out as ../shared/data (`c4/en`,
`govreport/`, `tokenizers/<name>*/tokenizer.model`): what the tasks' data recipes read (`Task.data_recipe`).
A file that is not there is one UserError naming `--data SRC` and what to put there."""

from __future__ import annotations

from pathlib import Path

from timetotrain.errors import UserError


def c4_dir(src: Path) -> Path:
    """The folder holding allenai/c4 `en` shards of both splits: `src`/c4/en, `src`/c4 or `src` itself."""
    for d in (src / "c4" / "en", src / "c4", src):
        if any(d.glob("c4-train.*.json.gz")) and any(d.glob("c4-validation.*.json.gz")):
            return d
    raise UserError(
        f"--data {src}: no c4-train.*.json.gz and c4-validation.*.json.gz in it, c4/ or c4/en/: pass the "
        "folder holding allenai/c4 `en` shards (see `ttt data download c4`)"
    )


def tokenizer_model(src: Path, name: str) -> Path:
    """The SentencePiece `tokenizer.model` of tokenizer `name` (llama2, mixtral) under `src`."""
    found = sorted(src.glob(f"tokenizers/{name}*/tokenizer.model")) + sorted(
        src.glob(f"{name}*/tokenizer.model")
    )
    if not found:
        raise UserError(
            f"--data {src}: no tokenizers/{name}*/tokenizer.model in it: put the {name} SentencePiece "
            "tokenizer.model there"
        )
    return found[0]


def govreport_file(src: Path) -> Path:
    """The SCROLLS gov_report file (.jsonl or .parquet) under `src`/govreport or `src`."""
    for pattern in ("govreport/*.jsonl", "govreport/*.parquet", "*.jsonl", "*.parquet"):
        found = sorted(src.glob(pattern))
        if found:
            return found[0]
    raise UserError(
        f"--data {src}: no govreport/*.jsonl or *.parquet in it: put the SCROLLS gov_report file there"
    )
