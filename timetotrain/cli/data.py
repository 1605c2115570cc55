"""`ttt data prepare`: raw datasets into the indexed files the benchmarks read.

`ttt data prepare DATASET ...` runs one preparation with its own flags; `ttt data prepare --for BENCH --tier T
--src DIR --out DIR` runs what the benchmark's task declares for the tier (`Task.data_recipe`: in-process
calls and `ttt data prepare DATASET` steps), the same recipe `ttt suite --data SRC` runs, so a benchmark
with a new dataset needs no edit here.

The data modules are imported inside the commands (numpy, torch or PIL: 15 ms to 2 s each), so `ttt --help`
stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from timetotrain import fileio, lifeline
from timetotrain.errors import UserError, writing
from timetotrain.interrupt import raise_on_signals
from timetotrain.spec import registry
from timetotrain.train.seeds import check_seed

if TYPE_CHECKING:  # tasks/ imports torch, which `ttt --help` should not wait for
    from timetotrain.spec.task import DataRecipe

_GOVREPORT_ONLY = ("block", "select", "rows", "truncate_input", "packing")


def make_data(recipe: DataRecipe, out: Path, run_step: Callable[[list[str]], None]) -> None:
    """Make a recipe's data in `out` (which exists): its in-process call, then each `ttt` step through
    `run_step` with "{out}" replaced by `out` (`ttt suite` runs them as child processes, `--for` here)."""
    if recipe.call is not None:
        recipe.call(out)
    for step in recipe.steps:
        run_step([str(out) if a == "{out}" else a for a in step])


def _run_here(step: list[str]) -> None:
    """One `ttt data ...` step in this process, through this module's own parsers."""
    parser = argparse.ArgumentParser(prog="ttt")
    add_commands(parser.add_subparsers(dest="command", required=True))
    if step[:1] != ["data"]:
        raise AssertionError(f"a data recipe step is a `ttt data` command, not `ttt {' '.join(step)}`")
    args = parser.parse_args(step)
    args.func(args)


def _prepare_for(args) -> int:
    """`--for BENCH --tier T --src DIR --out DIR`: the tier's data as its task's recipe makes it."""
    stray = [f for f, v in (("DATASET", args.dataset), ("--split", args.split)) if v is not None]
    if stray:
        raise UserError(f"{stray[0]} does not go with --for: the recipe of --for {args.for_bench} decides it")
    if args.tier is None:
        raise UserError(f"--for {args.for_bench} needs --tier T: the tier whose data to prepare")
    bench = registry.get(args.for_bench)
    tier = bench.tier(args.tier)
    src = Path(args.src)
    if not src.is_dir():
        raise UserError(
            f"--src {src} is not a folder: pass the folder of raw sources (`ttt data download fixtures --out DIR`)"
        )
    recipe = bench.task.data_recipe(tier, src)
    if recipe is None:
        raise UserError(
            f"--for {bench.name} --tier {tier.name}: no recipe here makes this data: prepare it as "
            f"docs/benchmarks/{bench.name}.md says and pass the folder to `ttt run --data`"
        )
    out = Path(args.out)
    with writing("--out", out):
        out.mkdir(parents=True, exist_ok=True)
    make_data(recipe, out, _run_here)
    print(f"{bench.name} {tier.name}: {recipe.describe} -> {out}")
    return 0


def _cmd_prepare(args) -> int:
    if args.for_bench is not None:
        return _prepare_for(args)
    if args.dataset is None:
        raise UserError("name the DATASET to prepare (c4, govreport, flux), or pass --for BENCH --tier T")
    if args.split is None:
        raise UserError(f"{args.dataset} needs --split train|validation: which split --src holds")
    if args.tier is not None and args.dataset != "flux":
        raise UserError(f"--tier applies to flux and to --for BENCH: drop it for {args.dataset}")
    if args.workers is not None and args.workers < 1:
        # c4 handed 0 to multiprocessing (a ValueError traceback), govreport ran on one thread anyway.
        raise UserError(f"--workers {args.workers} must be at least 1 (leave it out to use every core)")
    if args.dataset == "govreport":
        # SIGTERM/SIGINT become an exception, so the `with` blocks on the way out remove temporaries (c4
        # enters its own block once its worker processes exist: they must not inherit the handler); after
        # a SIGKILL the guardian removes them (lifeline.py; the staged files are all directly in --out).
        with lifeline.guard_temporaries(Path(args.out)), raise_on_signals():
            return _prepare_govreport(args)
    if args.dataset == "flux":
        with raise_on_signals():  # as govreport: one process, its staged outputs removed on the way out
            return _prepare_flux(args)
    from timetotrain.data import c4

    given = [n for n in _GOVREPORT_ONLY if getattr(args, n) not in (None, "all")]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UserError(f"{flag} applies to `ttt data prepare govreport` only: drop it for c4")
    info = c4.prepare(
        Path(args.src),
        args.split,
        args.tokenizer,
        Path(args.out),
        args.workers,
        eod=not args.no_eod,
        tokenizer_model=Path(args.tokenizer_model) if args.tokenizer_model else None,
    )
    print(
        f"c4 {args.split}: {info['documents']:,} documents, {info['tokens']:,} tokens -> "
        f"{Path(args.out) / c4.prefix_name(args.split)}.{{bin,idx}} (manifest {c4.dataset_name(args.split)}.manifest.json)"
    )
    return 0


def _prepare_govreport(args) -> int:
    from timetotrain.data import govreport

    if args.tokenizer_model is None:
        raise UserError("govreport needs --tokenizer-model FILE: pass the Llama 2 tokenizer.model")
    if args.no_eod:
        raise UserError("--no-eod applies to c4 only: govreport ends every example with EOS by recipe")
    out = Path(args.out)
    with writing("--out", out):  # a full disk: the arrays and manifest are staged, so none appears
        info = govreport.prepare(
            args.src,
            args.split,
            args.tokenizer_model,
            out,
            block=args.block,
            select=args.select,
            rows=args.rows,
            truncate_input=args.truncate_input,
            packing=args.packing,
            threads=args.workers,
        )
    c = info["counts"]
    ids_name, labels_name = govreport.array_names(args.split)
    blocks = f"{c['blocks']:,} blocks of {info['block']:,} tokens"
    if info["source_format"] == "mlcommons-parquet":
        what = f"{blocks} imported as they are"
    else:
        what = (
            f"{c['examples']:,} examples, {c['dropped_too_long']:,} longer than {info['block']:,} tokens dropped"
            + (f", {c['inputs_truncated']:,} reports truncated" if c["inputs_truncated"] else "")
            + f", {blocks}"
        )
    print(
        f"govreport {args.split}: {what} ({c['tokens']:,} tokens, {c['label_tokens']:,} with loss) -> "
        f"{out / ids_name}, {labels_name} (manifest {govreport.dataset_name(args.split)}.manifest.json)"
    )
    return 0


def _prepare_flux(args) -> int:
    from timetotrain.data import flux_encoders, flux_mlcommons, flux_prepare
    from timetotrain.tasks.rectified_flow import shapes_of

    parts = flux_mlcommons.find_sources(args.src)  # MLCommons' preprocessed encodings: imported as they are
    if parts is not None:
        with raise_on_signals():  # a stopped import removes its partial (possibly terabyte) temporaries
            return _import_flux(args, parts)
    if args.empty_encodings:
        raise UserError("--empty-encodings applies to importing MLCommons' preprocessed encodings (--src)")
    if not args.encoders:
        raise UserError("flux needs --encoders: `standin` (the tiny tier) or a folder with t5/, clip/, vae/")
    tier = registry.get("flux1").tier(
        _flux_tier(args) or ("tiny" if args.encoders == "standin" else "reference")
    )
    shapes = shapes_of(tier.model)
    if args.encoders == "standin":
        if args.tokenizer_model is None:
            raise UserError("--encoders standin needs --tokenizer-model FILE: the Llama 2 tokenizer.model")
        encoders = flux_encoders.StandInEncoders(shapes, args.tokenizer_model)
    else:
        encoders = flux_encoders.RealEncoders(args.encoders, shapes)
    tars = flux_prepare.tars_of(args.src)
    info = flux_prepare.prepare(tars, args.split, encoders, Path(args.out), select=args.select)
    print(
        f"flux {args.split}: {info['samples']:,} samples encoded ({encoders.name} encoders, tier {tier.name} "
        f"shapes), {info['skips'].report()} -> {Path(args.out) / args.split}"
    )
    return 0


def _flux_tier(args) -> str | None:
    if args.tier not in (None, "tiny", "reference"):
        raise UserError(f"--tier {args.tier}: flux encodes for the tiny or the reference tier's shapes")
    return args.tier


def _import_flux(args, parts) -> int:
    """--src is MLCommons' preprocessed encodings (data/flux_mlcommons.py): import them as they are."""
    from timetotrain.data import flux_mlcommons
    from timetotrain.tasks.rectified_flow import shapes_of

    if args.encoders:
        raise UserError(
            f"--src {args.src} is already encoded (MLCommons' preprocessed layout): drop --encoders"
        )
    if args.select != "all":
        raise UserError(f"--select {args.select} applies to image/caption tars, not to --src {args.src}")
    tier = registry.get("flux1").tier(_flux_tier(args) or "reference")
    shapes = shapes_of(tier.model)
    out = Path(args.out)
    empty = flux_mlcommons.find_empty(args.src, args.empty_encodings)
    if empty is None and not (out / "empty_encodings").is_dir():
        raise UserError(
            f"--src {args.src}: no empty_encodings/ beside it: pass --empty-encodings DIR (MLCommons' folder "
            "with t5_empty.npy and clip_empty.npy)"
        )
    if empty is not None:  # checked before the long import
        flux_mlcommons.import_empty(empty, shapes, out)
    info = flux_mlcommons.import_split(parts, args.split, shapes, out, tier=tier.name)
    ts = info["timesteps"]
    stored = (
        "no stored timesteps"
        if ts is None
        else f"stored eval timesteps {ts['counts']} per value"
        + (", equal to i mod 8" if ts["equal_to_index_mod_divisor"] else ", not i mod 8 in stored order")
    )
    print(
        f"flux {args.split}: {info['samples']:,} samples imported bit for bit from {info['files']} MLCommons "
        f"file(s) (tier {tier.name} shapes), {stored}; empty encodings "
        f"{'from ' + str(empty) if empty else 'kept'} -> {out / args.split}"
    )
    return 0


def _cmd_download(args) -> int:
    from timetotrain.data import download

    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers} must be at least 1")
    if args.for_bench is not None:
        from timetotrain.cli import data_reference

        return (data_reference.dry_run if args.dry_run else data_reference.download_for)(args)
    if args.dataset is None:
        raise UserError(
            "name what to download (c4, mlcommons, fixtures), or pass --for BENCH --tier reference"
        )
    if args.dry_run or args.tier is not None:
        raise UserError(f"{'--dry-run' if args.dry_run else '--tier'} goes with --for BENCH: drop it")
    if args.out is None:
        raise UserError(f"{args.dataset} needs --out DIR: the download folder")
    workers = args.workers or 4
    out = Path(args.out)
    if args.dataset == "fixtures":
        return _download_fixtures(args)
    with raise_on_signals():  # a stopped download keeps its .part files: the next call resumes them
        if args.dataset == "c4":
            if args.metadata or args.name:
                raise UserError(
                    "--metadata and a dataset name are for `ttt data download mlcommons`: drop them"
                )
            files = download.download_c4(args.split, args.shards, out, args.mirror, workers)
        else:
            if not args.metadata:
                raise UserError(
                    "mlcommons needs --metadata URL: the dataset's .uri file, as in MLCommons' download scripts"
                )
            files = download.download_mlcommons(args.metadata, out / (args.name or ""), workers)
    total = sum(f.stat().st_size for f in files)
    print(f"{len(files)} file(s), {total / 1e6:,.1f} MB, verified, in {out}")
    return 0


def _download_fixtures(args) -> int:
    """The tiny tiers' data, rebuilt from public sources byte for byte (data/fixtures.py)."""
    from timetotrain.data import fixtures

    if args.metadata or args.name or args.shards != 1 or args.split != "train":
        raise UserError(
            "fixtures takes --out, --mirror and --only: drop --metadata, --shards, --split and the name"
        )
    only = [o.strip() for o in args.only.split(",")] if args.only else None
    known = sorted({rel.split("/")[0] for rel in fixtures.OUTPUTS})
    bad = [o for o in only or [] if o not in known]
    if bad:
        raise UserError(f"--only {bad[0]}: not a fixture; choose from {', '.join(known)}")
    out = Path(args.out)
    before = fileio.folders_under(out)
    with raise_on_signals(), writing("--out", out):
        try:
            written, notes = fixtures.build(out, args.mirror, only)
        except BaseException as e:
            # A failed call leaves no folder it made and holds nothing in: an empty `.sources/` tree would
            # look like a download to the next reader. Fetched sources stay, so a new call resumes.
            fileio.remove_new_empty_folders(out, before)
            if not isinstance(e, UserError):
                raise
            layout = (
                f"a folder already in the final layout ({', '.join(known)}; e.g. copied from another "
                "machine) needs no download: pass it as it is (`ttt data prepare ... --src DIR`, `ttt suite "
                "--data DIR`, TTT_SHARED_DATA=DIR for the tests)"
            )
            if args.mirror or "download failed" not in str(e):
                raise UserError(f"{e}; {layout}") from e
            # The first thing an offline host meets: say what it can do besides trying again.
            raise UserError(
                f"{e}, or, where this host cannot reach GitHub, pass --mirror URL|DIR (a copy holding the same "
                f"<owner>/<repo>/<commit>/<path> files; docs/getting-started.md); {layout}"
            ) from e
    for note in notes:
        print(f"ttt: note: {note}", file=sys.stderr)
    total = sum(f.stat().st_size for f in written)
    print(f"{len(written)} fixture file(s), {total / 1e6:,.1f} MB, sha256-checked, in {out} "
          f"(the layout ttt data prepare --for ... --src {out} reads)")  # fmt: skip
    return 0


def add_commands(sub) -> None:
    """Register `data download`, `data prepare`, `data synth-graph`, `data synth-criteo` and `data synth-yambda`."""
    d = sub.add_parser(
        "data",
        help="download and prepare datasets",
        description="Datasets: `download` fetches a benchmark's public data, `prepare` tokenizes or encodes it "
        "into the files runs read, `synth-graph` writes rgat's synthetic graph, `synth-criteo` dlrm_dcnv2's "
        "synthetic multi-hot Criteo, `synth-yambda` dlrmv4's synthetic Yambda.",
    ).add_subparsers(dest="data_command", required=True)
    _add_download(d)
    _add_prepare(d)
    _add_synth_graph(d)
    _add_synth_criteo(d)
    _add_synth_yambda(d)


def _add_download(d) -> None:
    s = d.add_parser(
        "download",
        help="fetch C4 shards (hub or mirror) or an MLCommons dataset, resumable and verified",
        description="c4: allenai/c4 `en` json.gz shards 0..K-1 of --split, from the Hugging Face hub (sha256 "
        "checked) or from --mirror (a URL, file:// URL or folder laid out as the hub repository; each shard "
        "checked by its gzip CRC). mlcommons: the files listed by the storage metadata --metadata "
        "(<dataset>.uri with the base URL, <dataset>.md5 beside it), downloaded in parallel and md5-checked. "
        "Interrupted downloads resume from their .part files when the command runs again. "
        "fixtures: the small real data the tiny tiers were measured on (C4 sample, GovReport, CC12M and COCO "
        "samples, the Llama 2 and Mixtral tokenizers), rebuilt byte for byte from pinned commits of public "
        "GitHub repositories (or --mirror with their <repo>/<commit>/<path> layout), sha256-checked, in the "
        "layout `ttt data prepare --for BENCH --tier tiny --src OUT` reads. "
        "--for BENCH --tier reference: every dataset the benchmark's reference tier reads, from the MLCommons "
        "storage metadata its reference names (--mirror URL|DIR: a copy with the same metadata/ paths), then "
        "the steps that follow; --dry-run lists them.",
    )
    s.add_argument(
        "dataset",
        nargs="?",
        choices=["c4", "mlcommons", "fixtures"],
        help="what to download (fixtures: the tiny tiers' data, rebuilt from public GitHub sources), or --for",
    )
    s.add_argument("name", nargs="?", help="mlcommons: a folder name under --out for the dataset")
    s.add_argument(
        "--for",
        dest="for_bench",
        metavar="BENCH",
        help="every MLCommons dataset BENCH's reference tier reads, from the sources its reference names "
        "(timetotrain/data/reference_sources.py); what needs a licence or a login is one line saying where",
    )
    s.add_argument("--tier", help="with --for: reference (the default; tiny tiers read the fixtures)")
    s.add_argument(
        "--dry-run",
        action="store_true",
        help="with --for: list what would be fetched, from where, how big, and the steps after; fetch nothing",
    )
    s.add_argument(
        "--out", help="download folder (created if missing; with --for, default data/<BENCH>-reference)"
    )
    s.add_argument("--shards", type=int, default=1, help="c4: the first K shards (default 1)")
    s.add_argument(
        "--split", choices=["train", "validation"], default="train", help="c4 split (default train)"
    )
    s.add_argument(
        "--mirror",
        metavar="URL|DIR",
        help="c4: a mirror instead of the hub; fixtures: a copy of the pinned GitHub files (<owner>/<repo>/<commit>/<path>); "
        "--for: a copy of MLCommons' storage (metadata/<dataset>.uri)",
    )
    s.add_argument("--metadata", metavar="URL", help="mlcommons: the dataset's .uri metadata URL")
    s.add_argument("--workers", type=int, default=None, help="parallel downloads (default 4)")
    s.add_argument(
        "--only",
        metavar="NAMES",
        help="fixtures: a comma-separated subset (c4, govreport, cc12m, coco_mini, tokenizers)",
    )
    s.set_defaults(func=_cmd_download)


def _add_prepare(d) -> None:
    s = d.add_parser(
        "prepare",
        help="tokenize raw data into the files the benchmarks read",
        description="c4: tokenize allenai/c4 json.gz files into .bin/.idx files (byte-compatible with "
        "megatron-core's IndexedDataset), a token histogram and a manifest with checksums. "
        "govreport: tokenize SCROLLS gov_report (.jsonl or .parquet) with the Llama 2 tokenizer into packed "
        "input_ids/labels .npy blocks and a manifest (llama2_70b_lora), or import MLCommons' preprocessed "
        "scrolls_gov_report_8k parquet as it is. "
        "flux: encode image/caption WebDataset tars into T5 / CLIP pooled / VAE mean+logvar encodings (flux1); "
        "--select tiny splits the shared CC12M + COCO fixtures (COCO val2017 is the validation set); or, when --src "
        "is MLCommons' preprocessed download (a `datasets` save_to_disk folder of Arrow files, a folder of them, or "
        "its data_<rank>_<idx>.parquet files), import those encodings bit for bit, keys and stored eval timesteps "
        "included, with empty_encodings/ from beside --src or --empty-encodings (see data/flux_mlcommons.py). "
        "--for BENCH --tier T --src DIR --out DIR: whatever that tier reads, made from a folder of raw sources "
        "laid out as `ttt data download fixtures` writes them, by the recipe its task declares (the one `ttt suite "
        "--data SRC` runs).",
    )
    s.add_argument(
        "dataset", nargs="?", choices=["c4", "govreport", "flux"], help="dataset to prepare (or --for)"
    )
    s.add_argument(
        "--for",
        dest="for_bench",
        metavar="BENCH",
        help="prepare what benchmark BENCH's --tier reads from --src, a folder of raw sources laid out as "
        "`ttt data download fixtures` writes them, by the recipe its task declares (the one `ttt suite --data "
        "SRC` runs)",
    )
    s.add_argument(
        "--src",
        required=True,
        help="c4: folder with c4-<split>.*.json.gz (allenai/c4 `en`); govreport: a SCROLLS .jsonl/.parquet, "
        "or MLCommons' scrolls_gov_report_8k parquet (or its folder); flux: WebDataset tars or folders of them "
        "(comma-separated), or MLCommons' cc12m_preprocessed / coco_preprocessed folder (detected)",
    )
    s.add_argument(
        "--split",
        choices=["train", "validation"],
        help="which split --src holds; a run reads both, so prepare train and validation into one --out",
    )
    s.add_argument(
        "--tokenizer",
        default="llama3",
        help="c4 tokenizer: llama3 (default, from llama-models), or llama2 / mixtral with --tokenizer-model FILE",
    )
    s.add_argument("--out", required=True, help="output folder (created if missing)")
    s.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizer processes (govreport: threads; default: all cores)",
    )
    s.add_argument("--no-eod", action="store_true", help="c4: do not append end-of-text after each document")
    s.add_argument(
        "--tokenizer-model",
        metavar="FILE",
        help="a SentencePiece tokenizer.model: the Llama 2 one for govreport; for c4 --tokenizer llama2|mixtral",
    )
    _add_govreport_flags(s)
    _add_flux_flags(s)
    s.set_defaults(func=_cmd_prepare)


def _add_govreport_flags(s) -> None:
    g = s.add_argument_group("govreport")
    g.add_argument(
        "--block",
        type=int,
        default=None,
        help="tokens per packed row (default 8192; 1024 with --select tiny)",
    )
    g.add_argument(
        "--select",
        choices=["all", "tiny"],
        default="all",
        help="tiny: the tiny tier's 10 train / 3 validation rows of the shared 14-row fixture, reports "
        "truncated to fit --block (see timetotrain/data/govreport.py)",
    )
    g.add_argument("--rows", metavar="START:STOP", help="only these records (0-based, in file order)")
    g.add_argument(
        "--truncate-input",
        action="store_true",
        default=None,
        help="cut over-long reports to fit the block instead of dropping the example (default with tiny)",
    )
    g.add_argument(
        "--packing",
        choices=["reference", "whole"],
        default=None,
        help="reference: pack in the reference's datasets.map groups (default); whole: one stream "
        "(default with tiny)",
    )


def _add_flux_flags(s) -> None:
    """flux's encoders and imports; --tier also serves --for."""
    f = s.add_argument_group("flux")
    f.add_argument(
        "--encoders",
        metavar="standin|FOLDER",
        help="flux: `standin` (the tiny tier's deterministic stand-ins, with --tokenizer-model) or a folder with "
        "t5/ (T5EncoderModel), clip/ (CLIPTextModel), vae/ (diffusers AutoencoderKL) as save_pretrained writes them",
    )
    f.add_argument(
        "--tier",
        help="with --for: the tier whose data to prepare; flux: tiny or reference, whose shapes to encode for "
        "or to check imported encodings against (default: tiny with standin, else reference)",
    )
    f.add_argument(
        "--empty-encodings",
        metavar="DIR",
        help="flux import: MLCommons' empty_encodings/ (t5_empty.npy, clip_empty.npy; default: the one beside "
        "--src)",
    )


def _cmd_synth_graph(args) -> int:
    from timetotrain.data import graph_synth

    check_seed(args.seed)  # numpy's generators refuse a negative seed with a traceback
    sc = graph_synth.scale(args.scale)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: give a folder for the graph")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(
            f"--out {out} is not empty: give a new folder (a graph is never written over another)"
        )
    before = fileio.folders_under(out)  # nothing, or the empty --out itself
    try:
        # a full disk or an unusable folder: every file of the graph, or none; a stopped generation
        # removes its staged files, as `data prepare`
        with writing("--out", out), raise_on_signals():
            out.mkdir(parents=True, exist_ok=True)  # before minutes of generating, not after
            info = graph_synth.generate(out, sc, args.seed)
    except BaseException:
        fileio.remove_new_empty_folders(out, before)  # else the next call would find --out "not empty"
        raise
    print(
        f"{args.scale} graph (seed {args.seed}): {sum(info['nodes'].values()):,} nodes, "
        f"{sum(info['edges'].values()):,} stored edges, {info['labeled']:,} labeled papers, {info['dim']}-d "
        f"features, {info['classes']} classes -> {out}"
    )
    return 0


def _add_synth_graph(d) -> None:
    s = d.add_parser(
        "synth-graph",
        help="write a synthetic IGBH-like graph (rgat) in the IGBH on-disk layout",
        description="A heterogeneous graph with IGBH's schema (paper, author, institute, fos, journal, "
        "conference; six stored relations, eleven with reverses), power-law degrees, class-dependent "
        "features and homophilous edges, in the public IGBH `processed` layout; deterministic for a seed. "
        "Its parameters: timetotrain/data/graph_synth.py and docs/benchmarks/rgat.md.",
    )
    s.add_argument("--scale", required=True, choices=["tiny", "small"], help="tiny: 50k papers; small: 400k")
    s.add_argument("--out", required=True, help="output folder (new or empty)")
    s.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    s.set_defaults(func=_cmd_synth_graph)


def _synthesize(out: Path, make) -> dict:
    """`make(out)` into a new or empty --out, its files all written or none (staged writes); a stopped or
    failed generation leaves no folder it made behind."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: give a folder for the dataset")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(
            f"--out {out} is not empty: give a new folder (a dataset is never written over another)"
        )
    before = fileio.folders_under(out)  # nothing, or the empty --out itself
    try:
        with writing("--out", out), raise_on_signals():
            out.mkdir(parents=True, exist_ok=True)
            return make(out)
    except BaseException:
        fileio.remove_new_empty_folders(out, before)
        raise


def _run_synth(args, generator, summary) -> int:
    """`ttt data synth-*`: the generator module's scale and generate into --out, then one summary line."""
    check_seed(args.seed)  # numpy's generators refuse a negative seed with a traceback
    sc = generator.scale(args.scale)
    out = Path(args.out)
    info = _synthesize(
        out, lambda o: generator.generate(o, sc, args.seed, log=lambda line: print(line, flush=True))
    )
    print(f"{args.scale} {summary(info)} (seed {args.seed}) -> {out}")
    return 0


def _synth_flags(s, scale_help: str, func) -> None:
    s.add_argument("--scale", required=True, choices=["tiny", "small", "full"], help=scale_help)
    s.add_argument("--out", required=True, help="output folder (new or empty)")
    s.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    s.set_defaults(func=func)


def _cmd_synth_criteo(args) -> int:
    from timetotrain.data import criteo_synth

    # Every file of the 24 days and the manifest appear together, or none.
    return _run_synth(
        args,
        criteo_synth,
        lambda info: (
            f"multi-hot Criteo: {info['train_rows']:,} training and {info['val_rows']:,} validation "
            f"samples, click rate {info['click_rate']:.3f}, the hidden model's validation AUC "
            f"{info['hidden_model_val_auc']:.4f}"
        ),
    )


def _add_synth_criteo(d) -> None:
    s = d.add_parser(
        "synth-criteo",
        help="write a synthetic multi-hot Criteo (dlrm_dcnv2) in the MLPerf reference's layout",
        description="24 days of day_<d>_dense.npy, day_<d>_labels.npy and day_<d>_sparse_multi_hot.npz, as the "
        "MLPerf DLRM-DCNv2 reference reads them, with clicks drawn from a hidden logistic model over the dense "
        "features, per-id effects and feature crosses; deterministic for a seed, with a manifest of sha256s. "
        "Its parameters: timetotrain/data/criteo_synth.py and docs/benchmarks/dlrm_dcnv2.md.",
    )
    _synth_flags(
        s,
        "tiny: 188k training rows, tables <= 2,000 rows; small: 9.2M, <= 200,000; full: the real sizes (~4 TB)",
        _cmd_synth_criteo,
    )


def _cmd_synth_yambda(args) -> int:
    from timetotrain.data import yambda_synth

    # processed_5b/, shared_metadata/ and the manifest appear together, or none.
    return _run_synth(
        args,
        yambda_synth,
        lambda info: (
            f"Yambda: {info['users']:,} users, {info['train_events']:,} train and "
            f"{info['test_events']:,} test events in {info['sessions']:,} sessions, the hidden model's AUC on the "
            f"last train day {info['hidden_model_last_day_auc']:.4f}"
        ),
    )


def _add_synth_yambda(d) -> None:
    s = d.add_parser(
        "synth-yambda",
        help="write a synthetic Yambda (dlrmv4) in the MLPerf reference's processed layout",
        description="processed_5b/ (train_sessions.parquet, test_events.parquet, session_index.parquet, "
        "item_popularity.npy, split_meta.json) and shared_metadata/ (the artist and album mappings), as the "
        "dlrmv4 reference's preprocessing writes them, from a planted user/item model: listen_plus depends on "
        "user, artist and item effects and the user's taste for the artist; deterministic for a seed, with a "
        "manifest of sha256s. Its parameters: timetotrain/data/yambda_synth.py and docs/benchmarks/dlrmv4.md.",
    )
    _synth_flags(
        s,
        "tiny: 256 users, ~33k events (< 1 MB); small: 20k users, ~14M events; full: Yambda-5B's sizes",
        _cmd_synth_yambda,
    )
