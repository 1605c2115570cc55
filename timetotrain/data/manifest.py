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


def write_manifest(out_dir: Path, name: str, files: list[Path], info: dict) -> Path:
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
    doc = {"name": name, "files": entries, **info}
    path = manifest_path(out_dir, name)
    fileio.write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(out_dir: Path, name: str) -> dict | None:
    path = manifest_path(out_dir, name)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        doc["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a valid manifest ({e}): re-run `ttt data prepare`") from e
    return doc


def verify_manifest(out_dir: Path, doc: dict) -> None:
    """Size first (cheap, catches truncation), then sha256 of every listed file."""
    for fname, want in doc["files"].items():
        path = out_dir / fname
        if not path.is_file():
            raise UserError(
                f"{path} is listed in the manifest but missing: copy it again or re-run `ttt data prepare`"
            )
        size = path.stat().st_size
        if size != want["bytes"]:
            raise UserError(
                f"{path} has {size} bytes, the manifest says {want['bytes']}: the copy is incomplete; "
                "copy it again or re-run `ttt data prepare`"
            )
    for fname, want in doc["files"].items():
        path = out_dir / fname
        got = sha256_file(path)
        if got != want["sha256"]:
            raise UserError(
                f"{path} checksum mismatch (sha256 {got[:12]}…, manifest {want['sha256'][:12]}…): "
                "the file is corrupt; copy it again or re-run `ttt data prepare`"
            )
