"""`ttt run --dry-run` (alias `--print-config`): what a run would use, without building a model or writing.

The resolved tier, every setting with where its value came from (the tier, `--set` on the command line,
the `[set]` table of `--config`, or derived: a new global batch size takes its RCP's LR and warmup), the
command's options with theirs, the verdict of the rule check `ttt run` makes before its first log line
(`mlperf.keys.check_rules`), and the parallel plan: layout, per-rank batch and micro-batches, parameters and
the per-rank memory estimate of `ttt plan`. Nothing is read from --data and nothing is created.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from timetotrain import strictjson
from timetotrain.errors import UserError
from timetotrain.mlperf.keys import check_rules
from timetotrain.spec import registry
from timetotrain.spec.benchmark import SETTABLE, apply_overrides, init_needed, init_warning, setting
from timetotrain.train import distributed, embedding_memory, memory, parallel, synth
from timetotrain.train.prepare import settle_micro_batch

# The options shown besides the tier's settings (the rest only shape the output of the command).
_SKIP = {"set", "json", "quiet", "dry_run", "config", "func", "command", "config_doc", "sources", "steps",
         "warmup_steps", "layers"}  # fmt: skip


def _set_keys(items: list[str]) -> set[str]:
    return {i.partition("=")[0].strip().replace("-", "_") for i in items}


def resolve(args, command: str = "run") -> dict:
    bench = registry.get(args.benchmark)
    declared = bench.tier(args.tier)
    sets = list(args.set or [])
    conf = (args.config_doc or {}).get("values", {}) if getattr(args, "config_doc", None) else {}
    from_file = list(conf.get("set", []))
    # argparse appends the command line's --set after the file's (cli/config.py): the last value wins.
    on_line = _set_keys(sets[len(from_file) :])
    in_file = _set_keys(from_file)
    tier = apply_overrides(bench, declared, sets)
    extra = {}
    if command == "synth":  # what `ttt synth` does to the tier before it builds (train/synth.py)
        given = args.layers is not None
        layers = args.layers if given else bench.synth_layers.get(tier.name)
        if layers is not None:
            tier = synth.with_layers(bench, tier, layers)
        steps = args.steps if args.steps is not None else synth.DEFAULT_STEPS.get(tier.name, 20)
        warmup = (
            args.warmup_steps if args.warmup_steps is not None else synth.DEFAULT_WARMUP.get(tier.name, 5)
        )
        depth_from = "--layers" if given else "the tier's synth default" if layers is not None else None
        extra["synth"] = {
            "steps": steps,
            "warmup_steps": warmup,
            "layers": layers,
            "layers_source": depth_from,
        }
    settings = {}
    for name in (*SETTABLE, *bench.task.settable):
        value = setting(tier, name)
        if name in on_line:
            source = "--set"
        elif name in in_file:
            source = "--config [set]"
        elif value != setting(declared, name):
            source = "derived from --set " + ", ".join(sorted(on_line | in_file))
        else:
            source = "tier"
        settings[name] = {"value": value, "source": source}
    sources = getattr(args, "sources", {})
    options = {
        k.replace("_", "-"): {"value": v, "source": sources.get(k, "default")}
        for k, v in vars(args).items()
        if k not in _SKIP and k != "benchmark" and not callable(v)
    }
    return {
        "command": command,
        "benchmark": bench.name,
        "tier": tier.name,
        "division": tier.division,
        "model": {
            "family": bench.family.name,
            "parameters": bench.family.param_count(tier.model),
            **_plain(dataclasses.asdict(tier.model)),
        },
        "settings": settings,
        "options": options,
        "rules": _rules(bench, tier) if command == "run" else _NOT_A_RESULT,
        "init_checkpoint": _init(bench, tier, args) if command == "run" else None,
        "plan": _plan(bench, tier, args),
        "config": args.config_doc,
        **extra,
    }


_NOT_A_RESULT = {"verdict": "not checked", "reason": "a synth run is never a result", "rules": "none"}


def _plain(v):
    """A model config as JSON values (tuples as lists, anything else as its text)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v if v is None or isinstance(v, bool | int | float | str) else str(v)


def _rules(bench, tier) -> dict:
    """The check `ttt run` makes before its first log line: the tier's rule file (the official closed rules
    at the reference tier, plus the training rules no yaml checks)."""
    which = "official closed rules" if tier.name == "reference" else f"rules/{bench.name}_{tier.name}.yaml"
    if tier.name == "reference" and tier.division != "closed":
        return {"verdict": "not checked", "reason": "open division: no closed rule applies", "rules": which}
    try:
        check_rules(bench, tier)
    except UserError as e:
        return {"verdict": "refused", "reason": str(e), "rules": which}
    return {"verdict": "pass", "reason": None, "rules": which}


def _init(bench, tier, args) -> dict:
    """The checkpoint the tier starts from (`init_needed`) and the --init-checkpoint given; "warning": the
    line `run` prints where the tier needs one and none is given (the run would start from random weights)."""
    given = getattr(args, "init_checkpoint", None)
    return {"needed": init_needed(bench, tier), "given": given, "warning": init_warning(bench, tier, given)}


def _plan(bench, tier, args) -> dict:
    """The layout `ttt run` would take in this process (torchrun's environment, else one process)."""
    d = distributed.from_env()
    precision = args.precision
    if precision is None:  # `ttt synth`'s default: bf16 on a GPU, fp32 on a CPU
        cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        precision = "bf16" if cuda else "fp32"
    ac = parallel.ac_every(args.ac, getattr(args, "ac_every", None), getattr(tier.model, "n_layers", None))
    p = parallel.parse(args.parallel, d.world, precision=precision, activation_checkpointing=ac,
                       compile=args.compile)  # fmt: skip
    local = parallel.check_batch_split(tier.global_batch_size, p)
    # As `ttt run`'s preflight settles it, the pipeline schedule's micro-batches included.
    micro = settle_micro_batch(bench, tier, p, local)
    doc = {
        "world_size": d.world,
        "parallel": p.describe(),
        "per_rank_batch": local,
        "micro_batch_size": micro,
        "accumulation_steps": local // micro if local % micro == 0 else None,
        "memory_per_rank_gib": None,
        "memory_per_rank_gib_reason": None,
    }
    kind = "fsdp" if p.fsdp > 1 and p.ep == 1 else "ep,fsdp" if p.fsdp > 1 else "ep" if p.ep > 1 else "dp"
    kind = "hsdp" if p.dp_replicate > 1 and p.ep == 1 else kind  # (with ep: `ep,fsdp` with replicas)
    if p.tp > 1 or p.pp > 1:
        doc["memory_per_rank_gib_reason"] = (
            f"{'pipeline' if p.pp > 1 else 'tensor'}-parallel layouts: see ttt plan"
        )
        return doc
    if bench.family.embedding_tables is not None:  # tables sharded over the dp ranks, as ttt plan counts them
        per = embedding_memory.per_rank(bench, tier, d.world, 1e9)
        doc["memory_per_rank_gib"] = round(per["ranks"][per["worst_rank"]]["total"] / memory.GiB, 3)
        doc["memory_per_rank_gib_reason"] = "ttt plan's estimate for the most loaded rank's tables"
        return doc
    try:
        fp8 = memory.fp8_model(bench, tier) if args.precision == "fp8" else None
        bf16 = args.precision in ("bf16", "fp8")
        est = memory.estimate(
            bench, tier, 0, d.world, 0.0, kind, ac, micro, bf16, fp8=fp8, replicas=p.dp_replicate,
            ep=p.ep if p.ep > 1 else None, cp=p.cp,
        )  # fmt: skip
        doc["memory_per_rank_gib"] = round((est.total - est.margin) / memory.GiB, 3)
        doc["memory_per_rank_gib_reason"] = "ttt plan's estimate, without its margin"
    except Exception as e:  # a family ttt plan does not model (rgat): say so, never fail the dry run
        doc["memory_per_rank_gib_reason"] = f"no estimate ({type(e).__name__})"
    return doc


def _show(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return "-" if v is None else str(v)


def format_text(doc: dict) -> str:
    lines = [
        f"ttt {doc['command']} {doc['benchmark']} --tier {doc['tier']}: dry run (no model built, nothing written)"
    ]
    m = doc["model"]
    lines.append(f"model: {m['family']}, {m['parameters']:,} parameters")
    if "synth" in doc:
        sy = doc["synth"]
        depth = f", {sy['layers']} layer(s) ({sy['layers_source']})" if sy["layers"] else ""
        lines.append(f"synth: {sy['steps']} timed steps after {sy['warmup_steps']} warm-up{depth}")
    if doc["config"]:
        lines.append(f"config: {doc['config']['file']} (sha256 {doc['config']['sha256'][:12]}…)")
    w = max(len(k) for k in (*doc["settings"], *doc["options"]))
    lines.append("settings:")
    lines += [f"  {k:<{w}}  {_show(s['value']):<14}  {s['source']}" for k, s in doc["settings"].items()]
    lines.append("options:")
    lines += [f"  {k:<{w}}  {_show(s['value']):<14}  {s['source']}" for k, s in doc["options"].items()]
    r = doc["rules"]
    lines.append(f"rules: {r['verdict']} ({r['rules']})" + (f": {r['reason']}" if r["reason"] else ""))
    p = doc["plan"]
    mem = (
        f"~{p['memory_per_rank_gib']:.2f} GiB per rank ({p['memory_per_rank_gib_reason']})"
        if p["memory_per_rank_gib"] is not None
        else p["memory_per_rank_gib_reason"]
    )
    lines.append(
        f"plan: {p['parallel']} on {p['world_size']} process(es): {p['per_rank_batch']} samples per rank per step "
        f"in {p['accumulation_steps']} micro-batch(es) of {p['micro_batch_size']}; {mem}"
    )
    return "\n".join(lines)


def run(args, command: str = "run") -> int:
    """Print the dry run; exit 0 when `ttt run` would start, 1 when its rule check would refuse."""
    doc = resolve(args, command)
    if doc["init_checkpoint"] and doc["init_checkpoint"]["warning"]:
        print(f"ttt: warning: {doc['init_checkpoint']['warning']}", file=sys.stderr)  # --json keeps stdout
    print(strictjson.dumps(doc, indent=2) if args.json else format_text(doc))
    return 0 if doc["rules"]["verdict"] != "refused" else 1
