"""`ttt list`, `ttt run`, `ttt synth`, `ttt plan`, `ttt rcp build`: the benchmarks and training runs.

Heavy modules (torch, the training loop, the dry run, the RCP builder: 1-2 s each) are imported inside the
commands, so `ttt --help` stays fast; `run_set` also enters its abort watcher before the loop imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from timetotrain import fileio, strictjson
from timetotrain.cli import config, flags
from timetotrain.errors import UserError
from timetotrain.interrupt import raise_on_signals
from timetotrain.spec import registry
from timetotrain.train.abort import Aborter
from timetotrain.train.seeds import run_seeds


def _cmd_list(args) -> int:
    rows = []
    for name in registry.names():
        b = registry.get(name)
        for t in b.tiers.values():
            rows.append(
                {
                    "benchmark": name,
                    "tier": t.name,
                    "target": t.target,
                    "metric": b.metric,
                    "eval_every_samples": t.eval_every_samples,
                    "eval_samples": t.eval_samples,
                    "global_batch_size": t.global_batch_size,
                    "sample": "{1:,} {0}".format(*b.task.sample_items(t)),
                    "runs": t.runs,
                    "division": t.division,
                    "description": t.description,
                }
            )
    if args.json:
        print(strictjson.dumps(rows, indent=2))
        return 0
    head = f"{'benchmark':<17}{'tier':<11}{'target':>8}{'eval every':>13}{'eval set':>12}{'GBS':>7}{'sample':>14}{'runs':>6}  about"
    print(head)
    for r in rows:
        print(
            f"{r['benchmark']:<17}{r['tier']:<11}{r['target']:>8}{r['eval_every_samples']:>13,}"
            f"{r['eval_samples']:>12,}{r['global_batch_size']:>7}{r['sample']:>14}{r['runs']:>6}  {r['description']}"
        )
    print("\ntarget: the eval metric a run must meet to stop with success:")
    for name in registry.names():
        print(f"  {name}: {registry.get(name).metric}")
    print("eval cadence and eval set are in samples; runs: the number of runs a submission needs.")
    return 0


def _check_seconds(args) -> None:
    """A negative or non-finite timeout would only show when a collective or an abort waits on it,
    hours into a run."""
    if not (math.isfinite(args.dist_timeout) and args.dist_timeout > 0):
        raise UserError(f"--dist-timeout {args.dist_timeout:g} must be a positive number of seconds")
    if not (math.isfinite(args.abort_grace) and args.abort_grace >= 0):
        raise UserError(f"--abort-grace {args.abort_grace:g} must be a number of seconds >= 0")


def _cmd_run(args) -> int:
    if args.runs < 1:
        raise UserError(f"--runs {args.runs} must be at least 1")
    if args.save_checkpoint is not None and args.runs > 1:
        raise UserError(
            f"--save-checkpoint with --runs {args.runs}: each run would replace it; pass --runs 1"
        )
    _check_seconds(args)
    if args.dry_run:
        from timetotrain.cli import dryrun

        return dryrun.run(args)
    results = run_set(args, run_seeds(args.seed, args.runs))
    if args.json and results and results[0][1].log_path is not None:  # rank 0 only
        print(strictjson.dumps(run_summary(args, results), indent=2))
    return max(r.exit_code for _, r in results)


def run_summary(args, results: list) -> dict:
    """`ttt run --json`: one object after the runs, with one entry per run (the lines stderr showed)."""
    runs = [
        {
            "seed": seed,
            "status": r.status,
            "reason": r.reason,
            "steps": r.steps,
            "samples": r.samples,
            "last_eval": r.last_eval,
            "seconds": r.seconds,
            f"{r.item_name}_per_s": r.items_per_s,
            "log": str(r.log_path),
            "exit_code": r.exit_code,
        }
        for seed, r in results
    ]
    met = sum(r.status == "success" for _, r in results)
    return {"benchmark": args.benchmark, "tier": args.tier, "runs": runs, "met_target": met, "of": len(runs)}


def run_set(args, seeds: list[int], **fixed) -> list:
    """Consecutive runs, one per seed. A UserError or a crash stops the set; a run that misses its target
    does not (it is a result); a signal stops it after that run's log is complete. `fixed` overrides
    RunOptions fields that `args` does not carry."""
    # Entered before torch is imported: threads torch starts later inherit the blocked SIGTERM/SIGINT,
    # which only the abort watcher then receives (see train/abort.py).
    with Aborter() as aborter:
        from timetotrain.train.loop import RunOptions, run
        from timetotrain.train.terminal import status_word, stop_line

        flags = {
            k: getattr(args, a)
            for k, a in [("max_steps", "max_steps"), ("device", "device"), ("org", "org"), ("platform", "platform"),
                         ("parallel", "parallel"), ("precision", "precision"), ("activation_checkpointing", "ac"),
                         ("compile", "compile"), ("dist_timeout", "dist_timeout"), ("abort_grace", "abort_grace"),
                         ("init_checkpoint", "init_checkpoint"), ("save_checkpoint", "save_checkpoint"),
                         ("tensorboard", "tensorboard"), ("wandb", "wandb"), ("config", "config_doc")]
            if hasattr(args, a)
        }  # fmt: skip
        if hasattr(args, "ac"):  # --ac and --ac-every K: one number (train/parallel.py)
            from timetotrain.train.parallel import ac_every

            flags["activation_checkpointing"] = ac_every(args.ac, getattr(args, "ac_every", None))
        results = []
        for i, seed in enumerate(seeds):
            if len(seeds) > 1:
                print(f"run {i + 1}/{len(seeds)} (seed {seed})", file=sys.stderr)
            # --json keeps stdout for the summary: no MLLOG echo.
            echo = not (getattr(args, "quiet", True) or getattr(args, "json", False))
            opts = RunOptions(
                benchmark=args.benchmark, tier=args.tier, data=Path(args.data), logdir=Path(args.logdir),
                seed=seed, sets=args.set or [], echo=echo, aborter=aborter,
                **{**flags, **fixed},
            )  # fmt: skip
            res = run(opts)
            results.append((seed, res))
            if res.log_path is None:  # not global rank 0: the log and the report are rank 0's
                continue
            sig = res.exit_code - 128 if res.exit_code > 128 else None
            figures = (
                f"{res.steps} steps, {res.samples:,} samples, {res.seconds:.1f} s run_start->run_stop, "
                f"{res.items_per_s:,.0f} {res.item_name}/s"
            )
            print(stop_line(status_word(res.status, sig), res.reason, res.log_path, figures), file=sys.stderr)
            if res.exit_code > 128:
                break
    if len(results) > 1 and results[0][1].log_path is not None:
        print(f"\n{'seed':>12}  {'status':<8}{'samples':>10}{'seconds':>10}  log", file=sys.stderr)
        for seed, r in results:
            print(
                f"{seed:>12}  {r.status:<8}{r.samples:>10,}{r.seconds:>10.1f}  {r.log_path}", file=sys.stderr
            )
        ok = sum(r.status == "success" for _, r in results)
        print(f"{ok}/{len(results)} runs met the target", file=sys.stderr)
    return results


def _cmd_synth(args) -> int:
    if args.dry_run:
        from timetotrain.cli import dryrun

        return dryrun.run(args, "synth")
    from timetotrain.train.parallel import ac_every
    from timetotrain.train.synth import SynthOptions, format_table, synth

    summary = synth(
        SynthOptions(
            benchmark=args.benchmark,
            tier=args.tier,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            micro_batch=args.micro_batch,
            logdir=Path(args.logdir),
            sets=args.set or [],
            device=args.device,
            precision=args.precision,
            seed=args.seed,
            parallel=args.parallel,
            activation_checkpointing=ac_every(args.ac, args.ac_every),
            compile=args.compile,
            layers=args.layers,
            tensorboard=Path(args.tensorboard) if args.tensorboard else None,
            wandb=args.wandb,
            config=args.config_doc,
            threads=args.threads,
        )
    )
    if "log" in summary and args.json:  # rank 0 only
        print(strictjson.dumps(summary, indent=2))
        if summary["host"]["host_busy"]:  # the table's "host" row says it otherwise
            print(f"ttt: {summary['host']['note']}", file=sys.stderr)
    elif "log" in summary:
        print(format_table(summary))
        print(f"log: {summary['log']}\nsummary: {summary['summary_path']}")
    return 0


def _cmd_rcp_build(args) -> int:
    """Run the tier N times (distinct seeds), then write the official-format RCP JSON of its converged runs."""
    from timetotrain.mlperf.rcp import build_rcp_json

    out = rcp_out(args.benchmark, args.tier, args.out)
    if args.tier == "reference":
        raise UserError("--tier reference uses the official MLCommons RCPs; ttt rcp build is for our tiers")
    if args.runs < 3:
        raise UserError(f"--runs {args.runs}: an RCP needs at least 3 converged runs")
    results = run_set(args, run_seeds(args.seed, args.runs))
    if any(r.exit_code > 128 for _, r in results):
        return max(r.exit_code for _, r in results)
    from timetotrain.mlperf.results import parse_log

    converged = [parse_log(r.log_path) for _, r in results if r.status == "success"]
    doc = build_rcp_json(args.benchmark, args.tier, converged)
    out.parent.mkdir(parents=True, exist_ok=True)
    fileio.write_text(out, json.dumps(doc, indent=2) + "\n")
    for name, rec in doc.items():
        print(
            f"{name}: BS {rec['BS']}, {len(converged)}/{len(results)} runs converged, "
            f"samples to converge {rec[_points_key(rec)]}"
        )
    print(f"wrote {out}")
    return 0


def rcp_out(benchmark: str, tier: str, given: str | None) -> Path:
    """Where `ttt rcp build` writes: --out, else ./<bench>_<tier>_rcp.json in the working folder. Never the
    package's own RCP by default: under an editable install that is a tracked source file, and a set of runs
    made elsewhere (another machine, other seeds) would silently replace the RCP that `ttt score` checks
    every later run against. Shipping a new one is a deliberate copy into timetotrain/suite/rcps/. Checked
    before any run: an existing default file is not overwritten."""
    if given:
        return Path(given)
    out = Path.cwd() / f"{benchmark}_{tier}_rcp.json"
    if out.exists():
        raise UserError(f"{out} exists: pass --out FILE to choose where the RCP goes, or move that file away")
    return out


def _points_key(rec: dict) -> str:
    return next(k for k in rec if k.lower().endswith("to converge"))


def _cmd_base(args) -> int:
    bench = registry.get(args.benchmark)
    tier = bench.tier(args.tier)
    if tier.base is None:
        with_base = [
            f"{b} --tier {t.name}" for b in registry.names() for t in registry.get(b).tiers.values() if t.base
        ]
        raise UserError(
            f"{args.benchmark} --tier {args.tier} starts from no base of ours (random init or a real checkpoint); "
            f"tiers with one: {', '.join(with_base) or 'none'}"
        )
    from timetotrain.train.base_model import make_base

    cache = Path(args.cache) if args.cache else None
    # SIGTERM/SIGINT raise, so make_base removes its unfinished .partial folder on the way out.
    with raise_on_signals():
        folder, doc, cached = make_base(
            tier.base, Path(args.data), cache, args.device or "cpu", echo=not args.quiet
        )
    how = "cached" if cached else f"made in {doc['seconds']:.0f} s"
    print(
        f"base for {args.benchmark} {args.tier} ({how}): {doc['steps']} steps, {doc['tokens']:,} tokens, "
        f"eval loss {doc['eval_loss']:.4f}, weights sha256 {doc['weights_sha256'][:12]}…",
        file=sys.stderr,
    )
    shipped = tier.base.shipped
    if shipped is not None:  # the tier runs from the shipped bits; say whether this host reproduced them
        same = doc["weights_sha256"] == shipped.weights_sha256
        print(
            f"the tier's shipped base {shipped.name}: {'the same weights, bit for bit' if same else 'other bits'}"
            + ("" if same else f" (it pins {shipped.weights_sha256[:12]}…; another CPU or thread count rounds "
               "the recipe differently; `ttt run` without --init-checkpoint uses the shipped one)"),
            file=sys.stderr,
        )  # fmt: skip
    print(folder)  # stdout: the folder alone, for `--init-checkpoint "$(ttt base ...)"`
    return 0


def _cmd_plan(args) -> int:
    from timetotrain.spec.benchmark import apply_overrides, follows_rcp_table
    from timetotrain.train.memory import (
        fits_from,
        format_plan,
        fp8_model,
        nothing_fits,
        plan,
        plan_at_legal_gbs,
        plan_doc,
    )
    from timetotrain.train.parallel import ac_every

    bench = registry.get(args.benchmark)
    tier = apply_overrides(bench, bench.tier(args.tier), args.set or [])
    # --ac / --ac-every K: only that checkpointing is planned (None: each layout without and with it).
    ac = ac_every(args.ac, args.ac_every, getattr(tier.model, "n_layers", None)) or None
    if args.precision != "fp8" and "fp8_recipe" in tier.user_set:
        raise UserError(f"--set fp8_recipe={tier.fp8_recipe} applies to --precision fp8 only")
    if bench.family.embedding_tables is not None:  # embedding tables sharded over the dp ranks
        from timetotrain.train.embedding_memory import format_per_rank, per_rank

        if args.parallel and not args.parallel.startswith("dp="):
            raise UserError(f"--parallel {args.parallel!r}: a model with embedding tables runs dp=N only")
        if args.precision == "fp8":
            raise UserError(
                f"--precision fp8: {bench.name} has no block linears to train in float8; use bf16"
            )
        doc = per_rank(bench, tier, args.gpus, args.gpu_mem, args.gpus_per_node)
        sim = _simulate_tables(args, bench, tier, doc) if args.simulate else None
        if sim and args.json:
            doc["simulation"] = sim[1]
        print(strictjson.dumps(doc, indent=2) if args.json else format_per_rank(doc))
        if sim and not args.json:
            print(sim[0])
        return 0 if doc["fits"] else 1
    fp8 = fp8_model(bench, tier) if args.precision == "fp8" else None
    if fp8 and args.gpus > 1:
        from timetotrain.train.float8 import check_mx_parallel

        check_mx_parallel(fp8.recipe, args.parallel or f"on --gpus {args.gpus}")
    bf16, gpn = args.precision in ("bf16", "fp8"), args.gpus_per_node
    # A layout or a GBS the user named is theirs: planned as given, or refused in one line.
    searched = (
        not args.parallel and "global_batch_size" not in tier.user_set and follows_rcp_table(bench, tier)
    )
    retier = lambda gbs: apply_overrides(bench, tier, [*(args.set or []), f"global_batch_size={gbs}"])  # noqa: E731
    tier, (n, rows, best), gbs_note = plan_at_legal_gbs(
        bench,
        tier,
        args.gpus,
        lambda t: plan(bench, t, args.gpus, args.gpu_mem, args.parallel, bf16, gpn, fp8, ac),
        retier if searched else None,
    )
    larger = (
        None if best else fits_from(bench, tier, args.gpus, args.gpu_mem, args.parallel, bf16, gpn, fp8, ac)
    )
    sim = _simulate(args, bench, tier, rows, best, ac) if args.simulate else None
    show = plan_doc if args.json else format_plan
    extra = {"simulated": sim[0]} if sim else {}
    if fp8:
        extra["fp8"] = fp8
    if best is None and larger is None:  # no world fits: say why, in numbers, and what would be needed
        extra["why"] = nothing_fits(bench, tier, args.gpus, args.gpu_mem, args.parallel, bf16, gpn, fp8, ac)
    out = show(
        bench, tier, n, rows, best, args.gpus, args.gpu_mem, bf16, gpus_per_node=gpn, larger=larger, **extra
    )
    if sim and args.json:
        out["simulation"] = sim[2]
    if gbs_note and args.json:
        out["global_batch_size_chosen"] = gbs_note
    elif gbs_note:
        out = f"{gbs_note}\n{out}"
    print(strictjson.dumps(out, indent=2) if args.json else out)
    if sim and not args.json:
        print(sim[1])
    return 0 if best is not None else 1


def _simulate_tables(args, bench, tier, doc: dict):
    """`ttt plan --simulate` for a model with embedding tables: its `dp=N` job's rank (--rank), the last rank
    and the rank the per-rank count finds largest, built and stepped (train/simulate.py), beside that count.
    (the report, as data)."""
    from timetotrain.train.simulate import format_simulation, simulate

    if args.layers is not None:
        raise UserError(
            f"--layers {args.layers}: {bench.name} is simulated at its full depth (its few layers are not "
            "repeated enough to extrapolate); drop --layers"
        )
    spec = args.parallel or doc["parallel"]
    sim = simulate(
        bench, tier, args.gpus, spec, args.rank, None, args.precision, 0, also=(doc["worst_rank"],)
    )
    counted = {r: doc["ranks"][r]["total"] for r in sim.ranks}
    top = sim.most_loaded()
    data = {
        **dataclasses.asdict(sim),
        "most_loaded_rank": top.rank,
        "peak_bytes": top.total,
        "peak_phase": top.peak_phase,
        "counted_bytes": counted,
    }
    return format_simulation(sim, None, args.gpu_mem, counted=counted), data


def _simulate(args, bench, tier, rows, best, given_ac: int | None):
    """`ttt plan --simulate`: ({(parallel, ac, micro): simulated peak + margin}, the report, as data). The
    row simulated is the suggested one (its AC and micro-batch) when the layout fits, else AC as --ac or
    --ac-every (`given_ac`) says at the tier's micro-batch."""
    from timetotrain.train.simulate import format_simulation, simulate

    if not args.parallel:
        raise UserError("--simulate needs --parallel: the layout to build (e.g. --parallel fsdp=8)")
    ac = given_ac or (best.ac if best is not None else 0)
    if best is not None and not given_ac:
        tier = dataclasses.replace(tier, micro_batch_size=best.micro_batch)
    sim = simulate(bench, tier, args.gpus, args.parallel, args.rank, args.layers, args.precision, ac)
    est = next((r for r in rows if r.ac == ac and r.micro_batch == sim.micro_batch), None)
    top = sim.most_loaded()
    key = (est.parallel, ac, sim.micro_batch) if est else None
    cells = {key: top.total + est.margin} if est else {}
    doc = {
        **dataclasses.asdict(sim),
        "most_loaded_rank": top.rank,
        "peak_bytes": top.total,
        "peak_phase": top.peak_phase,
    }
    return cells, format_simulation(sim, est, args.gpu_mem), doc


def add_list(sub) -> None:
    """Register `list` (first in `ttt --help`, before `data`)."""
    s = sub.add_parser(
        "list",
        help="benchmarks x tiers: target, eval cadence, runs required",
        description="Every benchmark x tier: the quality target and its metric, the eval cadence and eval set "
        "(in samples), the global batch size, what one sample is, and how many runs a submission needs.",
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=_cmd_list)


def add_commands(sub) -> None:
    """Register run, synth, plan, base and rcp build."""
    _add_run(sub)
    _add_synth(sub)
    _add_plan(sub)
    _add_base(sub)
    _add_rcp(sub)


def _add_run(sub) -> None:
    s = sub.add_parser(
        "run",
        help="a timed training run to the quality target, logged in the MLPerf format",
        description="Train BENCH at TIER until the eval metric meets the target. Writes one new "
        "<logdir>/<benchmark>/<tier>/result_<k>.txt per run. Exit 0 on success, non-zero when aborted.",
    )
    flags.add_benchmark(s, "tier: tiny (2 CPU cores, minutes) or reference (closed config)")
    flags.add_run_set(s, runs=1)
    s.add_argument(
        "--max-steps", type=int, default=None, help="stop after N steps (aborted if not converged)"
    )
    flags.add_set(s)
    flags.add_device(s)
    s.add_argument("--org", default="timetotrain", help="submission_org to log")
    s.add_argument("--platform", default=None, help="submission_platform to log (default: from the host)")
    s.add_argument("--quiet", action="store_true", help="do not echo MLLOG lines to stdout")
    s.add_argument(
        "--json",
        action="store_true",
        help="no MLLOG echo; after the runs, print a summary of each (status, samples, seconds, log) as JSON",
    )
    s.add_argument(
        "--dist-timeout",
        type=float,
        default=600.0,
        help="seconds a collective may wait for a peer (default 600)",
    )
    s.add_argument(
        "--abort-grace",
        type=float,
        default=10.0,
        help="after SIGTERM/SIGINT, seconds to finish the step and log run_stop before exiting (default 10)",
    )
    s.add_argument(
        "--save-checkpoint",
        default=None,
        metavar="DIR",
        help="after run_stop (off the clock), save the trained model and optimizer as a ttt checkpoint "
        "folder, for --init-checkpoint (one run: --runs 1)",
    )
    config.add_flag(s)
    flags.add_dry_run(s, "the rule check's verdict and the parallel plan")
    flags.add_layout(s, precision_default="fp32")
    flags.add_trackers(s)
    s.set_defaults(func=_cmd_run)


def _add_synth(sub) -> None:
    s = sub.add_parser(
        "synth",
        help="throughput with random weights and random tokens: no data needed",
        description="Run the benchmark's real model (its own init rule, random weights) on random tokens drawn "
        "on the device, with real forward/backward/optimizer steps, and report tokens/s, step times, model "
        "TFLOP/s, MFU and peak memory. Writes an MLPerf-format log and summary.json to "
        "<logdir>/synth/<benchmark>/<tier>/ (default ./synth/<benchmark>/<tier>/). Works under torchrun (one log, figures summed over ranks).",
    )
    flags.add_benchmark(s, "tiny (default) or reference (the full closed model)", tier_default="tiny")
    s.add_argument("--steps", type=int, default=None, help="timed steps (default 30 tiny, 20 reference)")
    s.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first (default 5)")
    s.add_argument("--micro-batch", type=int, default=None, help="micro-batch per rank (sets accumulation)")
    s.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU intra-op threads (default: OMP_NUM_THREADS, else the tier's setting, else one per core that "
        "other processes leave free, sampled from /proc/stat just before the run; MFU's peak is that of the "
        "threads used)",
    )
    s.add_argument(
        "--layers",
        type=int,
        default=None,
        help="use N repeated layers instead of the tier's, same width: a reference-width model that fits one "
        "device (e.g. --tier reference --layers 4); flux1: N blocks split double:single as the reference's "
        "19:38 (a third double, rounded: 3 -> 1 + 2, 57 -> 19 + 38); FLOPs and MFU are of the reduced model",
    )
    s.add_argument(
        "--logdir",
        default=".",
        help="the log and summary go to LOGDIR/synth/<benchmark>/<tier>/ (default: the current folder, so "
        "./synth/..., apart from the ./logs of `ttt run`; readers of results skip synth logs anyway)",
    )
    flags.add_set(s)
    flags.add_device(s)
    s.add_argument("--seed", type=int, default=None, help="seed for weights and tokens (default: random)")
    s.add_argument("--json", action="store_true", help="print the summary (summary.json's content) as JSON")
    config.add_flag(s)
    flags.add_dry_run(s, "steps, layers and the parallel plan")
    flags.add_layout(s, precision_default=None)
    flags.add_trackers(s)
    s.set_defaults(func=_cmd_synth)


def _add_plan(sub) -> None:
    s = sub.add_parser(
        "plan",
        help="estimate per-GPU memory and suggest a parallel configuration before launching",
        description="Estimate per-GPU memory (model states, bf16 copies, activations with and without "
        "activation checkpointing) for a tier on N GPUs, and suggest --parallel/--ac/micro-batch settings.",
    )
    flags.add_benchmark(
        s, "the tier to plan (default: reference, the closed configuration)", tier_default="reference"
    )
    s.add_argument("--gpus", type=int, required=True, help="number of GPUs (world size)")
    s.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs each node has (default 8): --gpus above it must be a multiple of it, the launch line is "
        "then one torchrun per node, and tensor parallelism stays within a node",
    )
    s.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in GiB, e.g. 80")
    flags.add_set(s)
    s.add_argument("--json", action="store_true", help="print the estimates and the suggestion as JSON")
    s.add_argument(
        "--simulate",
        action="store_true",
        help="also build the --parallel layout for one rank of --gpus ranks and run one training step, under "
        "torch's fake process group and fake tensors (no memory used), and report its bytes by kind beside "
        "the estimate (timetotrain/train/simulate.py); adds a 'simulated' column",
    )
    s.add_argument("--rank", type=int, default=0, help="with --simulate: the rank to simulate (default 0)")
    s.add_argument(
        "--layers",
        type=int,
        default=None,
        help="with --simulate: build N and N+1 layers (flux: N and N+3 blocks) and extrapolate linearly to the "
        "tier's depth (default: the full depth)",
    )
    flags.add_layout(
        s,
        precision_default="bf16",
        parallel_help="only this layout, as `ttt run --parallel` takes it on --gpus processes: dp=N, fsdp=N, "
        "ep=N, ep=N,fsdp=N or tp=T[,fsdp=F] (T x F = --gpus); default: dp and fsdp (and ep, ep x fsdp for an "
        "MoE model), then tp x fsdp within a node if none of those fits",
        precision_help="the compute precision the estimate assumes: bf16 (default: 2-byte activations and "
        "bf16 copies of the weights beside the fp32 master weights), fp32 (4-byte activations) or fp8 "
        "(torchao float8 block linears, --set fp8_recipe=...: no bf16 copies of them, float8 FSDP2 gathers "
        "under tensorwise, activations as bf16)",
        ac_help="plan (and --simulate) with activation checkpointing of every block only (default: each "
        "layout with and without it, and --simulate as the suggestion has it)",
        compile=False,
    )
    s.set_defaults(func=_cmd_plan)


def _add_base(sub) -> None:
    s = sub.add_parser(
        "base",
        help="pretrain the base model a fine-tuning tier starts from (off the clock, cached)",
        description="Runs the base recipe of BENCH's TIER (a small pretraining run with a fixed seed,\n"
        "timetotrain/train/base_model.py) on --data and writes a Hugging Face folder (config.json,\n"
        "model.safetensors, base.json, and vocab_table.npy when the vocabulary is narrowed) into the\n"
        "cache, keyed by the sha256 of the recipe and the data; prints the folder on stdout. A second call\n"
        "with the same inputs returns the cached folder at once. The tiers ship the base this recipe made\n"
        "(pinned by sha256) and run from it on every host; `ttt base` remakes it and says whether this\n"
        "CPU gave the same bits (another CPU family or thread count may round differently). Pass its\n"
        "folder to `ttt run --init-checkpoint` to run from the base you made.",
        epilog="example (sources/: `ttt data download fixtures --out sources`):\n"
        "  ttt data prepare c4 --src sources/c4/en --split train --tokenizer llama2 "
        "--tokenizer-model sources/tokenizers/llama2/tokenizer.model --out data/c4-llama2\n"
        "  (and --split validation)\n"
        "  ttt base llama2_70b_lora --tier tiny --data data/c4-llama2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_benchmark(s, "the tier whose base to make (default: tiny)", tier_default="tiny")
    s.add_argument("--data", required=True, help="the prepared data the base pretrains on (see the example)")
    s.add_argument(
        "--cache",
        default=None,
        help="where bases are kept (default: $TTT_CACHE/bases or ~/.cache/timetotrain/bases)",
    )
    flags.add_device(s, default="cpu, where it is deterministic")
    s.add_argument("--quiet", action="store_true", help="no progress line")
    s.set_defaults(func=_cmd_base)


def _add_rcp(sub) -> None:
    r = sub.add_parser(
        "rcp",
        help="reference convergence points of our tiers",
        description="Reference convergence points (RCPs): how many samples a tier's runs take to converge, "
        "against which `ttt score` judges later runs. `build` makes a tier's RCP file.",
    ).add_subparsers(dest="rcp_command", required=True)
    s = r.add_parser(
        "build",
        help="run a tier N times and write its RCP file in the official format",
        description="Runs BENCH at TIER --runs times with distinct seeds (logs kept in --logdir), then writes "
        "the official-format RCP JSON of the converged runs, to --out or ./<bench>_<tier>_rcp.json (never into "
        "the installed package: to ship it, copy it to timetotrain/suite/rcps/<bench>_<tier>.json, where "
        "`ttt score` looks).",
    )
    flags.add_benchmark(s, "a tier of ours (default: tiny; reference has official RCPs)", tier_default="tiny")
    flags.add_run_set(s, runs=10)
    flags.add_set(s)
    s.add_argument("--out", default=None, help="RCP file to write (default: ./<bench>_<tier>_rcp.json)")
    s.set_defaults(func=_cmd_rcp_build)
