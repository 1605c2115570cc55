"""`ttt data prepare`: raw datasets into the indexed files the benchmarks read."""

from __future__ import annotations

from pathlib import Path

from timetotrain.errors import UserError


def _cmd_prepare(args) -> int:
    from timetotrain.data import c4

    if args.dataset != "c4":
        raise UserError(f"unknown dataset {args.dataset!r}: this version prepares c4")
    info = c4.prepare(
        Path(args.src), args.split, args.tokenizer, Path(args.out), args.workers, eod=not args.no_eod
    )
    print(
        f"c4 {args.split}: {info['documents']:,} documents, {info['tokens']:,} tokens -> "
        f"{Path(args.out) / c4.prefix_name(args.split)}.{{bin,idx}} (manifest {c4.dataset_name(args.split)}.manifest.json)"
    )
    return 0


def add_commands(sub) -> None:
    """Register `data prepare`."""
    d = sub.add_parser("data", help="prepare datasets").add_subparsers(dest="data_command", required=True)
    s = d.add_parser(
        "prepare",
        help="tokenize raw data into Megatron-compatible indexed files",
        description="Tokenize allenai/c4 json.gz files into .bin/.idx files (byte-compatible with "
        "megatron-core's IndexedDataset), a token histogram and a manifest with checksums.",
    )
    s.add_argument("dataset", choices=["c4"], help="dataset to prepare")
    s.add_argument("--src", required=True, help="folder with c4-<split>.*.json.gz (allenai/c4 `en`)")
    s.add_argument("--split", required=True, choices=["train", "validation"])
    s.add_argument("--tokenizer", default="llama3", help="tokenizer (default: llama3, from llama-models)")
    s.add_argument("--out", required=True, help="output folder (created if missing)")
    s.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    s.add_argument("--no-eod", action="store_true", help="do not append end-of-text after each document")
    s.set_defaults(func=_cmd_prepare)
