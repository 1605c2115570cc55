"""Manifests of prepared data: what was produced, from what, with which tokenizer, and checksums.

A run verifies every file its manifest lists before `init_start` so a partial copy or a bit flip is found
in seconds, not hours into a run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from timetotrain import fileio
from timetotrain.errors import UserError


def ensure_writable(out: Path) -> None:
    """Create `out` and prove a file can be written there, before any work: `--out` is the flag that names it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".ttt-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--out {out} is not writable ({e.strerror}): choose another directory") from e


_CHUNK = 8 << 20


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


def manifest_path(out_dir: Path, name: str) -> Path:
    return out_dir / f"{name}.manifest.json"


def write_manifest(
    out_dir: Path, name: str, files: list[Path], info: dict, staged: fileio.Staged | None = None
) -> Path:
    """The manifest of `files` (their final names); with `staged`, files not yet renamed into place are
    hashed under their temporary names and the manifest itself joins the staged set."""
    where = staged.current if staged is not None else Path
    entries = {}
    for p in files:
        src = where(p)
        # A plain name, or a path into a subfolder of `out_dir` (a `nested` manifest).
        key = Path(p).relative_to(out_dir).as_posix() if Path(p).is_relative_to(out_dir) else Path(p).name
        entries[key] = {"bytes": src.stat().st_size, "sha256": sha256_file(src)}
    doc = {"name": name, "files": entries, **info}
    path = manifest_path(out_dir, name)
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if staged is not None:
        staged.write_text(path, text)
    else:
        fileio.write_text(path, text)
    return path


# What a user should do about a missing, truncated or corrupt data file. Never "copy it over the old one":
# `cp` onto an existing name truncates and rewrites that file in place, under any run that has it mapped
# (which then dies of SIGBUS, or reads a mix of old and new tokens). A new name, or ttt's own prepare (which
# writes temporaries and renames them), leaves the old file intact for whoever still reads it.
REPREPARE = "re-run `ttt data prepare` (it writes new files and renames them into place)"
RECOPY = f"copy the prepared folder again into a new folder and pass that as --data, or {REPREPARE}"


def read_manifest(out_dir: Path, name: str, tokenized: bool = True, nested: bool = False) -> dict | None:
    """The manifest `name` in `out_dir`, checked for the fields a run relies on; None when there is none.
    `tokenized`: the data was made by a tokenizer, which the manifest must name. `nested`: file names may be
    relative paths into subfolders (a graph's `paper/node_feat.npy`), never out of `out_dir`."""
    path = manifest_path(out_dir, name)
    if not path.exists():
        return None
    try:
        doc = json.loads(fileio.read_bounded(path, fileio.SMALL_FILE, "manifest").decode("utf-8"))
        problem = manifest_problem(doc, tokenized, nested)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
    if problem:
        raise UserError(f"{path} is not a valid manifest: {problem}; {REPREPARE}")
    return doc


def _plain_name(fname: str, nested: bool) -> bool:
    parts = fname.split("/") if nested else [fname]
    return bool(fname) and all(p and Path(p).name == p and p not in (".", "..") for p in parts)


def manifest_problem(doc, tokenized: bool = True, nested: bool = False) -> str:
    """Why `doc` is not a manifest as `write_manifest` writes it ('' when it is)."""
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        return "no `files` object"
    for fname, entry in files.items():
        # A listed name outside the folder would let a manifest make us hash (and trust) any file.
        if not _plain_name(fname, nested):
            return f"file name {fname!r} is not a plain name in the folder"
        if not isinstance(entry, dict):
            return f"`files.{fname}` is not an object"
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"`files.{fname}.bytes` is missing or not a byte count"
        if not isinstance(digest, str) or len(digest) != 64:
            return f"`files.{fname}.sha256` is missing or not a sha256"
    tok = doc.get("tokenizer")
    if tokenized and (not isinstance(tok, dict) or not isinstance(tok.get("name"), str)):
        return "no `tokenizer.name`"
    return ""


def verify_manifest(out_dir: Path, doc: dict) -> None:
    """Size first (cheap, catches truncation), then sha256 of every listed file."""
    for fname, want in doc["files"].items():
        path = out_dir / fname
        if not path.is_file():
            raise UserError(f"{path} is listed in the manifest but missing: {RECOPY}")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise UserError(
                f"{path} has {size} bytes, the manifest says {want['bytes']}: the copy is incomplete; {RECOPY}"
            )
    for fname, want in doc["files"].items():
        path = out_dir / fname
        got = sha256_file(path)
        if got != want["sha256"]:
            raise UserError(
                f"{path} checksum mismatch (sha256 {got[:12]}…, manifest {want['sha256'][:12]}…): "
                f"the file is corrupt; {RECOPY}"
            )
