"""`ttt synth`: the benchmark's real model with random weights on random tokens, timed in steady state.

No dataset, tokenizer or checkpoint: weights come from the benchmark's own init rule, batches are drawn
on the device (no host-to-device copy in the timed loop), and real forward/backward/optimizer steps run.
The first W steps are warm-up; the device is synchronised only at the start and end of the timed window
(per-step times come from CUDA events on GPUs, from the host clock on CPUs, where execution is synchronous).
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from timetotrain import fileio, strictjson
from timetotrain.errors import UserError
from timetotrain.progress import LiveLine
from timetotrain.train import distributed, free_cores, prepare, run_steps
from timetotrain.train import peak as peaks
from timetotrain.train.device import platform_name, threads_kept


@dataclass
class SynthOptions:
    benchmark: str
    tier: str
    steps: int | None = None
    warmup_steps: int | None = None
    micro_batch: int | None = None
    # Results go to <logdir>/synth/<benchmark>/<tier>/: by default ./synth, apart from the ./logs the
    # timed runs write (a synth log is not a result; readers of results skip it, see mlperf/results.py).
    logdir: Path = Path(".")
    sets: list[str] = field(default_factory=list)
    device: str | None = None
    precision: str | None = None  # fp32 | bf16; default bf16 on GPUs, fp32 on CPUs
    seed: int | None = None
    echo: bool = False
    parallel: str | None = None  # e.g. "dp=8", "fsdp=8"; default: dp over all ranks
    activation_checkpointing: int = 0  # checkpoint every K-th block; 0 none, 1 all (train/parallel.py)
    compile: bool = False
    layers: int | None = None  # replace the tier's layer count (reference width, fewer layers)
    tensorboard: Path | None = None  # the summary figures as TensorBoard scalars (train/trackers.py)
    wandb: bool = False
    config: dict | None = None  # the --config file and the values it gave, logged as ttt_config
    # CPU intra-op threads (--threads); default: OMP_NUM_THREADS, the tier's, or one per free core.
    threads: int | None = None


# Default lengths: enough steps for a stable median without making a first try slow.
DEFAULT_STEPS = {"tiny": 30, "reference": 20}
DEFAULT_WARMUP = {"tiny": 5, "reference": 5}


class _StepClock:
    """Per-step durations without host syncs inside the timed window."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def _energy_mj(device: torch.device) -> float | None:
    """Total energy counter of this GPU in millijoules (NVML), or None where NVML is unavailable."""
    if device.type != "cuda":
        return None
    try:
        import pynvml  # optional (nvml extra): CUDA only; missing, the energy is unavailable

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except Exception:
        return None


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def synth(opts: SynthOptions) -> dict:
    with threads_kept():  # a tier's CPU thread count holds for this call only
        return _synth(opts)


def _synth(opts: SynthOptions) -> dict:
    opts, tier, full, steps, warmup = _resolve(opts)
    bench = full.bench
    # -- preflight before any model is built: the log dir, the batch split --
    cuda = (opts.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    prep = prepare.preflight(
        bench, tier, opts.logdir / "synth" / bench.name / tier.name, opts.parallel,
        opts.precision or ("bf16" if cuda else "fp32"), opts.activation_checkpointing, opts.compile,
        micro_batch=opts.micro_batch, micro_flag="--micro-batch", device=opts.device, seed=opts.seed,
    )  # fmt: skip
    prepare.start_device(prep, opts.device, seed=opts.seed)
    threads = _cpu_threads(prep, opts.threads)
    item = bench.task.sample_items(prep.tier)
    out = run_steps.open_outputs(prep, "synth-", {"mode": "synthetic"}, item, opts)
    log = out.log  # the live line writes to stderr: --json keeps stdout to the summary
    tr = None
    try:
        _log_header(log, prep, opts)
        tr, data, peak = _build(prep, out)
        peak.threads = threads
        log.end("init_stop")
        window = _time_steps(prep, tr, data, steps, warmup, opts.compile, out)
        summary = _summary(prep, window, item, peak)
        summary.update(_layers_figures(opts, prep.tier, full))
        summary["data_figures"] = data.figures()
        if bench.task.on_policy:
            summary["rollout"] = _rollout_figures(bench, window, prep.local_batch * item[1])
        for key in (f"{item[0]}_per_s", "samples_per_s", "model_tflops_per_s", "mfu", "peak_memory_bytes"):
            log.event(f"ttt_synth_{key}", summary[key])
        log.event("ttt_synth_step_time_p50_s", summary["step_time_s"]["p50"])
        log.event("train_loss", window.final_loss, metadata={"samples_count": window.samples})
        log.end("run_stop", metadata={"status": "success", "samples_count": window.samples})
    except BaseException:
        log.end("run_stop", metadata={"status": "aborted"})
        raise
    finally:
        out.close()
    if prep.dist.main:
        _write_summary(summary, log.path, prep.logdir)
    del tr
    distributed.teardown(barrier=True)
    return summary


def _cpu_threads(prep, flag: int | None) -> dict | None:
    """A CPU synth's intra-op threads, set (free_cores.choose_threads: --threads, OMP_NUM_THREADS, the tier's,
    else one per core other processes leave free), and what decided them; None on an accelerator."""
    if prep.device.type != "cpu":
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    omp = os.environ.get("OMP_NUM_THREADS")
    n, why, seen = free_cores.choose_threads(
        flag, omp, prep.tier.cpu_threads, processes=local, ceiling=torch.get_num_threads()
    )
    if n is not None:
        torch.set_num_threads(n)
    used = torch.get_num_threads()
    if seen is not None and seen.busy and prep.dist.main:  # why this run is narrower than the host
        print(f"ttt: {free_cores.thread_words(used)}, {why}; --threads N chooses another", file=sys.stderr,
              flush=True)  # fmt: skip
    doc = {"threads": used, "why": why}
    if seen is not None:
        doc.update(cpus=seen.cpus, cores_busy=seen.busy, busy_cores_worth=seen.others)
    return doc


@dataclass
class _Full:
    """The benchmark and the tier's model before --layers changed it."""

    bench: object
    n_layers: int | None
    model: object


def _resolve(opts: SynthOptions):
    """The tier synth times (--set, then --layers or the benchmark's own synth depth), the step counts, and
    the full model they came from; bad input stops here, before anything else."""
    bench, tier = prepare.resolve_tier(opts.benchmark, opts.tier, opts.sets)
    steps = opts.steps if opts.steps is not None else DEFAULT_STEPS.get(tier.name, 20)
    warmup = opts.warmup_steps if opts.warmup_steps is not None else DEFAULT_WARMUP.get(tier.name, 5)
    if steps < 2:
        raise UserError(f"--steps {steps}: need at least 2 timed steps")
    if opts.threads is not None and opts.threads < 1:
        raise UserError(f"--threads {opts.threads}: must be at least 1 (one CPU thread per core to use)")
    if warmup < 0:
        raise UserError(f"--warmup-steps {warmup} must be >= 0")
    full = _Full(bench, getattr(tier.model, "n_layers", None), tier.model)
    if opts.layers is None and tier.name in bench.synth_layers:
        opts = dataclasses.replace(opts, layers=bench.synth_layers[tier.name])
    if opts.layers is not None:
        tier = with_layers(bench, tier, opts.layers)
    # The schedule must cover every step we take, whatever the tier's max_steps.
    tier = dataclasses.replace(tier, max_steps=max(tier.max_steps, steps + warmup + tier.warmup_steps + 1))
    return opts, tier, full, steps, warmup


def _log_header(log, prep, opts: SynthOptions) -> None:
    """The init block of a run, in the open division (never a closed result); no dataset, nothing to evict."""
    tier = prep.tier
    prep.tier = dataclasses.replace(tier, division="open")
    extra = {"ttt_mode": "synthetic", "ttt_tier": tier.name}
    if opts.config is not None:
        extra["ttt_config"] = opts.config
    run_steps.log_init(log, prep, False, "timetotrain", None, extra)
    prep.tier = tier


def _build(prep, out) -> tuple:
    """(training, synthetic data, the peak): the peak first, on an idle device, with the host's load."""
    bench, device, d = prep.bench, prep.device, prep.dist
    if out.live:
        out.live.update(
            f"synth {bench.name}/{prep.tier.name}: building the model and its optimizer on {device}",
            force=True,
        )
    peak = _peak(device)
    peak.load_before = peaks.load_average()
    tr = run_steps.build(prep, out)
    gen = torch.Generator(device=device).manual_seed(prep.seed + 1000 * prep.plan.data_rank(d.rank))
    data = bench.task.synthetic(prep.tier, prep.local_batch, gen, device)
    return tr, data, peak


@dataclass
class _Window:
    """What the timed steps measured on this rank."""

    wall: float  # seconds of the timed window
    per_step: list[float]
    final_loss: float
    energy: float | None  # joules (NVML), None where unavailable
    samples: int  # global samples over warm-up and timed steps
    steps: int
    warmup: int
    rollout_s: float = 0.0  # on-policy tasks: the rollouts' share of the window
    rollout_tokens: int = 0
    cpu_s: float = 0.0  # this process's CPU time over the timed window (all its threads)


def _time_steps(prep, tr, data, steps: int, warmup: int, compiled: bool, out) -> _Window:
    """run_start, `warmup` untimed steps, then `steps` timed ones (the device synchronised only at the
    window's two ends), block_stop."""
    device, tier, task, live = prep.device, prep.tier, prep.bench.task, out.live
    what = f"synth {prep.bench.name}/{tier.name}"
    out.log.start("run_start")
    out.log.start("block_start", metadata={"samples_count": 0})
    clock = _StepClock(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loss = None
    rollout_s, rollout_tokens = 0.0, 0
    t_warm = t0 = time.perf_counter()  # t0 starts again with the timed window (i == warmup)
    for i in range(warmup + steps):
        if live:  # before the clock starts at i == warmup: the phase's line is outside its window
            _synth_progress(live, what, i, warmup, steps, compiled, t_warm if i <= warmup else t0)
        if i == warmup:
            _sync(device)
            e0 = _energy_mj(device)
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            clock.mark()
        batch = data.batch(i)
        if task.on_policy:  # rollouts, timed apart: generation's share of the step
            t_gen = time.perf_counter()
            batch = data.prepare(tr.model, batch)
            _sync(device)
            if i >= warmup:
                rollout_s += time.perf_counter() - t_gen
                rollout_tokens += int(batch["mask"].sum().item())
        loss = tr.step(i, batch, prep.accum, data.loss)
        if i >= warmup:
            clock.mark()
    _sync(device)
    wall = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0
    if live:
        live.update(f"{what}: {steps} steps timed in {wall:.1f} s", force=True)
    e1 = _energy_mj(device)
    final_loss = float(loss[0].item())
    per_step = clock.durations()
    samples = (warmup + steps) * tier.global_batch_size
    out.log.end("block_stop", metadata={"samples_count": samples})
    energy = (e1 - e0) / 1e3 if e0 is not None and e1 is not None else None
    return _Window(
        wall, per_step, final_loss, energy, samples, steps, warmup, rollout_s, rollout_tokens, cpu_s
    )


def _summary(prep, w: _Window, item: tuple[str, int], peak: tuple[float, str]) -> dict:
    """The figures every rank reduces (throughput, energy and memory summed or maxed over ranks, each rank's
    own row gathered) and the summary they make, the same on every rank."""
    bench, tier, plan, d, device = prep.bench, prep.tier, prep.plan, prep.dist, prep.device
    item_name, items_per_sample = item
    mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _host_peak_rss()
    local_samples_s = w.steps * prep.local_batch / w.wall
    tot_samples_s, tot_energy, have_energy = distributed.all_reduce(
        [local_samples_s, w.energy or 0.0, 1.0 if w.energy is not None else 0.0], "sum", device
    )
    # The ranks of a tensor-parallel group, and of one pipeline, step through the same samples.
    tot_samples_s /= plan.world // plan.data_parallel
    max_mem, max_wall = distributed.all_reduce([float(mem), w.wall], "max", device)
    # Each rank's own figures, gathered once after the window (its clock has already been read).
    mine = [
        w.steps * prep.local_batch * items_per_sample / w.wall,
        statistics.median(w.per_step),
        statistics.fmean(w.per_step),
    ]
    ranks = per_rank(distributed.all_gather([*mine, float(mem)], device), item_name)
    flops_sample = bench.flops_per_sample(tier)
    achieved = tot_samples_s * flops_sample
    tot_items_s = tot_samples_s * items_per_sample
    peak_flops, peak_src = peak.flops, peak.source
    return {
        "benchmark": bench.name,
        "tier": tier.name,
        "mode": "synthetic (random weights, random data)",
        "device": platform_name(device, d.world),
        "world_size": d.world,
        "precision": plan.precision,
        "parallel": plan.describe(),
        "seed": prep.seed,
        "global_batch_size": tier.global_batch_size,
        "micro_batch_size": tier.micro_batch_size,
        "gradient_accumulation_steps": prep.accum,
        "item": item_name,
        "items_per_sample": items_per_sample,
        "steps_timed": w.steps,
        "warmup_steps": w.warmup,
        "seconds_timed": max_wall,
        f"{item_name}_per_s": tot_items_s,
        f"{item_name}_per_s_per_device": tot_items_s / d.world,
        "samples_per_s": tot_samples_s,
        "step_time_s": {
            "p50": statistics.median(w.per_step),
            "p90": _percentile(w.per_step, 0.9),
            "max": max(w.per_step),
            "mean": statistics.fmean(w.per_step),
        },
        "model_flops_per_sample": flops_sample,
        "model_flops_per_item": flops_sample / items_per_sample,
        "model_tflops_per_s": achieved / 1e12,
        "model_tflops_per_s_per_device": achieved / d.world / 1e12,
        "peak_tflops_per_device": peak_flops / 1e12,
        "peak_source": peak_src,
        "mfu": achieved / d.world / peak_flops,
        "host": _host_figures(peak, device, w.wall, w.cpu_s),
        "peak_memory_bytes": int(max_mem),
        "peak_memory_kind": "GPU max allocated" if device.type == "cuda" else "host peak RSS (whole process)",
        "energy_joules": tot_energy if have_energy == d.world else None,
        "energy_scope": "GPU only (NVML)" if have_energy == d.world else "unavailable",
        "final_loss": w.final_loss,
        "baseline_loss": bench.task.baseline_loss(tier),
        "per_rank": ranks,
    }


def _layers_figures(opts: SynthOptions, tier, full: _Full) -> dict:
    """Under --layers: the depth timed, the tier's own, and the config fields it changed (n_layers; flux:
    n_double and n_single)."""
    if opts.layers is None:
        return {}
    changed = {
        f.name: getattr(tier.model, f.name)
        for f in dataclasses.fields(tier.model)
        if getattr(tier.model, f.name) != getattr(full.model, f.name)
    }
    return {"layers": opts.layers, "layers_of": full.n_layers, "layers_config": changed}


def _rollout_figures(bench, w: _Window, items_per_rank_step: int) -> dict:
    """This rank's figures (the rollouts of its prompts), the share of its timed wall clock."""
    train_s = max(w.wall - w.rollout_s, 1e-9)
    return {
        "engine": getattr(bench.task, "engine", None) and bench.task.engine.name,
        "rollout_tokens_per_s": w.rollout_tokens / max(w.rollout_s, 1e-9),
        "training_tokens_per_s": w.steps * items_per_rank_step / train_s,
        "generation_share_of_step": w.rollout_s / w.wall,
        "rollout_seconds": w.rollout_s,
        "rollout_tokens": w.rollout_tokens,
    }


def _write_summary(summary: dict, log_path: Path, logdir: Path) -> None:
    """Each run keeps its own summary next to its result file; summary.json is the latest."""
    summary["log"] = str(log_path)
    k = log_path.stem.split("_")[-1]
    text = strictjson.dumps(summary, indent=2) + "\n"
    fileio.write_text(logdir / f"summary_{k}.json", text)
    fileio.write_text(logdir / "summary.json", text)
    summary["summary_path"] = str(logdir / "summary.json")


def per_rank(gathered: list[list[float]], item_name: str) -> list[dict]:
    """The gathered [items/s, step p50, step mean, peak memory] of each rank as summary rows."""
    return [
        {
            "rank": r,
            f"{item_name}_per_s": items_s,
            "step_time_p50_s": p50,
            "step_time_mean_s": mean,
            "peak_memory_bytes": int(mem),
        }
        for r, (items_s, p50, mean, mem) in enumerate(gathered)
    ]


def format_per_rank(s: dict) -> str:
    """One line per rank (under torchrun): where a slow rank or an uneven memory use shows."""
    item = s["item"]
    rows = s.get("per_rank", [])
    head = f"{'rank':>6}  {item + '/s':>14}  {'step p50 (s)':>12}  {'step mean (s)':>13}  {'peak memory (GiB)':>17}"
    lines = [head] + [
        f"{r['rank']:>6}  {r[item + '_per_s']:>14,.0f}  {r['step_time_p50_s']:>12.4f}  {r['step_time_mean_s']:>13.4f}"
        f"  {r['peak_memory_bytes'] / 2**30:>17.2f}"
        for r in rows
    ]
    return "\n".join(lines)


def _synth_progress(live: LiveLine, what: str, i: int, warmup: int, steps: int, compiled: bool, since: float):
    """The line before step `i`: forced when a phase starts (its first step allocates, and compiles under
    --compile: the longest wait), then as often as the line allows. It reads the host clock only, never
    the device, so the timed window gets no sync from it (on a GPU it counts steps issued); `since` is
    when the phase began (unused by a phase's first line, which has no elapsed time)."""
    start = i in (0, warmup)
    if i < warmup:
        first = " (the first step allocates memory" + (" and compiles the blocks" if compiled else "") + ")"
        text = f"{what}: warm-up step {i + 1}/{warmup}" + (first if i == 0 else "")
    else:
        text = f"{what}: timing step {i - warmup + 1}/{steps}"
    live.update(text if start else f"{text}  [{time.perf_counter() - since:.0f} s]", force=start)


def with_layers(bench, tier, layers: int):
    """The tier's model with `layers` repeated blocks (same width): a full-width model that fits one device,
    for throughput checks. Logged as `ttt_layers`; the run is never a closed result. A family with its own
    meaning of depth says it (`ModelFamily.with_layers`: flux splits the blocks double:single 19:38); FLOPs
    and MFU come from the changed config."""
    if layers <= 0 or not hasattr(tier.model, "n_layers"):
        raise UserError(f"--layers {layers}: must be positive, for a model with repeated layers")
    if bench.family.with_layers is not None:
        new = dataclasses.replace(tier, model=bench.family.with_layers(tier.model, layers))
    else:
        new = dataclasses.replace(tier, model=dataclasses.replace(tier.model, n_layers=layers))
    try:
        bench.task.validate(new)  # a depth tied to the data (rgat: one sampling hop per layer) refuses here
    except UserError as e:
        raise UserError(f"--layers {layers}: {e} (this benchmark's depth is tied to its data)") from None
    return new


def _split(s: dict) -> str:
    """How the reduced depth is made up, where --layers changed more than `n_layers` (flux)."""
    changed = s.get("layers_config", {})
    if set(changed) <= {"n_layers"}:
        return ""
    return " (" + ", ".join(f"{k}={v}" for k, v in changed.items()) + ")"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass
class _Peak:
    """The FLOP/s MFU divides by, where it came from, and (CPU) both figures it was chosen from."""

    flops: float
    source: str
    cpu: peaks.CpuPeak | None = None
    load_before: float | None = None  # the host's 1-minute load average before the timed window
    threads: dict | None = None  # CPU: the intra-op threads and what decided them (_cpu_threads)


def _peak(device: torch.device) -> _Peak:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = peaks.accelerator_peak(name)
        if known is None:
            raise UserError(
                f"no peak figure for {name!r}: MFU needs one; add it to timetotrain/train/peak.py BF16_DENSE_TFLOPS"
            )
        return _Peak(*known)
    cpu = peaks.cpu_peak()
    return _Peak(cpu.flops, cpu.describe(), cpu)


CPU_SHARE_OK = 0.8  # a CPU run whose threads ran less of the timed window than this shared their cores


def _host_figures(peak: _Peak, device: torch.device, wall: float, cpu_s: float | None = None) -> dict:
    """The load average before and after the timed window, and whether other processes wanted the cores the
    run used: on a CPU, from the threads' own CPU time over the window and the free-core sample; elsewhere
    from the load average (this run's own threads, on every rank of this host, taken out of the later
    figure)."""
    per_rank = torch.get_num_threads() if device.type == "cpu" else 1
    cores = per_rank * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks on this host
    after = peaks.load_average()
    others = [x for x in (peak.load_before, after and peaks.others_load(after, cores, wall)) if x is not None]
    busy = bool(others) and peaks.host_busy(max(others), cores)
    share = None
    if peak.threads is not None and cpu_s is not None:
        # A CPU run's own threads say it better than the load average, which lags a minute and still holds
        # the previous run: their CPU time over the window, per thread, is under 1 where they waited for a
        # core (a neighbour that came during the run, which the sample before it could not see).
        share = cpu_s / max(wall * per_rank, 1e-9)
        no_core_free = peak.threads.get("cores_busy", 0) >= peak.threads.get("cpus", math.inf)
        busy = share < CPU_SHARE_OK or no_core_free
    doc = {
        "load_average_1min": [peak.load_before, after],
        "cpu_count": os.cpu_count(),
        "cores_used": cores,
        "host_busy": busy,
        "note": peaks.load_note([peak.load_before, after], busy, cores),
    }
    if share is not None:
        doc["cpu_time_share"] = share
        if share < CPU_SHARE_OK:
            doc["note"] += (
                f"; the threads ran {share:.0%} of the timed window (other processes had the cores)"
            )
    if peak.threads is not None:
        doc["threads"] = peak.threads
        doc["note"] = (
            f"{free_cores.thread_words(peak.threads['threads'])}: {peak.threads['why']}; {doc['note']}"
        )
    if peak.cpu is not None:
        doc["peak_measured_tflops"] = peak.cpu.measured / 1e12
        doc["peak_theoretical_tflops"] = (peak.cpu.theoretical or 0.0) / 1e12 or None
        doc["peak_theoretical_source"] = peak.cpu.theoretical_source
    return doc


def _figure(value: float) -> str:
    """A data figure: a reward of 0.5625 is not "0.6"; a count keeps its thousands separators."""
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"


def format_table(s: dict) -> str:
    item = s["item"]
    loss = f"{s['final_loss']:.3f}"
    if s["baseline_loss"] is not None:
        loss += f" (uninformed guess: {s['baseline_loss']:.3f})"
    rows = [
        ("benchmark / tier", f"{s['benchmark']} / {s['tier']} ({s['mode']})"
                             + (f", {s['layers']} of its {s.get('layers_of', '?')} layers{_split(s)} at the "
                                f"exact width (reduced depth)" if "layers" in s else "")),
        ("system", f"{s['device']}, world size {s['world_size']}, {s['precision']}"),
        ("batch", f"GBS {s['global_batch_size']} x {s['items_per_sample']} {item} (micro "
                  f"{s['micro_batch_size']}, accum {s['gradient_accumulation_steps']})"),
        ("steps", f"{s['steps_timed']} timed after {s['warmup_steps']} warm-up, {s['seconds_timed']:.2f} s"),
        (f"{item}/s", f"{s[item + '_per_s']:,.0f} global, {s[item + '_per_s_per_device']:,.0f} per device"),
        ("samples/s", f"{s['samples_per_s']:,.2f}"),
        ("step time", "p50 {p50:.4f} s, p90 {p90:.4f} s, max {max:.4f} s".format(**s["step_time_s"])),
        (f"model FLOPs/{item.removesuffix('s')}", f"{s['model_flops_per_item'] / 1e6:,.2f} M"),
        ("model TFLOP/s", f"{s['model_tflops_per_s']:,.3f} global, {s['model_tflops_per_s_per_device']:,.3f} per device"),
        ("MFU", f"{s['mfu']:.1%} of {s['peak_tflops_per_device']:,.3f} TFLOP/s ({s['peak_source']})"),
        ("host", s["host"]["note"] if "host" in s else "not recorded"),
        ("peak memory", f"{s['peak_memory_bytes'] / 2**30:,.2f} GiB ({s['peak_memory_kind']})"),
        ("energy", f"{s['energy_joules']:,.1f} J ({s['energy_scope']})" if s["energy_joules"] is not None
                   else s["energy_scope"]),
        ("loss", loss),
    ]  # fmt: skip
    rows += [(name, _figure(value)) for name, value in s.get("data_figures", {}).items()]
    if "rollout" in s:  # on-policy tasks: generation and training timed apart
        r = s["rollout"]
        rows += [
            ("rollout tokens/s", f"{r['rollout_tokens_per_s']:,.0f} ({r['rollout_tokens']:,} tokens generated"
                                 f" in {r['rollout_seconds']:.2f} s, engine {r['engine']})"),
            ("training tokens/s", f"{r['training_tokens_per_s']:,.0f} (the step less its rollouts)"),
            ("generation share", f"{r['generation_share_of_step']:.1%} of the timed wall clock"),
        ]  # fmt: skip
    w = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
    if len(s.get("per_rank", [])) > 1:
        table += "\nper rank:\n" + format_per_rank(s)
    return table
