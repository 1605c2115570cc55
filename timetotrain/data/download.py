"""`ttt data download`: C4 shards from the Hugging Face hub (or a mirror) and MLCommons datasets from the
storage metadata their download scripts read.

Every file is fetched into `<name>.part` and renamed only once complete and verified, so a file that
exists is whole. A `.part` left by an interrupted download is continued with an HTTP Range request (or
from its offset, for file:// and local mirrors); a dropped connection is retried from where it stopped.

MLCommons metadata: `<dataset>.uri` holds the base URL of the dataset's files; `<dataset>.md5`, in the
same folder as the .uri, lists `<md5>  <relative path>` lines (md5sum's format). Each file is fetched from
`<base>/<relative path>` into OUT/<relative path> and checked against its md5. Metadata fetched over
HTTP(S) may only name http(s) files (never file:// or a local path), and no listed path may resolve
outside OUT (`..`, an absolute path, or a symlink under OUT).

C4 from a mirror (a URL, file:// URL or folder laid out as the hub repository: en/c4-<split>.*.json.gz):
the mirror has no checksums, so each shard is verified by decompressing it (gzip's CRC-32 and length). From
the hub, each shard's sha256 is the one the hub records for its LFS object.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from timetotrain import fileio, trees
from timetotrain.errors import UserError
from timetotrain.progress import LiveLine

C4_REPO = "allenai/c4"
C4_SHARDS = {"train": 1024, "validation": 8}
CHUNK = 1 << 20
RETRIES = 5


class Progress:
    """Bytes done across parallel downloads, as one live line."""

    def __init__(self, what: str, total: int | None = None):
        self.what, self.total, self.done = what, total, 0
        self.lock = threading.Lock()
        self.line = LiveLine()
        self.t0 = time.monotonic()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            rate = self.done / max(time.monotonic() - self.t0, 1e-9) / 1e6
            of = f" / {self.total / 1e6:,.1f}" if self.total else ""
            self.line.update(f"{self.what}: {self.done / 1e6:,.1f}{of} MB  {rate:,.1f} MB/s")

    def close(self) -> None:
        self.line.close()


def _local_path(url: str) -> Path | None:
    if url.startswith("file://"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    if "://" not in url:
        return Path(url)
    return None


def _control(text: str) -> str | None:
    """The first control character of `text` (a NUL byte above all), which no path or URL may hold: the OS
    refuses it in a path and http.client in a URL, each with a ValueError traceback."""
    return next((c for c in text if ord(c) < 0x20 or ord(c) == 0x7F), None)


def read_text(url: str) -> str:
    """A metadata file (`.uri`, `.md5`), local or served, read with a bound (fileio.SMALL_FILE)."""
    local = _local_path(url)
    bad = _control(str(local) if local is not None else url)
    if bad is not None:
        raise UserError(f"{url}: the path holds the control character {bad!r}: check the URL")
    try:
        if local is not None:
            raw = fileio.read_bounded(local, fileio.SMALL_FILE, "metadata file")
        else:
            raw = _read_whole(url)
            if len(raw) > fileio.SMALL_FILE:
                raise UserError(f"{url} serves more than {fileio.SMALL_FILE >> 20} MiB: not a metadata file")
        return raw.decode()
    except urllib.error.HTTPError as e:
        raise UserError(f"{url}: HTTP {e.code} {e.reason}: check the URL") from e
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"{url}: cannot be read ({getattr(e, 'reason', None) or e}): check the URL") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{url}: not UTF-8 text (byte {e.start}): not a metadata file") from None


def _read_whole(url: str) -> bytes:
    """A served metadata file, read again while the connection closes before its Content-Length: a `.md5`
    list cut short would otherwise name fewer files, or a cut path, and the download would look complete."""
    for attempt in range(RETRIES + 1):
        with urllib.request.urlopen(url, timeout=60) as r:
            expected = r.headers.get("Content-Length")
            raw = r.read(fileio.SMALL_FILE + 1)
        if not (expected or "").isdigit() or len(raw) >= int(expected) or len(raw) > fileio.SMALL_FILE:
            return raw
        if attempt < RETRIES:
            time.sleep(min(2**attempt * 0.1, 5.0))
    raise UserError(
        f"{url}: the connection closed after {len(raw)} of {expected} bytes, {RETRIES} times: run again"
    )


def fetch(url: str, dest: Path, progress: Progress | None = None) -> Path:
    """Download url into dest, continuing `dest.part` if one is there. Returns dest (not yet verified)."""
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    local = _local_path(url)
    for attempt in range(RETRIES + 1):
        have = part.stat().st_size if part.exists() else 0
        try:
            if local is not None:
                _copy_from(local, part, have, progress)
            else:
                _http_from(url, part, have, progress)
            part.rename(dest)
            return dest
        except UserError:
            raise
        except (OSError, urllib.error.URLError, ConnectionError) as e:
            if isinstance(e, FileNotFoundError) and local is not None:
                raise UserError(f"{url}: no such file: check the mirror or metadata URL") from e
            if attempt == RETRIES:
                raise UserError(
                    f"{url}: download failed after {RETRIES} retries ({e}); run the command again to resume"
                ) from e
            time.sleep(min(2**attempt * 0.1, 5.0))
    raise AssertionError("unreachable")


def _copy_from(src: Path, part: Path, offset: int, progress: Progress | None) -> None:
    with src.open("rb") as f, part.open("ab") as out:
        f.seek(offset)
        while chunk := f.read(CHUNK):
            out.write(chunk)
            if progress:
                progress.add(len(chunk))


def _http_from(url: str, part: Path, offset: int, progress: Progress | None) -> None:
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    req = urllib.request.Request(url, headers=headers)
    try:
        r = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:  # the part is already whole
            return
        if e.code in (500, 502, 503, 504):
            raise ConnectionError(f"HTTP {e.code}") from e
        raise UserError(f"{url}: HTTP {e.code} {e.reason}: check the URL, mirror or metadata") from e
    with r:
        mode = "ab" if offset and r.status == 206 else "wb"  # 200: the server ignored Range; start over
        expected = r.headers.get("Content-Length")
        got = 0
        with part.open(mode) as out:
            while chunk := r.read(CHUNK):
                out.write(chunk)
                got += len(chunk)
                if progress:
                    progress.add(len(chunk))
        if expected is not None and got < int(expected):
            raise ConnectionError(f"connection closed after {got} of {expected} bytes")


def file_digest(path: Path, algo: str) -> str:
    h = hashlib.new(algo)
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _reject(path: Path, why: str) -> None:
    """A file that fails its check is moved aside (not resumed from: its bytes are wrong)."""
    bad = path.with_name(path.name + ".corrupt")
    os.replace(path, bad)
    raise UserError(f"{path}: {why}; moved to {bad.name}: run the command again to download it afresh")


def verify_digest(path: Path, algo: str, expected: str) -> None:
    got = file_digest(path, algo)
    if got != expected.lower():
        _reject(path, f"{algo} {got} does not match the expected {expected}")


def verify_gzip(path: Path) -> None:
    try:
        with gzip.open(path, "rb") as f:
            while f.read(CHUNK):
                pass
    except (OSError, EOFError, zlib.error) as e:
        _reject(path, f"not a whole gzip file ({e})")


# -- MLCommons storage --


def parse_md5_list(text: str, source: str) -> list[tuple[str, str]]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        digest, _, rel = line.strip().partition(" ")
        rel = rel.strip().lstrip("*").removeprefix("./")
        if len(digest) != 32 or not all(c in "0123456789abcdefABCDEF" for c in digest) or not rel:
            raise UserError(f"{source} line {n}: expected '<md5>  <path>', got {line.strip()[:80]!r}")
        bad = _control(rel)
        if bad is not None:
            raise UserError(
                f"{source} line {n}: path {rel!r} holds the control character {bad!r}: fix the list (no file name holds one)"
            )
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise UserError(f"{source} line {n}: path {rel!r} leaves the download folder")
        out.append((digest.lower(), rel))
    if not out:
        raise UserError(f"{source}: no files listed")
    return out


_REMOTE = ("http", "https")


def _scheme(url: str) -> str:
    """ "http"/"https"/"ftp"/... for a URL, "file" for a file:// URL or a local path."""
    return "file" if _local_path(url) is not None else urllib.parse.urlparse(url).scheme.lower()


def _check_base(metadata: str, base: str) -> None:
    """Served metadata may only name served files: a `.uri` fetched over HTTP(S) whose base is a file://
    URL, a local path or another scheme would have the download copy files of this machine into --out."""
    if _scheme(metadata) == "file":
        return  # the user's own file: whatever it names, they chose
    if _scheme(metadata) not in _REMOTE or _scheme(base) not in _REMOTE:
        raise UserError(
            f"--metadata {metadata}: its base URL {base!r} is not an http(s) URL; metadata served over "
            f"{_scheme(metadata)} may only point at http(s) files (a local copy of the .uri may name a folder)"
        )


def _inside(root: Path, dest: Path, listing: str) -> None:
    """`dest` (which need not exist yet) stays in the resolved --out: no symlinked folder under --out may
    redirect a download elsewhere."""
    target = trees.outside(dest, root)
    if target is not None:
        raise UserError(
            f"{listing}: {dest} resolves to {target}, outside --out {root} (a symlink in --out?); "
            "refusing to write there: remove the link or choose a new --out"
        )


def download_mlcommons(metadata: str, out: Path, workers: int = 4) -> list[Path]:
    if not metadata.endswith(".uri"):
        raise UserError(f"--metadata {metadata}: expected the dataset's .uri metadata file (…/<dataset>.uri)")
    base = read_text(metadata).strip().rstrip("/")
    if not base:
        raise UserError(f"--metadata {metadata}: empty: it should hold the dataset's base URL")
    bad = _control(base)
    if bad is not None:
        raise UserError(
            f"--metadata {metadata}: its base URL {base!r} holds the control character {bad!r}: fix the .uri file"
        )
    _check_base(metadata, base)
    name = metadata.rsplit("/", 1)[-1].removesuffix(".uri")
    md5_url = metadata.rsplit("/", 1)[0] + f"/{name}.md5" if "/" in metadata else f"{name}.md5"
    entries = parse_md5_list(read_text(md5_url), md5_url)
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(f"{name}: {len(entries)} files")

    root = out.resolve()
    for _, rel in entries:  # all checked before the first byte is written
        _inside(root, out / rel, md5_url)

    def one(entry: tuple[str, str]) -> Path:
        digest, rel = entry
        dest = out / rel
        if dest.exists() and file_digest(dest, "md5") == digest:
            return dest  # finished by an earlier call
        if dest.exists():
            dest.unlink()
        fetch(f"{base}/{urllib.parse.quote(rel)}", dest, progress)
        verify_digest(dest, "md5", digest)
        return dest

    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(one, entries))
    finally:
        progress.close()


# -- C4 --


def c4_names(split: str, shards: int) -> list[str]:
    total = C4_SHARDS[split]
    if not 1 <= shards <= total:
        raise UserError(f"--shards {shards}: allenai/c4 en {split} has {total} shards: pass 1 to {total}")
    return [f"c4-{split}.{i:05d}-of-{total:05d}.json.gz" for i in range(shards)]


def download_c4(
    split: str, shards: int, out: Path, mirror: str | None = None, workers: int = 4
) -> list[Path]:
    names = c4_names(split, shards)
    out.mkdir(parents=True, exist_ok=True)
    if mirror is None:
        return _c4_from_hub(names, out)
    local = _local_path(mirror)
    if local is not None and not local.is_dir():
        raise UserError(f"--mirror {mirror}: not a folder: pass a URL, file:// URL or a folder with en/")
    root = mirror.rstrip("/")
    if local is not None and not (local / "en").is_dir():  # a folder holding the shards themselves
        sub = ""
    else:
        sub = "/en"
    progress = Progress(f"c4 {split}: {len(names)} shards")

    def one(name: str) -> Path:
        dest = out / name
        if dest.exists():
            return dest  # renamed into place only after it was verified
        tmp = out / (name + ".unverified")
        if tmp.exists():
            tmp.unlink()
        fetch(f"{root}{sub}/{name}", tmp, progress)
        verify_gzip(tmp)
        tmp.rename(dest)
        return dest

    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(one, names))
    finally:
        progress.close()


def _c4_from_hub(names: list[str], out: Path) -> list[Path]:
    """huggingface_hub resumes and shows its own progress bar; the sha256 the hub records for each LFS
    object is then checked here."""
    try:
        from huggingface_hub import HfApi, hf_hub_download  # optional: only c4 from the hub, not --mirror
    except ImportError as e:
        raise UserError("downloading from the hub needs huggingface_hub: pip install huggingface_hub") from e
    paths = [f"en/{n}" for n in names]
    try:
        infos = {i.path: i for i in HfApi().get_paths_info(C4_REPO, paths, repo_type="dataset")}
        done = []
        for p in paths:
            local = Path(hf_hub_download(C4_REPO, p, repo_type="dataset", local_dir=out))
            lfs = getattr(infos.get(p), "lfs", None)
            if lfs is not None:
                verify_digest(local, "sha256", lfs.sha256)
            else:
                verify_gzip(local)
            dest = out / Path(p).name
            if local != dest:
                shutil.move(local, dest)
            done.append(dest)
        return done
    except UserError:
        raise
    except Exception as e:  # network or hub errors: one line, the command resumes when run again
        raise UserError(
            f"allenai/c4 from the hub: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
            "(no network? pass --mirror URL|DIR)"
        ) from e
