"""`ttt package`: result logs -> the submission tree the official package checker reads (docs/submission.md).

    OUT/systems/<system>.json
    OUT/results/<system>/<benchmark>/result_<i>.txt        copied, ordered by run_start, renumbered 0..N-1
    OUT/benchmarks/<benchmark>/implementations/timetotrain/{README.md,run_and_time.sh}

The system description is filled from this host (CPU, memory, accelerators, OS, software versions);
what a program cannot know (availability status, interconnects, storage type, cooling, ...) is written
as TODO text for the submitter, and listed. `--system-json` starts from an existing description instead.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from timetotrain import __version__, fileio, interrupt
from timetotrain.errors import UserError
from timetotrain.markup import md
from timetotrain.mlperf.compliance import RULESET
from timetotrain.mlperf.results import (
    LogProblem,
    ResultGroup,
    RunLog,
    find_groups,
    log_problems,
    official_compliance,
)
from timetotrain.mlperf.score import first_problem, olympic_drops
from timetotrain.mlperf.structure import explain_stop
from timetotrain.shell import Var, comment, line, quote
from timetotrain.spec import official, registry
from timetotrain.spec.benchmark import setting

TODO = "TODO: fill in"
STATUS_CHOICES = (
    "Available on-premise",
    "Available cloud",
    "Research, Development, or Internal (RDI)",
    "Preview",
)
# The fields system_desc_checker requires, in its order (mlperf_logging's system_desc_checker).
REQUIRED_FIELDS = (
    "submitter",
    "division",
    "status",
    "system_name",
    "number_of_nodes",
    "host_processors_per_node",
    "host_processor_model_name",
    "host_processor_core_count",
    "host_processor_vcpu_count",
    "host_processor_frequency",
    "host_processor_caches",
    "host_processor_interconnect",
    "host_memory_capacity",
    "host_storage_type",
    "host_storage_capacity",
    "host_networking",
    "host_networking_topology",
    "host_memory_configuration",
    "accelerators_per_node",
    "accelerator_model_name",
    "accelerator_host_interconnect",
    "accelerator_frequency",
    "accelerator_on-chip_memories",
    "accelerator_memory_configuration",
    "accelerator_memory_capacity",
    "accelerator_interconnect",
    "accelerator_interconnect_topology",
    "cooling",
    "hw_notes",
    "framework",
    "other_software_stack",
    "operating_system",
    "sw_notes",
)


@dataclass
class PackageResult:
    out: Path
    system_json: Path
    todo: list[str]  # system description fields left for the submitter
    benchmarks: dict[str, int]  # benchmark -> number of result files
    notes: list[str] = field(default_factory=list)
    # Logs packaged as they are that will not count (truncated, two runs in one file, failing the official
    # compliance checker), each naming its file: said before the checker's own report.
    warnings: list[str] = field(default_factory=list)


class Noncompliant(UserError):
    """More logs of a benchmark fail the official compliance checker than its olympic scoring accepts, so
    the official package checker would reject the folder: nothing is written. `failing` lists every log
    that fails, one line each (the CLI prints them before the error line)."""

    def __init__(self, message: str, failing: list[str]):
        super().__init__(message)
        self.failing = failing


def failing_logs(groups: list[ResultGroup], problems: list[LogProblem], ruleset: str) -> dict[Path, str]:
    """Each log the official compliance engine fails (with the rules `ttt check` uses: the tier's rule file,
    or the ruleset's closed or open rules for a reference log) -> the first reason, in a user's words where
    one is known: the problem `log_problems` found, how the run ended (`explain_stop`), else the engine's
    first complaint."""
    known = {p.path: p.what for p in problems}
    out = {}
    for g in groups:
        for lg in g.logs:
            try:
                ok, why = official_compliance(lg.path, ruleset)
            except UserError as e:  # no rules to check it by (a tier the benchmark does not have): it fails
                out[lg.path] = known.get(lg.path) or str(e)
                continue
            if not ok:
                out[lg.path] = known.get(lg.path) or explain_stop(lg.path) or first_problem(why)
    return out


def _check_out_creatable(out: Path) -> None:
    """One line, before any work, where `out` cannot be made: its nearest existing ancestor is a file or
    not writable. Nothing is created here (a refused package leaves nothing behind)."""
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(
            f"--out {out} cannot be created ({parent} is a file): pass a new folder in a writable place"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(
            f"--out {out} cannot be created ({parent} is not writable): pass a new folder in a writable place"
        )


def build_package(
    org: str,
    system: str,
    results: Path,
    out: Path,
    system_json: Path | None = None,
    tier: str | None = None,
    ruleset: str = RULESET,
    allow_noncompliant: bool = False,
) -> PackageResult:
    """The package of the logs under `results` in a new folder `out`. Logs the official compliance checker
    will fail are listed in the warnings; where a benchmark has more of them than its olympic scoring
    accepts (the package checker then rejects its folder), nothing is written (`Noncompliant`) unless
    `allow_noncompliant`."""
    out, results = Path(out), Path(results)
    if out.exists():
        raise UserError(f"--out {out} already exists: choose a new folder (ttt package never overwrites)")
    _check_out_creatable(out)  # before the compliance checks, which take seconds a log
    for name, flag in ((org, "--org"), (system, "--system")):
        if not name or "/" in name or name.startswith("."):
            raise UserError(f"{flag} {name!r} must be a plain folder name (no '/')")
    groups = _select(find_groups(results, with_foreign=True), tier, results)
    problems = log_problems(groups)
    misplaced = [p for p in problems if p.misplaced]
    if misplaced:
        more = f" (and {len(misplaced) - 1} more such files)" if len(misplaced) > 1 else ""
        raise UserError(f"{misplaced[0]}{more}")
    failing = failing_logs(groups, problems, ruleset)
    lines = [f"{path}: {why} (the official compliance checker fails it)" for path, why in failing.items()]
    warnings = [str(p) for p in problems if p.path not in failing] + lines
    over = [g for g in groups if sum(p in failing for p in g.files) > olympic_drops(g.benchmark)]
    if over and not allow_noncompliant:
        g = over[0]
        n, most = sum(p in failing for p in g.files), olympic_drops(g.benchmark)
        raise Noncompliant(
            f"{n} {g.benchmark} logs under {g.folder} fail the official compliance checker (listed above), "
            f"and the package checker accepts {most}: rerun those runs, or pass --allow-noncompliant to "
            "package them anyway",
            lines,
        )
    notes: list[str] = []

    if system_json is not None:
        desc = _load_system_json(Path(system_json))
        todo = [k for k, v in desc.items() if isinstance(v, str) and v.startswith("TODO")]
        if desc.get("submitter") != org:
            notes.append(
                f"systems/{system}.json: submitter {desc.get('submitter')!r} replaced by --org {org!r}"
            )
            desc["submitter"] = org
    else:
        divisions = {g.division for g in groups}
        division = "closed" if divisions == {"closed"} else "open"
        tiers = sorted({g.tier for g in groups})
        desc, todo = host_system_description(org, system, division, results, tiers)
        if len(divisions) > 1:
            notes.append(f"the logs mix divisions {sorted(divisions)}: the system is marked open")
    for miss in (k for k in REQUIRED_FIELDS if k not in desc):
        desc[miss] = TODO
        todo.append(miss)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"--out {out} cannot be created ({e.strerror}): pass a new folder in a writable place"
        ) from e
    # Next to OUT, so the final rename stays on one file system.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / "systems").mkdir()
        sys_path = staging / "systems" / f"{system}.json"
        fileio.write_text(sys_path, json.dumps(desc, indent=4) + "\n")
        counts = {}
        for g in groups:
            dest = staging / "results" / system / g.benchmark
            dest.mkdir(parents=True)
            ordered = sorted(g.logs, key=lambda lg: (lg.run_start_ms is None, lg.run_start_ms or 0.0))
            for i, lg in enumerate(ordered):
                fileio.copy_file(lg.path, dest / f"result_{i}.txt")
            counts[g.benchmark] = len(ordered)
            impl = staging / "benchmarks" / g.benchmark / "implementations" / "timetotrain"
            impl.mkdir(parents=True)
            script = impl / "run_and_time.sh"
            fileio.write_text(script, run_and_time(g, ordered, org, system), perms=0o755)
            fileio.write_text(impl / "README.md", _impl_readme(g, ordered))
            notes += _group_notes(g, desc)
        # All or nothing: a failed build leaves no half-written --out. A signal (raised under `ttt package`,
        # cli/results.py) removes the staging folder on the way out; one during the rename is raised after it.
        with interrupt.deferred():
            os.rename(staging, out)
            fileio.COMPLETED.append(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return PackageResult(out, out / "systems" / f"{system}.json", todo, counts, notes, warnings)


def _select(groups: list[ResultGroup], tier: str | None, root: Path) -> list[ResultGroup]:
    if tier is not None:
        groups = [g for g in groups if g.tier == tier or (g.foreign and not g.logs)]
        if not any(g.logs for g in groups):
            raise UserError(f"no result files of tier {tier!r} under {root}: check --tier and --results")
    seen: dict[str, ResultGroup] = {}
    for g in groups:
        if not g.logs:  # only files that are not MLPerf logs: log_problems names them
            continue
        if not g.benchmark:
            raise UserError(
                f"{g.folder}: the logs name no submission_benchmark; pass folders of MLPerf result logs"
            )
        if official.get(g.benchmark) is None and not registry.known(g.benchmark):
            # The official checker would only say "Skipping benchmark" and pass the rest.
            raise UserError(
                f"{g.logs[0].path}: submission_benchmark {g.benchmark!r} is neither an MLPerf Training "
                "benchmark nor a timetotrain one: nothing can check or reproduce it"
            )
        if g.benchmark in seen:
            raise UserError(
                f"{g.benchmark} has results in both {seen[g.benchmark].folder} and {g.folder}: "
                "point --results at one of them, or pass --tier"
            )
        seen[g.benchmark] = g
    return list(seen.values()) + [g for g in groups if not g.logs]


def _load_system_json(path: Path) -> dict:
    try:
        desc = json.loads(fileio.read_bounded(path, fileio.SMALL_FILE, "--system-json").decode())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--system-json {path} is not readable JSON ({e})") from e
    if not isinstance(desc, dict):
        raise UserError(f"--system-json {path} must hold a JSON object")
    return desc


def _group_notes(g: ResultGroup, desc: dict) -> list[str]:
    notes = []
    need = official.result_files(g.benchmark)  # the checker's count, whatever the tier (not our tier's runs)
    if need is not None and need != len(g.logs):
        files = f"{len(g.logs)} result file" + ("" if len(g.logs) == 1 else "s")
        notes.append(f"{g.benchmark}: {files}, the package checker wants exactly {need}")
    if g.tier != "reference":
        notes.append(
            f"{g.benchmark}: tier {g.tier} logs are not closed MLPerf results; the official checker "
            "judges them by the ruleset's common.yaml and rejects them (docs/submission.md)"
        )
    divs = {lg.division for lg in g.logs}
    if desc.get("division") not in divs:
        notes.append(
            f"{g.benchmark}: logs say division {sorted(divs)}, systems json says {desc.get('division')!r}"
        )
    return notes


# --- the system description from this host ---


def _cpuinfo() -> dict:
    info: dict = {"sockets": set()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k, v = k.strip(), v.strip()
            if k == "model name":
                info.setdefault("model", v)
            elif k == "physical id":
                info["sockets"].add(v)
            elif k == "cpu cores":
                info.setdefault("cores", int(v))
            elif k == "cpu MHz":
                info.setdefault("mhz", float(v))
    except OSError:
        pass
    return info


def _cpu_max_mhz() -> float | None:
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1000
    except (OSError, ValueError):
        return None


def _cpu_caches() -> str:
    parts = []
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        parts.append(f"L{level}{suffix} {size}")
    return ", ".join(parts)


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    except (OSError, ValueError):
        pass
    return None


def _os_name() -> str:
    name = platform.system()
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return f"{name} (kernel {platform.release()})"


def _versions() -> str:
    parts = [f"timetotrain {__version__}", f"Python {platform.python_version()}"]
    for dist in ("mlperf-logging", "numpy"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
        if torch.backends.cudnn.is_available():
            parts.append(f"cuDNN {torch.backends.cudnn.version()}")
        try:
            parts.append("NCCL " + ".".join(str(x) for x in torch.cuda.nccl.version()))
        except Exception:  # NCCL absent from this build
            pass
    if getattr(torch.version, "hip", None):
        parts.append(f"ROCm/HIP {torch.version.hip}")
    return ", ".join(parts)


def _accelerators() -> dict:
    """Accelerator fields from torch.cuda and, when importable, NVML (clocks, driver)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return {"count": 0}
    props = torch.cuda.get_device_properties(0)
    acc = {
        "count": torch.cuda.device_count(),
        "name": props.name,
        "memory": f"{props.total_memory / 1024**3:.0f} GiB",
    }
    try:
        import pynvml  # optional (nvml extra): NVIDIA only; without it the clocks stay TODO

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            acc["sm_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)
            acc["mem_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
            drv = pynvml.nvmlSystemGetDriverVersion()
            acc["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (non-NVIDIA device, or pynvml not installed): clocks stay TODO
        pass
    return acc


def host_system_description(
    org: str, system: str, division: str, where: Path, tiers: list[str]
) -> tuple[dict, list[str]]:
    """(description, fields left TODO). Facts are read from this host; the rest is TODO text."""
    cpu = _cpuinfo()
    sockets = max(1, len(cpu["sockets"]))
    vcpus = os.cpu_count() or 0
    mhz = _cpu_max_mhz() or cpu.get("mhz")
    mem = _mem_gib()
    disk = shutil.disk_usage(where)
    acc = _accelerators()
    d = {
        "submitter": org,
        "division": division,
        "status": f"{TODO} (one of: {'; '.join(STATUS_CHOICES)})",
        "system_name": system,
        "number_of_nodes": "1",
        "host_processors_per_node": str(sockets),
        "host_processor_model_name": cpu.get("model") or platform.processor() or TODO,
        "host_processor_core_count": str(cpu.get("cores") or max(1, vcpus // sockets)),
        "host_processor_vcpu_count": str(vcpus),
        "host_processor_frequency": f"{mhz:.0f} MHz" if mhz else TODO,
        "host_processor_caches": _cpu_caches() or TODO,
        "host_processor_interconnect": TODO,
        "host_memory_capacity": f"{mem:.1f} GiB" if mem else TODO,
        "host_storage_type": TODO,
        "host_storage_capacity": f"{disk.total / 1e9:.0f} GB",
        "host_networking": TODO,
        "host_networking_topology": TODO,
        "host_memory_configuration": TODO,
        "accelerators_per_node": str(acc["count"]),
        "accelerator_model_name": acc.get("name", "N/A"),
        "accelerator_host_interconnect": TODO if acc["count"] else "N/A",
        "accelerator_frequency": f"{acc['sm_mhz']} MHz"
        if "sm_mhz" in acc
        else (TODO if acc["count"] else "N/A"),
        "accelerator_on-chip_memories": TODO if acc["count"] else "N/A",
        "accelerator_memory_configuration": TODO if acc["count"] else "N/A",
        "accelerator_memory_capacity": acc.get("memory", "N/A"),
        "accelerator_interconnect": TODO if acc["count"] else "N/A",
        "accelerator_interconnect_topology": TODO if acc["count"] else "N/A",
        "cooling": TODO,
        "hw_notes": "",
        "framework": f"PyTorch {torch.__version__}",
        "other_software_stack": _versions() + (f", NVIDIA driver {acc['driver']}" if "driver" in acc else ""),
        "operating_system": _os_name(),
        "sw_notes": f"timetotrain tier(s) {', '.join(tiers)}",
    }
    todo = [k for k, v in d.items() if isinstance(v, str) and v.startswith("TODO")]
    return d, todo


# --- implementation folder ---

# Logged key -> `ttt run --set` name, for settings a run may have changed from its tier's defaults.
_SETTINGS = {
    "global_batch_size": "global_batch_size",
    "micro_batch_size": "micro_batch_size",
    "opt_base_learning_rate": "lr",
    "opt_end_learning_rate": "end_lr",
    "opt_learning_rate_warmup_steps": "warmup_steps",
    "max_steps": "max_steps",
    "eval_samples": "eval_samples",
    "ttt_eval_every_samples": "eval_every_samples",
    "submission_division": "division",
}


def _overrides(log: RunLog) -> list[str]:
    bench = registry.get(log.benchmark)
    tier = bench.tiers.get(log.tier)
    if tier is None:
        return []
    sets = []
    names = {**_SETTINGS, **{key: name for name, key in bench.task.settable.items()}}
    gbs = log.keys.get("global_batch_size", tier.global_batch_size)
    # At a GBS without an RCP a closed run must name its LR and warmup, even where they equal the tier's
    # (spec.benchmark.closed_violation).
    chosen = {"lr", "warmup_steps"} if bench.rcp_hparams and gbs not in bench.rcp_hparams else set()
    for key, name in names.items():
        if key in log.keys and (log.keys[key] != setting(tier, name) or name in chosen):
            sets.append(f"{name}={log.keys[key]}")
    return sets


def _inputs(log: RunLog, org: str, system: str) -> tuple[list, dict[str, str]]:
    """The `ttt run` arguments after the seed that repeat `log`'s run, and the script variables they use
    (name -> default). Everything comes from the log: the `--set` values as given when it logged them
    (`ttt_set`), else the settings that differ from the tier's; the starting checkpoint; the data folder."""
    words: list = ["--org", org, "--platform", str(log.keys.get("submission_platform", system))]
    logged = log.keys.get("ttt_set")
    sets = [str(s) for s in logged] if isinstance(logged, list) else _overrides(log)
    for s in sets:
        words += ["--set", s]
    if "ttt_max_steps" in log.keys:
        words += ["--max-steps", log.keys["ttt_max_steps"]]
    defaults = {}
    if "ttt_cpu_threads" in log.keys:  # a CPU run: its bits hold at its thread count only
        threads = log.keys["ttt_cpu_threads"]
        if type(threads) is not int or threads < 1:
            raise UserError(
                f"{log.path}: ttt_cpu_threads {threads!r} is not a thread count (a whole number >= 1)"
            )
        defaults["OMP_NUM_THREADS"] = str(threads)
    if "ttt_init_checkpoint" in log.keys:
        words += ["--init-checkpoint", Var("INIT_CHECKPOINT")]
        defaults["INIT_CHECKPOINT"] = str(log.keys["ttt_init_checkpoint"])
    return words, defaults


def run_and_time(g: ResultGroup, ordered: list[RunLog], org: str, system: str) -> str:
    """The script that repeats the runs of `ordered`, each with its logged seed and inputs; consecutive
    runs with the same inputs share one loop. Every value from a log is a quoted word (`shell.quote`)."""
    first = ordered[0]
    data = first.keys.get("ttt_data")
    head = [
        "#!/usr/bin/env bash",
        comment(
            (
                f"Reproduces the {len(ordered)} {g.benchmark} runs"
                if len(ordered) > 1
                else f"Reproduces the {g.benchmark} run"
            )
            + f" of results/{system}/{g.benchmark}/: one"
        ),
        comment("`ttt run` per result_<i>.txt, with the seed and inputs that run logged, in the same order."),
        comment(
            "  DATA    folder prepared by `ttt data prepare`"
            + (" (default: the logged one)" if data else " (required)")
        ),
        comment("  LOGDIR  where the new result files go (default ./logs)"),
        comment(
            "Multi-GPU / multi-node: put `torchrun --nproc-per-node=... -m timetotrain` in place of `ttt`"
        ),
        comment("(see the timetotrain README)."),
        "set -euo pipefail",
    ]
    if data:
        head.append(_default("DATA", data))
    else:
        head.append(': "${DATA:?set DATA to the folder prepared by ttt data prepare}"')
    head.append('LOGDIR="${LOGDIR:-./logs}"')
    if g.benchmark not in registry.names():
        msg = f"timetotrain does not implement {g.benchmark} yet; these logs came from elsewhere"
        return "\n".join(head + [f"echo {quote(msg)} >&2", "exit 1"]) + "\n"
    runs = [(lg, *_inputs(lg, org, system)) for lg in ordered]
    defaults: dict[str, str] = {}
    for _, _, d in runs:
        for name, value in d.items():
            if defaults.setdefault(name, value) != value:
                raise UserError(
                    f"{g.folder}: the runs logged different {_WHAT[name]} ({defaults[name]!r}, {value!r}); "
                    "package runs of one starting point together"
                )
    head += [_default(name, value) for name, value in defaults.items()]
    if "OMP_NUM_THREADS" in defaults:
        head.append("export OMP_NUM_THREADS")
    body = []
    for words, group in itertools.groupby(runs, key=lambda r: r[1]):
        seeds = " ".join(quote(lg.seed) for lg, _, _ in group)
        run = [
            "ttt",
            "run",
            g.benchmark,
            "--tier",
            first.tier,
            "--data",
            Var("DATA"),
            "--logdir",
            Var("LOGDIR"),
        ]
        body += [f"for SEED in {seeds}; do", "  " + line([*run, "--seed", Var("SEED"), *words]), "done"]
    return "\n".join(head + body) + "\n"


# What each script variable holds, for the error when the runs of one package disagree on it.
_WHAT = {"INIT_CHECKPOINT": "init checkpoints", "OMP_NUM_THREADS": "CPU thread counts (ttt_cpu_threads)"}


def _default(name: str, value: str) -> str:
    """`NAME` keeps the caller's value, else gets `value`, assigned as one quoted word."""
    return f'[ -n "${{{name}:-}}" ] || {name}={quote(value)}'


def _impl_readme(g: ResultGroup, ordered: list[RunLog]) -> str:
    first = ordered[0]
    tier, bench = md(first.tier), md(g.benchmark)  # values from the logs
    init = first.keys.get("ttt_init_checkpoint")
    start = (
        f"The runs started from the checkpoint the logs name ({md(init)}): set `INIT_CHECKPOINT` to its "
        "folder on this machine if it is elsewhere (the logs record its sha256 where a `ttt base` made it).\n\n"
        if init is not None
        else ""
    )
    return (
        f"# {bench}: timetotrain {__version__}\n\n"
        f"Implementation: [timetotrain](https://pypi.org/project/timetotrain/) {__version__}, "
        f"benchmark {bench}, tier {tier}, global batch size {md(first.global_batch_size)}.\n\n"
        "## Setup\n\n"
        "```sh\n"
        f"pip install timetotrain=={__version__}\n"
        "ttt data prepare c4 --src <allenai/c4 en folder> --split train --out data\n"
        "ttt data prepare c4 --src <allenai/c4 en folder> --split validation --out data\n"
        "```\n\n"
        f"{start}"
        "## Run\n\n"
        "```sh\n"
        "DATA=data LOGDIR=logs ./run_and_time.sh\n"
        "```\n\n"
        f"`run_and_time.sh` repeats the {len(ordered)} runs of this package with the seeds, `--set` values and "
        f"inputs their logs recorded (in the order of `result_0.txt` ... `result_{len(ordered) - 1}.txt`). Each "
        f"run writes a new `$LOGDIR/<benchmark>/<tier>/result_<k>.txt`; score them with `ttt score $LOGDIR`.\n"
    )


# --- the official checker ---


def check_package(out: Path, ruleset: str = RULESET) -> tuple[bool, str]:
    """`python -m mlperf_logging.package_checker OUT training RULESET`. It always exits 0, so the verdict
    is its final line. It writes scaling.json into result folders that beat the RCP mean."""
    with tempfile.TemporaryDirectory() as tmp:
        # Absolute: the checker runs in `tmp` (it writes files into its cwd), where a relative OUT is gone.
        cmd = [
            sys.executable,
            "-m",
            "mlperf_logging.package_checker",
            str(Path(out).resolve()),
            "training",
            ruleset,
        ]
        cmd += ["--log_output", str(Path(tmp) / "package_checker.log")]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
    output = (proc.stdout + proc.stderr).strip()
    return "PACKAGE CHECKER FOUND NO ERRORS, SUCCESS" in output, output
