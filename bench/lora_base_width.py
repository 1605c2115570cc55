"""Make a llama2_70b_lora tiny base of another shape with the tier's own recipe, for bench/lora_tiny_gain.py.

    python bench/lora_base_width.py --dim 256 --data data/c4-llama2 --cache /tmp/bases
    python bench/lora_base_width.py --dim 384 --steps 800 --data data/c4-llama2 --cache /tmp/bases
    python bench/lora_base_width.py --dim 128 --head-dim 32 --vocab-keep 511 --data data/c4-llama2 --cache /tmp/bases
    python bench/lora_tiny_gain.py --base FOLDER --mode lora     # the folder printed above

Issue 29: with the shipped base (width 128) the tier's LoRA (rank 16 on qkv + o) gains 0.02-0.037 nats on
the held-out summaries, where the 5% margin of `tests/untrained.py` needs about 0.25. This script asks
whether a wider base (attention a larger share of the weights, wider adapters) changes that. It runs
`TINY_BASE` (`suite/llama2_70b_lora.py`: C4 sample, 512-token windows, NeMo warmup + cosine 6e-3 to 6e-4,
the closed llama31_8b AdamW, seed 0) through `ttt base`'s own `make_base` with only the model shape (and
optionally the step count) changed: `--dim` D, `--layers` (2), head width `--head-dim` (64; the shipped base
has 32), as many KV heads as half the query heads (the shipped base's GQA ratio), FFN 3 x D (its ratio),
the same 4,096-entry vocabulary unless `--vocab-keep K` keeps the K most frequent ids plus "other" (K + 1
rows of embedding and head: the tiny model's width to vocabulary ratio is 1 : 32, Llama 2 70B's 1 : 4).
The shipped v1 is untouched; the base goes to `--cache` under the recipe's content key, like `ttt base`. Prints one JSON line: the folder, the shape, the parameter count, the
pretraining seconds and threads, the C4 eval loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from safetensors.torch import load_file

from timetotrain.spec.benchmark import base_recipe
from timetotrain.spec.registry import get
from timetotrain.train.base_model import make_base


def recipe(dim: int, layers: int, head_dim: int, steps: int | None, vocab_keep: int | None = None):
    tiny = get("llama2_70b_lora").tier("tiny")
    v1 = tiny.base
    pre = v1.pretraining
    heads = dim // head_dim
    model = dataclasses.replace(
        pre.model, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=max(1, heads // 2), ffn_dim=3 * dim
    )
    fields = {
        f.name: getattr(pre, f.name)
        for f in dataclasses.fields(pre)
        if f.name not in ("name", "target", "runs", "division", "description", "base")
    }
    if vocab_keep is not None:
        model = dataclasses.replace(model, vocab_size=vocab_keep + 1)
        fields["data"] = dataclasses.replace(pre.data, vocab_keep=vocab_keep)
    fields.update(model=model, max_steps=steps or pre.max_steps)
    bench = v1.benchmark
    return base_recipe(
        "llama2_70b_lora", task=bench.task, family=bench.family, optimizer=bench.optimizer,
        schedule=bench.schedule, seed=v1.seed, data_hint=v1.data_hint, **fields,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--steps", type=int, help="pretraining steps (the recipe's 400 if left out)")
    ap.add_argument(
        "--vocab-keep", type=int, help="ids kept besides 'other' (the recipe's 4,095 if left out)"
    )
    ap.add_argument("--data", type=Path, required=True, help="C4 prepared with the Llama 2 tokenizer")
    ap.add_argument("--cache", type=Path, required=True)
    args = ap.parse_args()
    r = recipe(args.dim, args.layers, args.head_dim, args.steps, args.vocab_keep)
    folder, doc, cached = make_base(r, args.data, args.cache, echo=False)
    m = r.pretraining.model
    params = sum(t.numel() for t in load_file(folder / "model.safetensors").values())
    print(json.dumps({
        "folder": str(folder), "cached": cached, "dim": m.dim, "layers": m.n_layers, "heads": m.n_heads,
        "kv_heads": m.n_kv_heads, "ffn": m.ffn_dim, "params": params, "steps": doc["steps"],
        "seconds": doc["seconds"], "threads": doc["threads"],
        "c4_eval_loss": round(doc["eval_loss"], 4), "weights_sha256": doc["weights_sha256"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
