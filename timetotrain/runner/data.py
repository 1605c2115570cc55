"""What `ttt suite` prepares for a tier, found from the tier's data spec, never from the benchmark's name.

A tier whose data spec is an `LMData` reads C4 tokenized with its tokenizer; a `LoRAData` tier reads
GovReport packed into blocks of its length. A benchmark of another kind joins by giving its Task a method
`prepare_data(tier, source: Path, out: Path)` (docs/adding-a-benchmark.md); one with neither is run from a
folder the user names (`--data BENCH=DIR`).

Each recipe is a list of `ttt data prepare` command lines (run as child processes by the suite, so
their own interrupt handling and progress stay as they are) into a cache folder named by the recipe. The
folder is written as `<name>.partial` and renamed when every step has finished, so a folder that exists is
complete; `source.json` in it records which source files it was made from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from timetotrain.errors import UserError


def default_cache() -> Path:
    root = os.environ.get("TTT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "timetotrain")
    return Path(root) / "data"


@dataclass(frozen=True)
class Recipe:
    name: str  # the cache folder's name: what the data is, not which benchmark reads it
    describe: str
    steps: tuple[tuple[str, ...], ...]  # `ttt` argument lists; "{out}" is the folder being made
    sources: tuple[Path, ...]  # the files the steps read, recorded in source.json
    call: object = None  # a Task.prepare_data bound to its tier, for benchmarks outside the two kinds


def _c4_dir(src: Path) -> Path:
    for d in (src / "c4" / "en", src / "c4", src):
        if any(d.glob("c4-train.*.json.gz")) and any(d.glob("c4-validation.*.json.gz")):
            return d
    raise UserError(
        f"--data {src}: no c4-train.*.json.gz and c4-validation.*.json.gz in it, c4/ or c4/en/: pass the "
        "folder holding allenai/c4 `en` shards (see `ttt data download c4`)"
    )


def _tokenizer_model(src: Path, name: str) -> Path:
    found = sorted(src.glob(f"tokenizers/{name}*/tokenizer.model")) + sorted(
        src.glob(f"{name}*/tokenizer.model")
    )
    if not found:
        raise UserError(
            f"--data {src}: no tokenizers/{name}*/tokenizer.model in it: put the {name} SentencePiece "
            "tokenizer.model there"
        )
    return found[0]


def _govreport_file(src: Path) -> Path:
    for pattern in ("govreport/*.jsonl", "govreport/*.parquet", "*.jsonl", "*.parquet"):
        found = sorted(src.glob(pattern))
        if found:
            return found[0]
    raise UserError(
        f"--data {src}: no govreport/*.jsonl or *.parquet in it: put the SCROLLS gov_report file there"
    )


def lm_recipe(data, src: Path) -> Recipe:
    c4 = _c4_dir(src)
    tok = ["--tokenizer", data.tokenizer]
    sources = sorted(c4.glob("c4-*.json.gz"))
    if data.tokenizer != "llama3":  # llama3 ships with llama-models; the others are SentencePiece files
        model = _tokenizer_model(src, data.tokenizer)
        tok += ["--tokenizer-model", str(model)]
        sources.append(model)
    steps = tuple(
        ("data", "prepare", "c4", "--src", str(c4), "--split", split, *tok, "--out", "{out}")
        for split in ("train", "validation")
    )
    return Recipe(f"c4-{data.tokenizer}", f"C4 tokenized with {data.tokenizer}", steps, tuple(sources))


def lora_recipe(tier, src: Path) -> Recipe:
    gov = _govreport_file(src)
    model = _tokenizer_model(src, "llama2")  # GovReport is tokenized with Llama 2 (data/govreport.py)
    # The tiny tiers pick their rows of the shared fixture (`--select tiny`); other tiers take the file.
    select = "tiny" if tier.name == "tiny" else "all"
    steps = tuple(
        ("data", "prepare", "govreport", "--src", str(gov), "--split", split, "--select", select,
         "--block", str(tier.data.block), "--tokenizer-model", str(model), "--out", "{out}")
        for split in ("train", "validation")
    )  # fmt: skip
    return Recipe(
        f"govreport-{select}-{tier.data.block}",
        f"GovReport in {tier.data.block}-token blocks ({select})",
        steps,
        (gov, model),
    )


def cache_name(bench, tier) -> str | None:
    """The cache folder a tier's data is prepared into (what recipe_for would name), without a source."""
    from timetotrain.tasks.causal_lm import LMData
    from timetotrain.tasks.lora_sft import LoRAData

    if isinstance(tier.data, LMData):
        return f"c4-{tier.data.tokenizer}"
    if isinstance(tier.data, LoRAData):
        return f"govreport-{'tiny' if tier.name == 'tiny' else 'all'}-{tier.data.block}"
    if getattr(bench.task, "prepare_data", None) is not None:
        return f"{bench.name}-{tier.name}"
    return None


def recipe_for(bench, tier, src: Path) -> Recipe | None:
    """The recipe of a tier's data from a folder of raw sources, or None when nothing here knows it."""
    from timetotrain.tasks.causal_lm import LMData
    from timetotrain.tasks.lora_sft import LoRAData

    if isinstance(tier.data, LMData):
        return lm_recipe(tier.data, src)
    if isinstance(tier.data, LoRAData):
        return lora_recipe(tier, src)
    prepare = getattr(bench.task, "prepare_data", None)
    if prepare is not None:
        name = f"{bench.name}-{tier.name}"
        return Recipe(name, f"{bench.name} {tier.name} data", (), (src,), lambda out: prepare(tier, src, out))
    return None


def source_record(recipe: Recipe) -> dict:
    """What the data was made from: names and sizes (a changed source file makes the cache stale)."""
    files = []
    for p in recipe.sources:
        st = p.stat()
        files.append({"path": str(p.resolve()), "bytes": st.st_size})
    return {"recipe": recipe.name, "steps": [list(s) for s in recipe.steps], "sources": files}


def cached(cache: Path, recipe_name: str) -> Path | None:
    folder = cache / recipe_name
    return folder if (folder / "source.json").is_file() else None


def is_current(folder: Path, recipe: Recipe) -> bool:
    try:
        return json.loads((folder / "source.json").read_text()) == source_record(recipe)
    except (OSError, ValueError):
        return False
