"""Atomic writes: the target holds all of the new content or the old one, never a half; no temporary file
is left behind; and every module writes through the one helper."""

import errno
import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from timetotrain import fileio


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(fileio.TMP_SUFFIX))


def test_write_text_replaces_whole_file(tmp_path):
    p = tmp_path / "a.json"
    fileio.write_text(p, "old\n")
    fileio.write_text(p, "new\n")
    assert p.read_text() == "new\n"
    assert leftovers(tmp_path) == []
    umask = os.umask(0o022)
    os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~umask


def test_error_inside_block_keeps_old_content(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("old")
    with pytest.raises(RuntimeError), fileio.atomic_write(p) as f:
        f.write("half of the new")
        raise RuntimeError("crash mid-write")
    assert p.read_text() == "old"
    assert leftovers(tmp_path) == []


def test_full_disk_at_fsync_keeps_old_content(tmp_path, monkeypatch):
    p = tmp_path / "counts.npy"
    fileio.write_bytes(p, b"old")

    def enospc(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.os, "fsync", enospc)
    with pytest.raises(OSError, match="No space"), fileio.atomic_write(p, "wb") as f:
        np.save(f, np.arange(10))
    monkeypatch.undo()
    assert p.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_perms_and_copy(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    fileio.copy_file(src, tmp_path / "dst.bin")
    assert (tmp_path / "dst.bin").read_bytes() == src.read_bytes()
    fileio.write_text(tmp_path / "run.sh", "#!/bin/sh\n", perms=0o755)
    assert (tmp_path / "run.sh").stat().st_mode & 0o777 == 0o755


# Writing a file in place, outside fileio: `.write_text(`, `.write_bytes(`, `open(..., "w"...)`, `np.save(path`,
# `savefig(path`, `shutil.copy*` (a `fileio.Staged` object's `staged.write_text(` is fileio's own). The allowed
# exceptions write to names that are renamed into place later.
_IN_PLACE = re.compile(
    r"(?<!fileio)(?<!staged)\.write_text\(|(?<!fileio)(?<!staged)\.write_bytes\(|(?<![\w.])open\([^)]*,\s*\"[wax]b?\"|\.open\(\s*\"[wax]|np\.save\((?!f\b)|savefig\((?!f\b)|shutil\.copy"
)
_ALLOWED = {
    "timetotrain/fileio.py",  # the helper itself
    "timetotrain/data/indexed.py",  # IndexedWriter: temporary names, renamed by close()
    "timetotrain/data/manifest.py",  # ensure_writable's empty probe file, removed at once
    "timetotrain/mlperf/logger.py",  # the live result log grows during the run (see its docstring)
    "timetotrain/data/download.py",  # appends to `<name>.part` (resumable), renamed once verified
}


def test_every_module_writes_through_fileio():
    offenders = []
    for path in sorted((REPO / "timetotrain").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in _ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _IN_PLACE.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == [], "write through timetotrain.fileio:\n" + "\n".join(offenders)


def test_staged_outputs_appear_together_or_not_at_all(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "a.json"
    a.write_bytes(b"old a")
    with pytest.raises(RuntimeError), fileio.Staged() as staged:
        with staged.open(a, "wb") as f:
            f.write(b"new a")
        staged.write_text(b, "{}")
        assert staged.current(a).read_bytes() == b"new a" and not b.exists()
        raise RuntimeError("interrupted before the set was complete")
    assert a.read_bytes() == b"old a" and not b.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]  # no temporaries left
    with fileio.Staged() as staged:
        with staged.open(a, "wb") as f:
            f.write(b"new a")
        staged.write_text(b, "{}")
    assert a.read_bytes() == b"new a" and b.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "a.json"]
