"""`ttt suite`'s ETA before a benchmark's first run: how long this machine's own earlier runs of the same code
and tier took (docs/terminal.md).

The run times are kept in the user's own cache, `$XDG_CACHE_HOME/timetotrain/run_seconds.json` (default
`~/.cache/timetotrain/`), never in `--cache`/`$TTT_CACHE`, the prepared-data cache a team may share. Each
entry is keyed by the user (uid), the host, the code (ttt's version and a hash of its sources: an edit that
is not committed changes the speed as much as one that is), the benchmark and tier, and the `ttt run` flags
the suite adds (precision, device, ...). A run time made by another user, host, commit or flag set is
never used: where none matches, the ETA says "no earlier run on this machine" instead of a number.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
from pathlib import Path

from timetotrain import fileio
from timetotrain.cli.doctor import version

KEEP = 5  # the latest runs per key: recent enough to follow the machine, enough to average a hiccup away


def history_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "timetotrain" / "run_seconds.json"


@functools.cache
def code_identity() -> str:
    """ttt's version and the sha256 of its Python sources (names and bytes), 12 hex digits."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return f"{version()}+{h.hexdigest()[:12]}"


def history_key(
    bench: str, tier: str, flags: list[str], uid: int | None = None, host: str | None = None
) -> str:
    uid = os.getuid() if uid is None else uid
    host = socket.gethostname() if host is None else host
    return f"{bench}/{tier} uid={uid} host={host} code={code_identity()} flags={' '.join(flags)}"


class RunHistory:
    """Run seconds by key, in one small JSON file; anything unreadable or of the wrong shape is no history."""

    def __init__(self, path: Path | None = None):
        self.path = path or history_path()

    def read(self) -> dict[str, list[float]]:
        try:
            doc = json.loads(fileio.read_bounded(self.path, fileio.SMALL_FILE, "run history").decode())
        except (OSError, ValueError):
            return {}
        if not isinstance(doc, dict):
            return {}
        return {
            k: v
            for k, v in doc.items()
            if isinstance(v, list) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
        }

    def seconds(self, key: str) -> list[float]:
        return self.read().get(key, [])[-KEEP:]

    def remember(self, key: str, seconds: float) -> None:
        """Best effort: a history that cannot be written costs an ETA, never the suite."""
        hist = self.read()
        hist[key] = (hist.get(key, []) + [seconds])[-KEEP:]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fileio.write_text(self.path, json.dumps(hist, indent=1) + "\n")
        except OSError:
            pass
