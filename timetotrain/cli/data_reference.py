"""`ttt data download --for BENCH --tier reference`: every MLCommons dataset the benchmark's reference tier
reads, from the table in data/reference_sources.py, each through `download.download_mlcommons` (resumable,
md5-checked); what no URL fetches is one line saying what to do and where."""

from __future__ import annotations

import sys
from pathlib import Path

from timetotrain import fileio
from timetotrain.data import download
from timetotrain.data.reference_sources import R2_DOWNLOADER, STORAGE, Fetch, ReferenceData, reference_data
from timetotrain.errors import UserError, writing
from timetotrain.interrupt import raise_on_signals
from timetotrain.spec import registry


def default_out(bench: str) -> Path:
    return Path("data") / f"{bench}-reference"


def _entry(args) -> ReferenceData:
    stray = [f for f, v in (("DATASET", args.dataset), ("--metadata", args.metadata), ("name", args.name),
                            ("--only", args.only), ("--shards", args.shards != 1),
                            ("--split", args.split != "train")) if v]  # fmt: skip
    if stray:
        raise UserError(
            f"{stray[0]} does not go with --for: the table of --for {args.for_bench} names the sources"
        )
    name, tier = args.for_bench, args.tier or "reference"
    entry = reference_data(name)
    if entry is None or tier != "reference":
        # Only here is the benchmark loaded (it imports torch: seconds a download need not wait), to name
        # an unknown benchmark or tier in its own words.
        bench = registry.get(name)
        bench.tier(tier)
        if tier != "reference":
            raise UserError(
                f"--tier {tier}: --for downloads the reference tier's data; the {tier} tier reads the fixtures "
                f"(`ttt data download fixtures --out SRC`, then `ttt data prepare --for {name} --tier {tier} "
                "--src SRC --out DIR`)"
            )
        raise UserError(
            f"--for {name}: no download source is known for its reference tier; see docs/benchmarks/{name}.md"
        )
    blocking = [m for m in entry.manual if m.required]
    if blocking:  # nothing is fetched: the run could not use the rest without it
        m = blocking[0]
        raise UserError(f"{name} --tier reference: {m.what} cannot be downloaded by ttt: {m.do}")
    return entry


def _url(f: Fetch, mirror: str | None) -> str:
    """The metadata URL, from MLCommons' storage or from --mirror (a copy with its metadata/ paths)."""
    if mirror is None:
        return f.metadata
    return mirror.rstrip("/") + f.metadata.removeprefix(STORAGE)


def _then(entry: ReferenceData, out: Path) -> list[str]:
    return [step.replace("{out}", str(out)) for step in entry.then]


def dry_run(args) -> int:
    entry = _entry(args)
    out = Path(args.out) if args.out else default_out(args.for_bench)
    for f in entry.fetch:
        print(f"fetch {_url(f, args.mirror)} -> {out / f.folder}  ({f.what}; {f.size or 'size not published'}; "
              f"{f.source})")  # fmt: skip
    for m in entry.manual:
        print(f"by hand: {m.what}: {m.do}  ({m.source})")
    for step in _then(entry, out):
        print(f"then: {step}")
    return 0


def download_for(args) -> int:
    entry = _entry(args)
    out = Path(args.out) if args.out else default_out(args.for_bench)
    workers = args.workers or 4
    sizes = ", ".join(f"{f.folder} {f.size or '(size not published)'}" for f in entry.fetch)
    print(f"{args.for_bench} reference: {len(entry.fetch)} dataset(s) into {out}: {sizes}", flush=True)
    before = fileio.folders_under(out)
    files = []
    with raise_on_signals(), writing("--out", out):
        try:
            for f in entry.fetch:
                files += _one(f, args.mirror, out, workers)
        except BaseException:
            # Fetched files and .part files stay, so the next call resumes; a folder this call made and
            # left empty goes, so nothing looks like a download that is not one.
            fileio.remove_new_empty_folders(out, before)
            raise
    total = sum(p.stat().st_size for p in files)
    print(f"{len(files)} file(s), {total / 1e6:,.1f} MB, md5-checked, in {out}")
    for m in entry.manual:
        print(f"ttt: note: {m.what} is not downloaded: {m.do}", file=sys.stderr)
    for step in _then(entry, out):
        print(f"then: {step}")
    return 0


def _one(f: Fetch, mirror: str | None, out: Path, workers: int) -> list[Path]:
    url = _url(f, mirror)
    try:
        return download.download_mlcommons(url, out / f.folder, workers)
    except UserError as e:
        if "HTTP 401" in str(e) or "HTTP 403" in str(e):  # the bucket asks for a Cloudflare Access login
            raise UserError(
                f"{e}; where the bucket asks for a login, fetch it with MLCommons' R2 downloader, `bash <(curl "
                f"-s {R2_DOWNLOADER}) -d {out / f.folder} {url}`, then run this command again to check it"
            ) from e
        raise
