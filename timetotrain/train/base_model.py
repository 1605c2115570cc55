"""`ttt base`: make a tier's base model off the clock, deterministically, and cache it by content hash.

A fine-tuning tier of our own (llama2_70b_lora `tiny`) cannot start from a real pretrained checkpoint on a
laptop, so it starts from a small base pretrained here on the shared C4 sample. The recipe is data
(`spec.benchmark.BaseRecipe`: a pretraining tier of an unlisted benchmark, a seed); this module runs it with the
same model build, optimizer, schedule and training step as a timed run, and writes a Hugging Face folder
(`config.json`, `model.safetensors`) that `ttt run --init-checkpoint` loads and HF/PEFT can load too, plus:

- `vocab_table.npy` when the recipe narrows the vocabulary: raw tokenizer id -> model id, which the
  fine-tuning run applies to its own data so both see the same ids;
- `base.json`: the recipe, the cache key, the data checksums, the final losses and the sha256 of the weights
  and of the table.

Cache key: sha256 of the recipe (tier, optimizer, schedule, seed), the data files' checksums, and the torch
and timetotrain versions. The same key means the same inputs; a second `ttt base` with the same key returns
the cached folder after checking its weights against `base.json`. On one machine with the same thread count
the weights are bitwise reproducible; across machines float reductions may differ (ATen's kernel width, MKL's
code path and thread count), which is why the run that uses a base logs the sha256 of its weights
(`ttt_init_checkpoint_sha256`), not just the key, and why the tiers ship the bits this recipe made once
(`spec.benchmark.ShippedBase`, pinned by sha256): a run without `--init-checkpoint` loads them on every host
(`check_init_base`), and `ttt base` says whether this host reproduced them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from timetotrain import fileio, interrupt
from timetotrain.data import loader, npy
from timetotrain.data.manifest import sha256_file
from timetotrain.data.vocab_table import VOCAB_TABLE
from timetotrain.errors import UserError
from timetotrain.progress import LiveLine
from timetotrain.spec.benchmark import BASES, BaseRecipe, ShippedBase
from timetotrain.spec.task import Share
from timetotrain.train.checkpoint import HF_INDEX
from timetotrain.train.device import cpu_model
from timetotrain.train.step import build_training

BASE_JSON = "base.json"
WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"


def default_cache() -> Path:
    root = os.environ.get("TTT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "timetotrain")
    return Path(root) / "bases"


def cache_key(recipe: BaseRecipe, resolved) -> str:
    """Everything the weights depend on, hashed; the data by the checksums its manifests record."""
    import timetotrain

    bench, tier = recipe.benchmark, recipe.pretraining
    data = {}
    for path in resolved.files():
        data[path.name] = sha256_file(path)
    doc = {
        "benchmark": bench.name,
        "tier": repr(tier),
        "optimizer": repr(bench.optimizer),
        "schedule": bench.schedule,
        "family": bench.family.name,
        "seed": recipe.seed,
        "data": data,
        "torch": torch.__version__,
        "timetotrain": timetotrain.__version__,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def read_base(folder: Path) -> dict | None:
    """`base.json` of a folder `ttt base` wrote, or None for any other checkpoint folder."""
    path = Path(folder) / BASE_JSON
    if not path.is_file():
        return None
    try:
        doc = json.loads(fileio.read_bounded(path, fileio.SMALL_FILE, "base description").decode())
        doc["weights_sha256"], doc["key"]
        bad = [k for k in ("weights_sha256", "vocab_table_sha256") if k in doc and not _is_sha256(doc[k])]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(
            f"{path} is not a valid base description ({e}): make the base again with `ttt base`"
        ) from e
    if bad:
        raise UserError(
            f"{path}: {bad[0]} is not a sha256 (64 hex digits): make the base again with `ttt base`"
        )
    return doc


def _is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def verify_base(folder: Path, pins: dict[str, str] | None = None, fix: str | None = None) -> dict:
    """Check a folder `ttt base` wrote, every file of it: the weights (and vocabulary table) against its
    `base.json`, and against `pins` where a pin outside the folder covers a file (`recipe_pins`); any other
    file is refused, so nothing the loader reads goes unchecked. Returns the description."""
    folder = Path(folder)
    doc = read_base(folder)
    if doc is None:
        raise UserError(f"{folder} has no {BASE_JSON}: it was not written by `ttt base`")
    fix = fix or f"make the base again with `ttt base` and another --cache ({folder} is a cached base)"
    own = {WEIGHTS: doc["weights_sha256"]}
    if doc.get("vocab_table_sha256") is not None:
        own[VOCAB_TABLE] = doc["vocab_table_sha256"]
    for name, want in (pins or {}).items():
        if own.get(name, want) != want:
            raise UserError(
                f"{folder / BASE_JSON} gives {name} sha256 {own[name][:12]}…, the recipe pins {want[:12]}…: "
                f"this is not a base of the recipe; {fix}"
            )
    if not (folder / WEIGHTS).is_file() and (folder / HF_INDEX).is_file():
        raise UserError(
            f"{folder} holds shards but its {BASE_JSON} is not the one the shipped base pins, and a `ttt base` "
            f"folder holds one {WEIGHTS}: {fix}"
        )
    # Unpinned, and allowed: the description itself, and a config no recipe pins (a recipe without a shipped
    # base; the loader checks it against the tier's model, `check_hf_config`).
    check_pinned(
        folder, {**own, **(pins or {})}, f"its {BASE_JSON} or the recipe", fix, (BASE_JSON, HF_CONFIG)
    )
    return doc


def check_pinned(
    folder: Path, pins: dict[str, str], by: str, fix: str, unpinned: tuple[str, ...] = ()
) -> None:
    """Every file of `folder` against its sha256 in `pins` (`by` says who pins it), before anything parses
    it: a missing or changed file, or one no pin covers (which a loader might read: a second weights file,
    an index), is refused in one line ending in `fix`. `unpinned`: names allowed without a pin."""
    for name, want in pins.items():
        path = folder / name
        got = sha256_file(path) if path.is_file() else None
        if got != want:
            found = "is missing" if got is None else f"has sha256 {got[:12]}…"
            raise UserError(f"{path} {found}, {by} pins {want[:12]}…: {fix}")
    for path in sorted(folder.iterdir()):
        if path.name not in pins and path.name not in unpinned:
            raise UserError(f"{path} is not a file of the base ({by} pins {', '.join(pins)}): {fix}")


def make_base(
    recipe: BaseRecipe, data_dir: Path, cache: Path | None = None, device: str = "cpu", echo: bool = True
) -> tuple[Path, dict, bool]:
    """Run the recipe (or find it cached). Returns (folder, base.json, cached)."""
    bench, tier = recipe.benchmark, recipe.pretraining
    family = bench.family
    if family.hf_export is None:
        raise UserError(f"the {family.name} family cannot write a Hugging Face checkpoint (no hf_export)")
    data_dir = Path(data_dir)
    try:
        resolved = bench.task.resolve(tier, data_dir, verify=True)
    except UserError as e:
        raise UserError(f"{e} (the base pretrains on: {recipe.data_hint})") from e
    key = cache_key(recipe, resolved)
    cache = Path(cache) if cache is not None else default_cache()
    folder = cache / f"{bench.name}-{tier.name}-{key[:16]}"
    if folder.is_dir() and read_base(folder) is not None:
        return folder, verify_base(folder), True
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--cache {cache} is not writable ({e.strerror}): choose another folder") from e

    t0 = time.monotonic()
    dev = torch.device(device)
    torch.manual_seed(recipe.seed)
    tr = build_training(bench, tier, dev, recipe.seed)
    data = bench.task.open(tier, resolved, recipe.seed, Share.of(tier.global_batch_size), dev)
    live = LiveLine() if echo else None
    what = f"base {bench.name}/{tier.name}"
    if live:
        live.update(f"{what}: pretraining {tier.max_steps} steps", force=True)
    losses = []
    try:
        t_steps = time.monotonic()
        for step in range(tier.max_steps):
            batch = {k: v.to(dev) for k, v in data.batch(step).items()}
            losses.append(tr.step(step, batch, bench.grad_accum(tier), data.loss)[0])
            # The first step at once (it says the run is moving and how long a step takes), then as often
            # as the line allows; the loss is read off the device only for a line that prints.
            if live and (step == 0 or live.due()):
                live.update(
                    _base_progress(what, step + 1, tier.max_steps, losses[-1].item(), t_steps), force=True
                )
        if live:
            live.update(f"{what}: evaluating on {tier.eval_samples:,} samples", force=True)
        eval_loss = data.evaluate(tr.model)
    finally:
        if live:
            live.close()
        data.close()
    train_losses = torch.stack(losses).tolist()

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted `ttt base`
    partial.mkdir(parents=True)
    try:
        state, config = family.hf_export(
            {k: v.detach().cpu() for k, v in tr.bare.state_dict().items()}, tier.model
        )
        from safetensors.torch import save_file

        save_file(state, partial / WEIGHTS, metadata={"format": "pt"})
        fileio.write_text(partial / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        doc = {
            "benchmark": bench.name,
            "tier": tier.name,
            "seed": recipe.seed,
            "key": key,
            "steps": tier.max_steps,
            "tokens": tier.max_steps * tier.global_batch_size * bench.task.sample_items(tier)[1],
            "final_train_loss": train_losses[-1],
            "mean_train_loss_last_10": float(np.mean(train_losses[-10:])),
            "eval_loss": eval_loss,
            "eval_samples": tier.eval_samples,
            "seconds": round(time.monotonic() - t0, 1),
            "device": str(dev),
            "threads": torch.get_num_threads(),
            # What the bits depend on besides the inputs (the kernels ATen and MKL pick for this CPU).
            "cpu": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__,
            "data": str(data_dir.resolve()),
            "weights_sha256": sha256_file(partial / WEIGHTS),
        }
        keep = getattr(tier.data, "vocab_keep", None)
        if keep:
            with fileio.atomic_write(partial / VOCAB_TABLE, "wb") as f:
                npy.save(f, loader.vocab_table(resolved.counts_file, keep).numpy())
            doc["vocab_keep"] = keep
            doc["vocab_table_sha256"] = sha256_file(partial / VOCAB_TABLE)
        fileio.write_text(partial / BASE_JSON, json.dumps(doc, indent=2, sort_keys=True) + "\n")
        # A signal during the rename is raised after it (the base is then complete and says so).
        with interrupt.deferred():
            os.replace(partial, folder)  # complete or absent: a crash leaves only the .partial
            fileio.fsync_dir(folder.parent)
            fileio.COMPLETED.append(folder)
    except BaseException:  # an error or a signal (raised as Interrupted under `ttt base`): no half folder
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return folder, doc, False


def _base_progress(what: str, done: int, total: int, loss: float, t_steps: float) -> str:
    """`ttt base`'s line: the step, its loss, the time so far and what is left (steps left x the mean step
    time so far)."""
    elapsed = time.monotonic() - t_steps
    eta = (total - done) * elapsed / done
    return f"{what}: step {done}/{total}  loss {loss:.4f}  [{_clock(elapsed)} elapsed, ETA {_clock(eta)}]"


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class InitBase(NamedTuple):
    """Where a run's starting weights come from: the folder, the sha256 to log (None for a checkpoint not
    made by `ttt base`, whose hash would take minutes to compute at 70B), the shipped base's name when the
    tier's own was used, and a note for the user (a base of this recipe other than the shipped one)."""

    folder: Path | None
    sha256: str | None
    shipped: str | None = None
    note: str | None = None


def shipped_base(recipe: BaseRecipe) -> Path:
    """The shipped folder of `recipe`, each file checked against its pinned sha256 before anything parses
    it: a missing, changed or extra file is refused (the package was damaged or edited)."""
    s = recipe.shipped
    fix = "reinstall timetotrain, or pass a base you made with `ttt base` as --init-checkpoint"
    check_pinned(s.folder, dict(s.sha256), f"the shipped base {s.name}", fix)
    return s.folder


def recipe_pins(recipe: BaseRecipe | None) -> dict[str, str]:
    """The pins, outside any base folder, of the files every base of `recipe` must carry byte for byte: the
    config and the vocabulary table depend on the recipe and its data only, not on the host's float
    rounding (tests/test_shipped_bases.py remakes them), so the shipped base's pins cover them in any base
    of the recipe. The weights differ by host: a base of other bits is covered by its own base.json."""
    if recipe is None or recipe.shipped is None:
        return {}
    pins = dict(recipe.shipped.sha256)
    return {name: pins[name] for name in (HF_CONFIG, VOCAB_TABLE) if name in pins}


def check_init_base(bench, tier, folder: Path | None) -> InitBase:
    """Preflight of a run's base. A tier with a base recipe starts from its shipped base (checked against
    the pinned sha256s) unless `--init-checkpoint` names another; without a shipped base it needs the
    folder `ttt base` made. A folder with a base.json is a base: the shipped one or a copy when its base.json
    is the pinned one (then every file is checked against the pins), else a `ttt base` folder (checked
    against its base.json and the recipe's pins, `verify_base`)."""
    recipe = tier.base
    if folder is None:
        if recipe is not None and recipe.shipped is not None:
            return InitBase(shipped_base(recipe), recipe.shipped.weights_sha256, recipe.shipped.name)
        if recipe is not None:
            raise UserError(
                f"{bench.name} --tier {tier.name} fine-tunes a base model: make it with `ttt base {bench.name} "
                f"--tier {tier.name} --data DIR` ({recipe.data_hint}) and pass the folder it prints with "
                "--init-checkpoint"
            )
        return InitBase(None, None)
    folder = Path(folder)
    doc = read_base(folder)
    if doc is None:
        return InitBase(folder, None)
    if recipe is not None and (doc.get("benchmark"), doc.get("tier")) != (recipe.benchmark.name, recipe.tier):
        raise UserError(
            f"--init-checkpoint {folder} is the base of {doc.get('benchmark')} {doc.get('tier')}, this tier needs "
            f"{recipe.benchmark.name} {recipe.tier}: run `ttt base {bench.name} --tier {tier.name}`"
        )
    s = recipe.shipped if recipe is not None else None
    fix = _init_fix(folder, s)
    if s is not None and sha256_file(folder / BASE_JSON) == dict(s.sha256).get(BASE_JSON):
        check_pinned(folder, dict(s.sha256), f"the shipped base {s.name}", fix)
        return InitBase(folder, s.weights_sha256, s.name)
    sha = verify_base(folder, recipe_pins(recipe), fix)["weights_sha256"]
    return InitBase(folder, sha, note=_differs(recipe, sha))


def _init_fix(folder: Path, shipped: ShippedBase | None) -> str:
    """What to do about a damaged `--init-checkpoint` base: never delete anything, least of all inside the
    installed package (the shipped folder itself, passed by its path)."""
    if folder.resolve().is_relative_to(BASES.resolve()):
        return "reinstall timetotrain, or leave out --init-checkpoint"
    if shipped is not None:
        return (
            f"leave out --init-checkpoint to use the shipped base {shipped.name}, copy it again, or pass a "
            "base `ttt base` made"
        )
    return "make the base again with `ttt base` (into a new --cache) and pass the folder it prints"


def _differs(recipe: BaseRecipe | None, sha: str) -> str | None:
    """A note when a base of the recipe is not the shipped one: the tier's target and RCP were set on the
    shipped bits, and this host (or thread count) rounded the recipe differently."""
    if recipe is None or recipe.shipped is None or sha == recipe.shipped.weights_sha256:
        return None
    return (
        f"note: this base (sha256 {sha[:12]}…) is not the shipped {recipe.shipped.name} "
        f"({recipe.shipped.weights_sha256[:12]}…), on whose bits the tier's target and RCP were set; another "
        "CPU or thread count rounds the recipe differently. Leave out --init-checkpoint to use the shipped one."
    )
