"""How much fine-tuning on the GovReport fixture can lower llama2_70b_lora tiny's held-out summary loss.

    python bench/lora_tiny_gain.py --train full:0-9 --val trunc:10-12 --mode lora --lr 1e-3 --steps 100
    python bench/lora_tiny_gain.py --train full:0-9 --val trunc:10-12 --mode lora+head --lr 5e-4 --steps 100
    python bench/lora_tiny_gain.py --train full:0-9 --val trunc:10-12 --write data/gov-full   # for `ttt run`
    python bench/lora_tiny_gain.py --base FOLDER --mode lora --lr 3e-3   # another base (bench/lora_base_width.py)

The tier's `tests/untrained.py` margin asks fine-tuning to gain 5% of the target over the shipped base
(docs/benchmarks/llama2_70b_lora.md, "Tiny tier"). This script measures what a data layout and a set of
trainable weights can gain, from the shipped base, in one process:

* documents: the fixture's 13 distinct rows in `id` order (the duplicate dropped, as `--select tiny`);
  `trunc:A-B` cuts each report until its example fits one 1,024-token block (the tier's layout), `full:A-B`
  packs each document's whole text (the reference's layout: labels on every training token, packed without
  resets), `pieces:A-B` cuts each report into consecutive pieces, each with its summary;
* `--mode lora`: the tier's adapters (rank 16, alpha 32, dropout 0.1, qkv + o); `full`: every weight of the
  base; `head`: the output head and norms only; `lora+head`: the tier's adapters plus one more of the same
  rank, alpha and dropout on the output head (`--head-dropout` overrides its dropout), the base frozen;
  `attn`: every attention weight (the fused QKV, the output projection, the attention norms) with the
  adapters, the rest frozen: the most that any adapter on qkv + o could reach;
* the head adapter adds `scale * B(A(dropout(h)))` to the logits (A drawn from `--seed`, B zero): the fused
  head loss reads one weight, so it gets `[W | B]` and the hidden states `[h | scale * A(dropout(h))]`,
  whose product is those logits (a bench-only wrapper, not the tier's code);
* AdamW (weight decay 1e-4), clip 0.3, cosine from `--lr` to 0 over `--steps` (HF's cosine: with --steps
  100 the tier's own schedule), batches of 8 in the tier's seeded order;
* prints the held-out loss (the tier's metric: the mean over validation blocks of each block's mean summary
  cross-entropy) before training and every `--eval-every` steps (10), with the last batch's training loss,
  then the lowest point of that curve and its gain over the untrained score.

`--base FOLDER` starts from another base folder `ttt base` wrote (a Llama of any shape: the tier's model is
replaced by the one its `config.json` describes; its vocabulary table, of the size its `base.json` records,
maps the data) instead of the shipped one.

`--write DIR` writes the two splits as a prepared folder instead (for `ttt run --set eval_samples=N`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from timetotrain.data import govreport, sentencepiece_tok
from timetotrain.models.llama import LlamaConfig
from timetotrain.spec.registry import get
from timetotrain.spec.task import Share
from timetotrain.train.base_model import shipped_base
from timetotrain.train.step import build_training

# The shared fixtures, found as the tests find them.
DATA = Path(os.environ.get("TTT_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))


def documents(src: Path) -> list:
    seen, docs = set(), []
    for r in sorted(govreport.iter_rows(src), key=lambda r: r.id):
        if (r.input, r.output) not in seen:
            seen.add((r.input, r.output))
            docs.append(r)
    return docs


def blocks(tok, docs, spec: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    layout, span = spec.split(":")
    first, last = (int(x) for x in span.split("-"))
    ids, labels = [], []

    def add(report, summary):
        i, lab = govreport.encode_example(tok, report, summary, split)
        ids.append(np.array(i, np.int32))
        labels.append(np.array(lab, np.int32))

    for row in docs[first : last + 1]:
        if layout == "full":
            add(row.input, row.output)
        elif layout == "trunc":
            add(govreport.fit_report(tok, row.input, row.output, govreport.TINY_BLOCK), row.output)
        elif layout == "pieces":
            text = row.input
            while text and (piece := govreport.fit_report(tok, text, row.output, govreport.TINY_BLOCK)):
                add(piece, row.output)
                text = text[len(piece) :].lstrip()
        else:
            raise SystemExit(f"{spec}: the layout is one of trunc, full, pieces")
    packed, packed_labels, _ = govreport.pack(ids, labels, govreport.TINY_BLOCK)
    return packed, packed_labels


def write(out: Path, split: str, ids, labels, src: Path, tok, spec: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    info = {
        "dataset": "govreport", "split": split, "block": govreport.TINY_BLOCK, "dtype": "int32",
        "sources": {src.name: govreport.sha256_file(src)}, "tokenizer": tok.identity(),
        "selection": {"bench": "lora_tiny_gain", "spec": spec},
        "counts": {"blocks": int(ids.shape[0]), "label_tokens": int((labels != -100).sum())},
    }  # fmt: skip
    govreport._save(out, split, ids, labels, info)


class _HeadAdapter(torch.nn.Module):
    """`head` plus a LoRA adapter, as the fused head loss sees it: `weight` is `[W | B]`."""

    def __init__(self, head: torch.nn.Linear, rank: int, alpha: float, dropout: float, generator):
        super().__init__()
        self.base, self.scale = head, alpha / rank
        self.lora_A = torch.nn.Linear(head.in_features, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, head.out_features, bias=False)
        torch.nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
        torch.nn.init.zeros_(self.lora_B.weight)
        self.dropout = torch.nn.Dropout(dropout)

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([self.base.weight, self.lora_B.weight], 1)

    def widen(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, self.lora_A(self.dropout(h)) * self.scale], -1)


def add_head_adapter(model, rank: int, alpha: float, dropout: float, seed: int) -> None:
    head = _HeadAdapter(model.head, rank, alpha, dropout, torch.Generator().manual_seed(seed))
    model.head = head
    hidden = model.hidden
    model.hidden = lambda tokens: head.widen(hidden(tokens))


def base_model(folder: Path, like: LlamaConfig) -> LlamaConfig:
    """The shape a Hugging Face Llama `config.json` describes, the rest as `like` (the tier's model)."""
    c = json.loads((folder / "config.json").read_text())
    shape = dict(
        dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"], ffn_dim=c["intermediate_size"], vocab_size=c["vocab_size"],
    )  # fmt: skip
    return dataclasses.replace(like, **shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", default="trunc:0-9")
    ap.add_argument("--val", default="trunc:10-12")
    ap.add_argument("--mode", choices=("lora", "full", "head", "lora+head", "attn"), default="lora")
    ap.add_argument("--head-dropout", type=float, default=None, help="the head adapter's dropout")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--write", type=Path, help="write the prepared folder here and stop")
    ap.add_argument("--base", type=Path, help="a base folder `ttt base` wrote (default: the shipped one)")
    args = ap.parse_args()
    src = args.data / "govreport" / "gov_report.validation.scrolls_format.jsonl"
    tok = sentencepiece_tok.load(args.data / "tokenizers" / "llama2" / "tokenizer.model")
    docs = documents(src)
    splits = {s: blocks(tok, docs, spec, s) for s, spec in (("train", args.train), ("validation", args.val))}
    for s, (ids, labels) in splits.items():
        print(f"{s}: {ids.shape[0]} blocks, {int((labels != -100).sum())} labelled tokens")
    out = args.write
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="lora_tiny_gain_"))
    for s, spec in (("train", args.train), ("validation", args.val)):
        write(out, s, *splits[s], src, tok, spec)
    if args.write is not None:
        return

    bench = get("llama2_70b_lora")
    tier = dataclasses.replace(bench.tier("tiny"), eval_samples=len(splits["validation"][0]))
    base, dev = args.base or shipped_base(tier.base), torch.device("cpu")
    if args.base is not None:
        keep = json.loads((base / "base.json").read_text()).get("vocab_keep", tier.data.vocab_keep)
        tier = dataclasses.replace(
            tier, model=base_model(base, tier.model), data=dataclasses.replace(tier.data, vocab_keep=keep)
        )
    model = build_training(bench, tier, dev, args.seed, None, base).model
    data = bench.task.open(
        tier,
        bench.task.resolve(tier, out, init_checkpoint=base),
        args.seed,
        Share.of(tier.global_batch_size),
        dev,
    )
    if args.mode == "lora+head":
        d = tier.data
        add_head_adapter(
            model, d.rank, d.alpha, d.dropout if args.head_dropout is None else args.head_dropout, args.seed
        )
    elif args.mode != "lora":
        for name, p in model.named_parameters():
            p.requires_grad = args.mode == "full" or (
                "attn" in name if args.mode == "attn" else ("head" in name or "norm" in name)
            )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)

    def held_out() -> float:
        model.eval()
        with torch.no_grad():
            v = data.evaluate(model)
        model.train()
        return round(v, 4)

    t0 = time.monotonic()
    curve = [{"step": 0, "eval": held_out()}]
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        loss = data.loss(model, data.batch(step))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.3)
        opt.step()
        if (step + 1) % args.eval_every == 0:
            curve.append({"step": step + 1, "eval": held_out(), "train": round(loss.item(), 3)})
    trained = sum(p.numel() for p in params)
    best = min(curve, key=lambda c: c["eval"])
    print(json.dumps({
        "mode": args.mode, "trainable": trained, "lr": args.lr, "train": args.train, "base": curve[0]["eval"],
        "best": best, "gain": round(curve[0]["eval"] - best["eval"], 4), "seconds": round(time.monotonic() - t0),
        "curve": curve,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
