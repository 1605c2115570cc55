"""`ttt base`: make a tier's base model off the clock, deterministically, and cache it by content hash.

A fine-tuning tier of our own (llama2_70b_lora `tiny`) cannot start from a real pretrained checkpoint on a
laptop, so it starts from a small base pretrained here on the shared C4 sample. The recipe is data
(`suite.base.BaseRecipe`: a pretraining tier of an unlisted benchmark, a seed); this module runs it with the
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
(`suite.base.ShippedBase`, pinned by sha256): a run without `--init-checkpoint` loads them on every host
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
from timetotrain.suite.base import BaseRecipe
from timetotrain.train.device import cpu_model
from timetotrain.train.step import build_training

BASE_JSON = "base.json"
WEIGHTS = "model.safetensors"


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
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(
            f"{path} is not a valid base description ({e}): make the base again with `ttt base`"
        ) from e
    return doc


def verify_base(folder: Path) -> dict:
    """Check the weights (and vocabulary table) against `base.json`; returns the description."""
    doc = read_base(folder)
    if doc is None:
        raise UserError(f"{folder} has no {BASE_JSON}: it was not written by `ttt base`")
    for name, key in ((WEIGHTS, "weights_sha256"), (VOCAB_TABLE, "vocab_table_sha256")):
        want = doc.get(key)
        if want is None:
            continue
        path = Path(folder) / name
        if not path.is_file() or sha256_file(path) != want:
            raise UserError(
                f"{path} does not match {BASE_JSON} ({key}): the base is damaged; delete {folder} and run "
                "`ttt base` again"
            )
    return doc


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
    data = bench.task.open(tier, resolved, recipe.seed, 0, 1, dev)
    live = LiveLine() if echo else None
    what = f"base {bench.name}/{tier.name}"
    if live:
        live.update(f"{what}: pretraining {tier.max_steps} steps", force=True)
    losses = []
    try:
        t_steps = time.monotonic()
        for step in range(tier.max_steps):
            batch = {k: v.to(dev) for k, v in data.batch(step).items()}
            losses.append(tr.step(step, batch, tier.grad_accum, data.loss)[0])
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
    """The shipped folder of `recipe`, each pinned file checked against its sha256 before anything parses
    it: a missing or changed file is refused (the package was damaged or edited)."""
    s = recipe.shipped
    for name, want in s.sha256:
        path = s.folder / name
        got = sha256_file(path) if path.is_file() else None
        if got != want:
            found = "is missing" if got is None else f"has sha256 {got[:12]}…"
            raise UserError(
                f"{path} {found}, the shipped base {s.name} pins {want[:12]}…: reinstall timetotrain, or pass "
                f"a base you made with `ttt base` as --init-checkpoint"
            )
    return s.folder


def check_init_base(bench, tier, folder: Path | None) -> InitBase:
    """Preflight of a run's base. A tier with a base recipe starts from its shipped base (checked against
    the pinned sha256s) unless `--init-checkpoint` names another; without a shipped base it needs the
    folder `ttt base` made. A `ttt base` folder is checked against its `base.json`."""
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
    doc = read_base(folder)
    if doc is None:
        return InitBase(folder, None)
    if recipe is not None and (doc.get("benchmark"), doc.get("tier")) != (recipe.benchmark.name, recipe.tier):
        raise UserError(
            f"--init-checkpoint {folder} is the base of {doc.get('benchmark')} {doc.get('tier')}, this tier needs "
            f"{recipe.benchmark.name} {recipe.tier}: run `ttt base {bench.name} --tier {tier.name}`"
        )
    sha = verify_base(folder)["weights_sha256"]
    return InitBase(folder, sha, note=_differs(recipe, sha))


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
