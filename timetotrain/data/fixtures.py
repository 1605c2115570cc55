"""`ttt data download fixtures`: the small real data the tiny tiers run on, rebuilt from public sources.

The tiny tiers (and their RCPs) were measured on six small files (the layout of the project's shared data
folder, which a user of the repository does not have). Each comes out of a public GitHub repository at a
pinned commit: four copied as they are or with a field renamed, two rebuilt by a fixed procedure. Every
source file is checked against its sha256 before use, and every output against the sha256 of the file
the tiers were measured on, so what this writes is that data byte for byte:

- `c4/en/c4-validation.00000-of-00001.json.gz`: allenai/OLMo's C4 sample (1,000 validation records), the
  field `date` renamed back to `timestamp`, written as compact JSON lines, gzip level 9 with mtime 0;
- `c4/en/c4-train.00000-of-00001.json.gz`: maxtext's TFDS c4/en/3.0.1 train records (8 TFRecord shards x
  125 `tf.train.Example`s, parsed here without TensorFlow), put back in stream order (record i = shard
  i mod 8, position i div 8), keeping text, timestamp and url;
- `govreport/gov_report.validation.scrolls_format.jsonl`: L-Eval's 14 GovReport report/summary pairs with
  the SCROLLS field names (`id`/`pid` made up: `leval_gov_report_NN`, `..._0`);
- `cc12m/cc12m-train-0000.tar`: torchtitan's CC12M test tar, as it is;
- `coco_mini/coco-captions-mini-0000.tar`: COCO-MINI's captioned COCO 2017 images whose licence allows
  derivatives (not licence ids 3, 6), short side resized to 256 (bicubic), centre-cropped to 256 x 256, JPEG
  quality 90, with the lowest-id caption and the image's metadata, in one WebDataset tar. Its JPEG bytes
  are Pillow's: another libjpeg build may encode them differently, which is said in one line, not refused;
- `tokenizers/llama2/tokenizer.model`, `tokenizers/mixtral-8x22b/tokenizer.model`: maxtext's copies.

Sources are fetched from `https://raw.githubusercontent.com/<repo>/<commit>/<path>`, or from `--mirror`
(a URL or folder holding the same `<repo>/<commit>/<path>` layout), into OUT/.sources (kept, so a second call
fetches nothing), each through `download.fetch` (resumable, retried).

`fetch_cached` is the test session's way to them (tests/conftest.py, where no ../shared/data is beside the
clone): all of them built once into a cache (`cache_dir`), or nothing there at all.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from PIL import Image

from timetotrain import fileio
from timetotrain.data import download
from timetotrain.errors import UserError

RAW = "https://raw.githubusercontent.com"

OLMO = ("allenai/OLMo", "06c867c36986328ac31e3877faca286dba0925c3")
MAXTEXT = ("AI-Hypercomputer/maxtext", "e591f30cbbf217ed67ef71263ec0538239f9c3b8")
LEVAL = ("OpenLMLab/LEval", "cd34b050269148aed75acbbe4a599873ad0f37e9")
TORCHTITAN = ("pytorch/torchtitan", "7f126cbdfb2fee666a71b4ba0463c388bb8c8572")
COCO_MINI = ("Obmutescence/COCO-MINI", "644f29e7c1d2eefd9c4412d39bc5b0ee6fd0afd4")
_TFDS = "tests/assets/local_datasets/c4_en_dataset_minimal/c4/en/3.0.1/__local_c4_builder-train.tfrecord-{:05d}-of-00008"

# (repo, commit, path) -> sha256 of the source file.
SOURCES: dict[tuple[str, str, str], str] = {
    (*OLMO, "test_fixtures/c4-sample.00000-of-00001.json.gz"): "75cdeb8bacc1fd115eaf338290fc7c6ac60e48c9f88d12250511666a201eee1c",
    **{(*MAXTEXT, _TFDS.format(i)): h for i, h in enumerate([
        "89071f1d5b348c5c3111da3210959aef81437520f72ebd28bcf39a87ae92094d",
        "7a5442ac5e5827ca06d721ea5ad55ac413c371805c6549d52048934f4c715b97",
        "29255bd91e71036fa451632c96b04e81ac2bc0b6867a850c9571bd642037f907",
        "8ee01fac37bf3d414d9625dd62b2509321e91fe40c3120836bdc1e6046f6eaab",
        "659278f0a2fff7efa8ebc878a73e1b1b5fbd768237842954c69cf14355294b63",
        "c6437206d11c39e3708153581ff64dcbbfac0a9d95739ea3ecb1bf65c78d29e5",
        "257dc7161ef2614bd13c13760f6fc0d9ba30fa3b62d21d7b9fb68969c35416de",
        "b7d695e7dd8d3f1b2f3935beaae26a0223e772401f674e60e9249e8fc8cdb2ca",
    ])},
    (*LEVAL, "LEval-data/Open-ended-tasks/gov_report_summ.jsonl"): "72ff9fc383afef70208e12598536fedb3c86341c6e6218cb2061caa049f3e0db",
    (*TORCHTITAN, "tests/assets/cc12m_test/cc12m-train-0000.tar"): "fc7c3587c194806dfcc06e232c117b0b647aafb6ab049d9d91c0274a50b3124b",
    (*MAXTEXT, "src/maxtext/assets/tokenizers/tokenizer.llama2"): "9e556afd44213b6bd1be2b850ebbbd98f5481437a8021afaf58ee7fb1818d347",
    (*MAXTEXT, "src/maxtext/assets/tokenizers/tokenizer.mistral-v3"): "37f00374dea48658ee8f5d0f21895b9bc55cb0103939607c8185bfd1c6ca1f89",
    (*COCO_MINI, "annotations/captions_train2017.json"): "42be98d9f3f07f9961ad33119b80b6582bbfd9bd0e13ed7485910342babf26a5",
    (*COCO_MINI, "annotations/captions_val2017.json"): "1e7ca2a0d0ebe94d60ada0747bf9ba0accac281785dfdba771b2d47b0b11e135",
}  # fmt: skip

# Output file (under OUT) -> the sha256 of the file the tiny tiers were measured on.
OUTPUTS = {
    "c4/en/c4-train.00000-of-00001.json.gz": "7dd81cc124d5d79cff4711866638a2d33963acfea26b7a918cc899478084e733",
    "c4/en/c4-validation.00000-of-00001.json.gz": "439ae57b0382918e722dd5a02d3c727761415f0860f07c0648de49f2149f6b90",
    "govreport/gov_report.validation.scrolls_format.jsonl": "38ea8b96b4192b4f84b2ae17a84c46d8f715cf7faa85c8315c7917433fc4e697",
    "cc12m/cc12m-train-0000.tar": "fc7c3587c194806dfcc06e232c117b0b647aafb6ab049d9d91c0274a50b3124b",
    "coco_mini/coco-captions-mini-0000.tar": "da4fed0e95eedd2d54968614d4f2acfd74b23ce21dc91b973a00ac50104997b2",
    "tokenizers/llama2/tokenizer.model": "9e556afd44213b6bd1be2b850ebbbd98f5481437a8021afaf58ee7fb1818d347",
    "tokenizers/mixtral-8x22b/tokenizer.model": "37f00374dea48658ee8f5d0f21895b9bc55cb0103939607c8185bfd1c6ca1f89",
}
# Outputs whose bytes depend on a library's encoder (Pillow's JPEG): a different sha256 is said, not refused.
ENCODED = {"coco_mini/coco-captions-mini-0000.tar"}
NO_DERIVATIVES = (3, 6)  # COCO licence ids whose images may not be resized


class Sources:
    """Fetches and verifies source files into `cache` from `base` (<repo>/<commit>/<path> under it)."""

    def __init__(self, cache: Path, base: str = RAW, pins: dict | None = None):
        self.cache, self.base, self.pins = cache, base.rstrip("/"), SOURCES if pins is None else pins

    def path(self, repo: str, commit: str, rel: str, sha256: str | None = None) -> Path:
        dest = self.cache / repo / commit / rel
        expected = sha256 or self.pins.get((repo, commit, rel))
        if not dest.exists():
            download.fetch(f"{self.base}/{repo}/{commit}/{rel}", dest)
        if expected is not None:
            got = download.file_digest(dest, "sha256")
            if got != expected:
                dest.unlink()
                raise UserError(
                    f"{self.base}/{repo}/{commit}/{rel}: sha256 {got[:12]}…, expected {expected[:12]}… (a "
                    "changed or truncated download, removed): run the command again, or check --mirror"
                )
        return dest

    def read(self, repo: str, commit: str, rel: str) -> bytes:
        return self.path(repo, commit, rel).read_bytes()


def _json_lines_gz(records: list[dict]) -> bytes:
    text = "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records)
    bio = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=bio, mtime=0) as f:
        f.write(text.encode("utf-8"))
    return bio.getvalue()


def c4_validation(src: Sources) -> bytes:
    raw = gzip.decompress(src.read(*OLMO, "test_fixtures/c4-sample.00000-of-00001.json.gz"))
    recs = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line]
    return _json_lines_gz([{"text": r["text"], "timestamp": r["date"], "url": r["url"]} for r in recs])


def tfrecords(data: bytes) -> list[bytes]:
    """The payloads of a TFRecord file (u64 length, u32 masked CRC, payload, u32 CRC; CRCs not checked:
    the file's sha256 was)."""
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        out.append(data[i + 12 : i + 12 + n])
        i += 12 + n + 4
    return out


def _varint(b: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        x = b[i]
        i += 1
        value |= (x & 0x7F) << shift
        shift += 7
        if x < 0x80:
            return value, i


def _fields(b: bytes):
    """(field number, bytes) of a protobuf message's length-delimited fields; varints are skipped."""
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        if key & 7 == 2:
            n, i = _varint(b, i)
            yield key >> 3, b[i : i + n]
            i += n
        elif key & 7 == 0:
            _, i = _varint(b, i)
        else:
            raise UserError(f"a tf.train.Example with wire type {key & 7}: not the TFDS C4 records")


def example_bytes(payload: bytes) -> dict[str, bytes]:
    """A `tf.train.Example` whose features are bytes lists: name -> the first value."""
    out = {}
    for _, features in _fields(payload):  # Example.features
        for _, entry in _fields(features):  # Features.feature: map<string, Feature> entries
            name, feature = b"", b""
            for num, x in _fields(entry):
                if num == 1:
                    name = x
                else:
                    feature = x
            for _, lst in _fields(feature):  # Feature.bytes_list
                values = [v for _, v in _fields(lst)]
                out[name.decode()] = values[0] if values else b""
    return out


def c4_train(src: Sources) -> bytes:
    shards = [tfrecords(src.read(*MAXTEXT, _TFDS.format(s))) for s in range(8)]
    n = sum(len(s) for s in shards)
    recs = [example_bytes(shards[i % 8][i // 8]) for i in range(n)]  # undo the round-robin sharding
    return _json_lines_gz([{k: r[k].decode("utf-8") for k in ("text", "timestamp", "url")} for r in recs])


def govreport(src: Sources) -> bytes:
    lines = src.read(*LEVAL, "LEval-data/Open-ended-tasks/gov_report_summ.jsonl").decode("utf-8").splitlines()
    out = []
    for i, line in enumerate(x for x in lines if x.strip()):
        d = json.loads(line)
        rid = f"leval_gov_report_{i:02d}"
        out.append(
            json.dumps(
                {"id": rid, "pid": f"{rid}_0", "input": d["input"], "output": d["outputs"][0]},
                ensure_ascii=False,
            )
        )
    return ("\n".join(out) + "\n").encode("utf-8")


def _square_jpeg(raw: bytes) -> tuple[bytes, int, int]:
    im = Image.open(io.BytesIO(raw)).convert("RGB")
    w, h = im.size
    s = 256 / min(w, h)
    nw, nh = max(256, round(w * s)), max(256, round(h * s))
    left, top = (nw - 256) // 2, (nh - 256) // 2
    out = io.BytesIO()
    im.resize((nw, nh), Image.BICUBIC).crop((left, top, left + 256, top + 256)).save(out, "JPEG", quality=90)
    return out.getvalue(), w, h


def coco_mini(src: Sources) -> bytes:
    samples = []
    for split in ("train2017", "val2017"):
        ann = json.loads(src.read(*COCO_MINI, f"annotations/captions_{split}.json"))
        licences = {x["id"]: x for x in ann["licenses"]}
        caps: dict[int, list] = {}
        for a in ann["annotations"]:
            caps.setdefault(a["image_id"], []).append(a)
        for img in ann["images"]:
            if img["license"] not in NO_DERIVATIVES:
                samples.append(
                    (split, img, licences[img["license"]], sorted(caps[img["id"]], key=lambda a: a["id"]))
                )
    samples.sort(key=lambda s: s[1]["id"])
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for split, img, lic, cs in samples:
            # The image's bytes are pinned by the annotation (its sha256 goes into the metadata) and, through
            # the whole tar, by OUTPUTS; fetched by path, without a pin of its own.
            raw = src.path(*COCO_MINI, f"{split}/{img['file_name']}").read_bytes()
            jpg, w, h = _square_jpeg(raw)
            key = f"{img['id']:012d}"
            captions = [c["caption"].strip() for c in cs]
            meta = {
                "caption": captions[0], "captions": captions, "caption_ids": [c["id"] for c in cs],
                "url": img["flickr_url"], "coco_url": img["coco_url"], "key": key, "status": "success",
                "error_message": None, "width": 256, "height": 256, "exif": "{}", "original_width": w,
                "original_height": h, "coco_split": split, "coco_image_id": img["id"], "file_name": img["file_name"],
                "license_id": img["license"], "license_name": lic["name"], "license_url": lic["url"],
                "original_sha256": hashlib.sha256(raw).hexdigest(),
            }  # fmt: skip
            for ext, data in (
                ("jpg", jpg),
                ("txt", captions[0].encode()),
                ("json", json.dumps(meta, indent=4).encode()),
            ):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mode, info.mtime = len(data), 0o444, 0
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


BUILDERS = {
    "c4/en/c4-train.00000-of-00001.json.gz": c4_train,
    "c4/en/c4-validation.00000-of-00001.json.gz": c4_validation,
    "govreport/gov_report.validation.scrolls_format.jsonl": govreport,
    "cc12m/cc12m-train-0000.tar": lambda s: s.read(
        *TORCHTITAN, "tests/assets/cc12m_test/cc12m-train-0000.tar"
    ),
    "coco_mini/coco-captions-mini-0000.tar": coco_mini,
    "tokenizers/llama2/tokenizer.model": lambda s: s.read(
        *MAXTEXT, "src/maxtext/assets/tokenizers/tokenizer.llama2"
    ),
    "tokenizers/mixtral-8x22b/tokenizer.model": lambda s: s.read(
        *MAXTEXT, "src/maxtext/assets/tokenizers/tokenizer.mistral-v3"
    ),
}


def build(
    out: Path, mirror: str | None = None, only: list[str] | None = None, sources: Sources | None = None
):
    """Write the fixtures under `out` (the layout of the shared data folder). Returns (written, notes): an
    output already there with the pinned sha256 is kept; a note says where an encoded output differs."""
    src = sources or Sources(out / ".sources", mirror or RAW)
    written, notes = [], []
    for rel, make in BUILDERS.items():
        if only and not any(rel.startswith(o.rstrip("/") + "/") for o in only):
            continue
        dest = out / rel
        if dest.exists() and download.file_digest(dest, "sha256") == OUTPUTS[rel]:
            written.append(dest)
            continue
        data = make(src)
        got = hashlib.sha256(data).hexdigest()
        if got != OUTPUTS[rel]:
            if rel not in ENCODED:
                raise UserError(
                    f"{rel}: rebuilt with sha256 {got[:12]}…, not the pinned {OUTPUTS[rel][:12]}…: the sources "
                    "verified, so this is a bug in timetotrain/data/fixtures.py; nothing was written for it"
                )
            notes.append(
                f"{rel}: sha256 {got[:12]}… differs from the measured fixture's {OUTPUTS[rel][:12]}… (this "
                "Pillow's JPEG encoder); flux1 tiny runs on it, its RCP was measured on the pinned bytes"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        fileio.write_bytes(dest, data)
        written.append(dest)
    return written, notes


# -- the test session's copy --

COMPLETE = ".complete"  # written last: a cache folder holding it is a whole fetch
PROBE_TIMEOUT_S = 5.0


def cache_dir() -> Path:
    """Where `fetch_cached` keeps the fixtures: `$TTT_CACHE/fixtures` beside the other data caches a team may
    share (prepared data, bases), else the user's own, `$XDG_CACHE_HOME/timetotrain/fixtures` (default
    ~/.cache/timetotrain/fixtures)."""
    if os.environ.get("TTT_CACHE"):
        return Path(os.environ["TTT_CACHE"]) / "fixtures"
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "timetotrain" / "fixtures"


def _probe(base: str, pins: dict, timeout: float) -> None:
    """Ask for the first pinned source's headers within `timeout` seconds: an offline host (or one whose
    firewall drops the packets) is told in seconds, before anything is written; download.fetch itself waits
    a minute for each of its retries."""
    if "://" not in base or base.startswith("file://"):
        return  # a folder: download.fetch says what is missing
    repo, commit, rel = next(iter(pins))
    url = f"{base}/{repo}/{commit}/{urllib.parse.quote(rel)}"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError as e:
        raise UserError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise UserError(
            f"{urllib.parse.urlparse(url).netloc} not reached in {timeout:g} s ({reason})"
        ) from None


def fetch_cached(
    cache: Path, base: str = RAW, sources_pins: dict | None = None, only: list[str] | None = None,
    timeout: float = PROBE_TIMEOUT_S,
) -> tuple[Path, list[str]]:  # fmt: skip
    """The fixtures in `cache`, built there once from their public sources (`build`): (cache, notes). The
    build goes to a new folder beside `cache`, renamed into place when whole, so a stopped or concurrent
    session never sees half of it; the fetched sources are dropped (the outputs are what tests read). A
    failure leaves nothing behind (neither the folder nor a parent it made) and raises UserError."""
    if (cache / COMPLETE).is_file():
        return cache, []
    if cache.is_dir() and any(cache.iterdir()):
        raise UserError(f"{cache} holds files but no {COMPLETE} (not a whole fetch): remove it and run again")
    pins = SOURCES if sources_pins is None else sources_pins
    _probe(base.rstrip("/"), pins, timeout)
    made = [d for d in (cache.parent, *cache.parent.parents) if not d.exists()]
    work = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"{cache.name}.partial-", dir=cache.parent))
        _, notes = build(work, only=only, sources=Sources(work / ".sources", base, pins))
        shutil.rmtree(work / ".sources", ignore_errors=True)
        fileio.write_text(work / COMPLETE, f"built from {base} by timetotrain.data.fixtures.fetch_cached\n")
        try:
            os.rename(work, cache)
        except OSError:  # another session finished first (or a stale folder is in the way): theirs stands
            if not (cache / COMPLETE).is_file():
                raise
            shutil.rmtree(work)
        return cache, notes
    except BaseException:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        for d in made:  # deepest first: only the folders this call made, and only when empty
            try:
                d.rmdir()
            except OSError:
                break
        raise
