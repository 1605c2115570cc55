"""`ttt suite`'s driver: every benchmark that has a tier, N runs each, scored into one results folder
(cli/suite.py parses the flags and imports this module only when the command runs).

The benchmarks come from the registry (`timetotrain.registry.names()` and each one's tiers), so a benchmark
added there joins the suite with no change here. A tier's data is what its task's recipe makes
(`Task.data_name`, `Task.data_recipe`): this module never names a data spec. Each step is a `ttt` child
process (data prepare, base, run), so each keeps its own signal handling, progress and clean-up; only a
recipe's in-process part (`DataRecipe.call`) runs in this process.

Prepared data is cached in CACHE/<recipe name>, written as `<name>.partial` and renamed when every step has
finished, so a folder that exists is complete; `source.json` in it records which source files it was made
from (a changed source makes it stale).

Resuming: a run is finished when its `result_<k>.txt` exists (a killed run leaves only a `.partial`,
which no score reads). A run that a signal stopped (its log names the signal, `ttt_stop_signal`) did not
finish either: its log is set aside as `result_<k>.txt.signalled` (kept, never scored) and its seed runs
again, with one line saying so. The seeds are drawn once and kept in OUT/suite.json, so a restarted suite
runs only the seeds that have no finished log yet, and prepared data and bases come from caches.

One suite per folder: OUT/suite.lock is held (flock) for the suite's life; a second suite on the same
OUT stops with one line naming the pid that holds it. Each child runs in its own process group and, on
Linux, gets SIGTERM when the suite dies (lifeline.py), so a `kill -9` of the suite stops its run
cleanly instead of leaving it to run on unwatched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from timetotrain import fileio, lifeline
from timetotrain.cli.data import make_data
from timetotrain.cli.suite_eta import RunHistory, history_key
from timetotrain.errors import Interrupted, UserError
from timetotrain.interrupt import raise_on_signals
from timetotrain.mlperf.logger import SIGNALLED
from timetotrain.mlperf.results import find_groups, parse_log, result_files
from timetotrain.mlperf.score import score_group
from timetotrain.mlperf.structure import STOP_SIGNAL_KEY
from timetotrain.spec import registry
from timetotrain.spec.task import DataRecipe
from timetotrain.train.seeds import run_seeds

STATE = "suite.json"
LOCK = "suite.lock"
STOP_WAIT_S = 60.0  # after passing on a signal: how long a step may take to stop before it is killed
_STOPPED = "stopped; finished runs are kept, and `ttt suite` with the same --out resumes the rest"


@dataclass
class SuiteOptions:
    tier: str
    out: Path
    only: list[str] | None = None
    runs: int | None = None  # None: each tier's own run count
    source: Path | None = None  # raw sources (c4/en, govreport/, tokenizers/) to prepare from
    prepared: dict[str, Path] = field(default_factory=dict)  # benchmark -> a prepared data folder
    seed: int | None = None
    device: str | None = None
    cache: Path | None = None
    run_args: list[str] = field(default_factory=list)  # more `ttt run` flags, e.g. --precision bf16
    history: Path | None = None  # earlier run times for the ETA (default: the user's cache, cli/suite_eta.py)


@dataclass
class Row:
    benchmark: str
    runs: int
    converged: int
    compliant: int
    score: float | None  # the official olympic score: None with fewer runs than it needs
    rcp: str
    note: str = ""
    mean_minutes: float | None = None  # run_start -> run_stop, mean of the compliant runs


def default_cache() -> Path:
    root = os.environ.get("TTT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "timetotrain")
    return Path(root) / "data"


def source_record(recipe: DataRecipe) -> dict:
    """What the data was made from: names and sizes (a changed source file makes the cache stale)."""
    files = [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in recipe.sources]
    return {"recipe": recipe.name, "steps": [list(s) for s in recipe.steps], "sources": files}


def cached(cache: Path, name: str) -> Path | None:
    folder = cache / name
    return folder if (folder / "source.json").is_file() else None


def is_current(folder: Path, recipe: DataRecipe) -> bool:
    try:
        return json.loads(
            fileio.read_bounded(folder / "source.json", fileio.SMALL_FILE, "source record").decode()
        ) == source_record(recipe)
    except (OSError, ValueError):
        return False


def recipe_for(bench, tier, src: Path) -> DataRecipe | None:
    """The task's recipe of the tier's data from `src`, checked against the name it gives without one."""
    recipe = bench.task.data_recipe(tier, src)
    if recipe is not None and recipe.name != bench.task.data_name(tier):
        raise AssertionError(f"{bench.name} {tier.name}: data_recipe names {recipe.name}, data_name another")
    return recipe


def _ttt(*args: str) -> list[str]:
    return [sys.executable, "-m", "timetotrain", *args]


def _child(cmd: list[str], capture: bool = False) -> subprocess.CompletedProcess:
    """Run one `ttt` step in its own process group, dying with the suite (SIGTERM on Linux). A signal to
    the suite is passed on to the step, which stops cleanly (a run logs run_stop aborted and the signal),
    and then stops the suite; a step that has not stopped STOP_WAIT_S later is killed with its group."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE if capture else None, text=True, env=env,
        process_group=0, preexec_fn=lifeline.preexec(signal.SIGTERM),
    )  # fmt: skip
    try:
        out, _ = proc.communicate()
    except Interrupted as e:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_WAIT_S)
        except (subprocess.TimeoutExpired, Interrupted):  # too slow, or a second Ctrl-C: no more waiting
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise Interrupted(e.signum, _STOPPED) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def hold_lock(out: Path) -> int:
    """Take OUT/suite.lock for this process's life (the fd stays open; the kernel drops the lock when the
    process ends, however it ends). The file is kept, not removed: removing it would let a third suite
    lock a new file while a second still waits on the old one."""
    path = out / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise UserError(
            f"--out {out}: cannot create {path} ({e.strerror}): pass a folder you can write to"
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise UserError(
            f"--out {out} is in use: another `ttt suite` (pid {holder}) holds {path}; wait for it or pass "
            "another --out"
        ) from None
    except OSError as e:  # a file system without locks (some network mounts): no way to keep suites apart
        os.close(fd)
        raise UserError(
            f"--out {out}: cannot lock {path} ({e.strerror}): pass a folder on a local disk"
        ) from e
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def set_aside_signalled(folder: Path) -> list[tuple[Path, Path, object, str]]:
    """Move the logs of runs a signal stopped out of the results: result_<k>.txt -> result_<k>.txt.signalled.
    Returns (old, new, seed, signal) for each."""
    moved = []
    for p in result_files(folder) if folder.is_dir() else []:
        lg = parse_log(p)
        sig = lg.keys.get(STOP_SIGNAL_KEY)
        if sig is not None and lg.status != "success":
            new = p.with_name(p.name + SIGNALLED)
            os.replace(p, new)
            moved.append((p, new, lg.seed, str(sig)))
    if moved:
        fileio.fsync_dir(folder)
    return moved


def select(tier: str, only: list[str] | None) -> list:
    if only:
        benches = [registry.get(n) for n in only]  # any registered name, listed or not
        missing = [b.name for b in benches if tier not in b.tiers]
        if missing:
            raise UserError(f"--only {missing[0]} has no tier {tier!r}: choose among its tiers or drop it")
        return benches
    benches = [registry.get(n) for n in registry.names() if tier in registry.get(n).tiers]
    if not benches:
        raise UserError(f"--tier {tier!r}: no benchmark has it (see `ttt list`)")
    return benches


def _load_state(path: Path, tier: str) -> dict:
    if not path.is_file():
        return {"tier": tier, "seeds": {}, "seconds": {}}
    try:
        state = json.loads(fileio.read_bounded(path, fileio.SMALL_FILE, "suite state").decode())
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}): remove it to start the suite afresh") from e
    problem = _state_problem(state)
    if problem:
        raise UserError(f"{path} is not a suite state ({problem}): remove it to start the suite afresh")
    if state.get("tier") != tier:
        raise UserError(
            f"--out {path.parent} holds a suite of tier {state.get('tier')!r}: pass another --out"
        )
    return state


def _state_problem(state) -> str:
    """Why `state` is not what `save` writes ('' when it is): the suite indexes it without further checks."""
    if not isinstance(state, dict):
        return f"a JSON {type(state).__name__}, not an object"
    if not isinstance(state.get("tier"), str):
        return "`tier` is not a string"
    for key, kind, ok in (
        ("seeds", "integer seeds", lambda v: isinstance(v, int) and not isinstance(v, bool)),
        ("seconds", "numbers of seconds", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    ):
        per = state.get(key, {})
        if not isinstance(per, dict):
            return f"`{key}` is a {type(per).__name__}, not an object of benchmark -> list"
        for bench, values in per.items():
            if not isinstance(values, list) or not all(ok(v) for v in values):
                return f"`{key}.{bench}` is not a list of {kind}"
    state.setdefault("seeds", {})
    state.setdefault("seconds", {})
    return ""


def finished_seeds(folder: Path) -> dict[int, Path]:
    """Seed -> finished log, for the result files already in a benchmark's folder."""
    out = {}
    for p in result_files(folder) if folder.is_dir() else []:
        seed = parse_log(p).seed
        if seed is not None:
            out[int(seed)] = p
    return out


def _fmt_s(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.0f} s"


class Suite:
    def __init__(self, opts: SuiteOptions):
        self.o = opts
        self.cache = opts.cache or default_cache()
        self.history = RunHistory(opts.history)
        self.state_path = opts.out / STATE
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[suite {_fmt_s(time.monotonic() - self.t0)}] {text}", file=sys.stderr, flush=True)

    def save(self) -> None:
        fileio.write_text(self.state_path, json.dumps(self.state, indent=2) + "\n")

    # -- data and bases --
    def data_for(self, bench, tier) -> Path:
        if bench.name in self.o.prepared:
            return self.o.prepared[bench.name]
        return self.prepare(bench, tier, f"{bench.name} {tier.name}")

    def prepare(self, bench, tier, who: str) -> Path:
        src = self.o.source
        if src is None:
            # No source: only a folder a previous suite prepared can serve.
            name = bench.task.data_name(tier)
            found = cached(self.cache, name) if name else None
            if found is None:
                raise UserError(
                    f"{who}: no data: pass --data SRC (raw sources: `ttt data download fixtures --out SRC`) "
                    f"or --data {bench.name}=DIR (a prepared folder)"
                )
            return found
        recipe = recipe_for(bench, tier, src)
        if recipe is None:
            raise UserError(
                f"{who}: timetotrain cannot prepare this data from --data {src}: pass "
                f"--data {bench.name}=DIR with a prepared folder"
            )
        folder = self.cache / recipe.name
        if is_current(folder, recipe):
            self.say(f"{who}: {recipe.describe}: cached in {folder}")
            return folder
        self.say(f"{who}: preparing {recipe.describe} into {folder}")
        tmp = folder.with_name(folder.name + ".partial")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        make_data(recipe, tmp, lambda step: self._step(who, step))
        fileio.write_text(tmp / "source.json", json.dumps(source_record(recipe), indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
        return folder

    def _step(self, who: str, step: list[str]) -> None:
        cmd = _ttt(*step)
        res = _child(cmd)
        if res.returncode != 0:
            raise UserError(f"{who}: `{' '.join(cmd[2:])}` failed (exit {res.returncode}); see above")

    def base_for(self, bench, tier) -> Path | None:
        if tier.base is None or tier.base.shipped is not None:  # none, or the run loads the shipped one
            return None
        rec = tier.base
        data = self.prepare(rec.benchmark, rec.pretraining, f"{bench.name} {tier.name} base")
        self.say(f"{bench.name} {tier.name}: base model (`ttt base`, cached after the first time)")
        # On the CPU whatever --device says: the base is deterministic there, so its cache is shared.
        cmd = _ttt("base", bench.name, "--tier", tier.name, "--data", str(data))
        res = _child(cmd, capture=True)
        if res.returncode != 0:
            raise UserError(f"{bench.name}: `ttt base` failed (exit {res.returncode}); see above")
        return Path(res.stdout.strip().splitlines()[-1])

    # -- runs --
    def seeds(self, bench, n: int) -> list[int]:
        have = self.state["seeds"].get(bench.name, [])
        if len(have) < n:
            need = n - len(have)
            if self.o.seed is not None:  # SEED, SEED+1, ... as `ttt run --runs`
                more = [self.o.seed + i for i in range(n) if self.o.seed + i not in have]
            else:
                more = [s for s in run_seeds(None, n) if s not in have]
            have = have + more[:need]
            self.state["seeds"][bench.name] = have
            self.save()
        return have[:n]

    def eta(self, bench: str, left: int) -> str:
        """From this suite's runs of the benchmark, else from this machine's earlier runs of the same code,
        tier and flags, by this user (cli/suite_eta.py); else it says there are none."""
        secs = self.state["seconds"].get(bench, [])
        where = ""
        if not secs:
            secs = self.history.seconds(self._key(bench))
            where = ", from this machine's earlier runs of this code"
        if not secs:
            return "ETA: no earlier run on this machine (of this code, tier and flags)"
        return f"ETA {_fmt_s(left * sum(secs) / len(secs))} for {bench}{where}"

    def _key(self, bench: str) -> str:
        return history_key(
            bench, self.o.tier, [*self.o.run_args, *(["--device", self.o.device] if self.o.device else [])]
        )

    def _remember(self, bench: str, seconds: float) -> None:
        self.history.remember(self._key(bench), seconds)

    def run_bench(self, bench) -> None:
        tier = bench.tier(self.o.tier)
        n = self.o.runs or tier.runs
        folder = self.o.out / bench.name / tier.name
        self._set_aside(folder, bench.name)
        done = finished_seeds(folder)
        todo = [s for s in self.seeds(bench, n) if s not in done]
        if not todo:
            self.say(f"{bench.name}: {n} run(s) already finished in {folder}: not rerun")
            return
        if len(todo) < n:
            self.say(
                f"{bench.name}: {n - len(todo)} of {n} run(s) already finished: running the other {len(todo)}"
            )
        data = self.data_for(bench, tier)
        base = self.base_for(bench, tier)
        for k, seed in enumerate(todo):
            self.say(
                f"{bench.name}: run {n - len(todo) + k + 1}/{n} (seed {seed}), {self.eta(bench.name, len(todo) - k)}"
            )
            cmd = _ttt("run", bench.name, "--tier", tier.name, "--data", str(data), "--logdir", str(self.o.out),
                       "--seed", str(seed), "--quiet", *self.o.run_args)  # fmt: skip
            if base is not None:
                cmd += ["--init-checkpoint", str(base)]
            if self.o.device:
                cmd += ["--device", self.o.device]
            t = time.monotonic()
            try:
                res = _child(cmd)
            except Interrupted:
                self._set_aside(folder, bench.name, " when the suite resumes")
                raise
            if res.returncode > 128:  # the run was stopped by a signal: so is the suite
                self._set_aside(folder, bench.name, " when the suite resumes")
                raise Interrupted(res.returncode - 128, _STOPPED)
            log = finished_seeds(folder).get(seed)
            if log is None:
                raise UserError(
                    f"{bench.name}: `ttt run` with seed {seed} wrote no result (exit {res.returncode})"
                )
            took = round(time.monotonic() - t, 1)
            self.state["seconds"].setdefault(bench.name, []).append(took)
            self.save()
            self._remember(bench.name, took)

    def _set_aside(self, folder: Path, bench: str, when: str = "") -> None:
        for old, new, seed, sig in set_aside_signalled(folder):
            self.say(
                f"{bench}: {old.name} (seed {seed}) was stopped by {sig}: kept as {new.name}, not scored; "
                f"seed {seed} runs again{when}"
            )

    def run(self) -> list[Row]:
        benches = select(self.o.tier, self.o.only)
        try:
            self.o.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"--out {self.o.out} cannot be created ({e.strerror}): pass a folder you can write to"
            ) from e
        _load_state(self.state_path, self.o.tier)  # bad input first: a refused suite leaves no lock file
        # Every benchmark's data must be reachable before the first run starts, not an hour into the suite.
        for b in benches:
            if b.name not in self.o.prepared and self.o.source is None:
                self._check_cached(b)
        self._lock = hold_lock(self.o.out)  # held until this process ends
        self.state = _load_state(
            self.state_path, self.o.tier
        )  # again: a suite that held the lock may have changed it
        self.say(f"tier {self.o.tier}: {', '.join(b.name for b in benches)} -> {self.o.out}")
        with raise_on_signals():
            for b in benches:
                self.run_bench(b)
        return [score_row(b, self.o.out / b.name / self.o.tier) for b in benches]

    def _check_cached(self, bench) -> None:
        tier = bench.tier(self.o.tier)
        for b, t in [(bench, tier)] + ([(tier.base.benchmark, tier.base.pretraining)] if tier.base else []):
            name = b.task.data_name(t)
            if name is None or cached(self.cache, name) is None:
                raise UserError(
                    f"{bench.name} {tier.name}: no data: pass --data SRC (raw sources: `ttt data download "
                    f"fixtures --out SRC`) or --data {bench.name}=DIR (a prepared folder)"
                )


def score_row(bench, folder: Path) -> Row:
    if not folder.is_dir() or not result_files(folder):
        return Row(bench.name, 0, 0, 0, None, "-", "no runs")
    (g,) = [g for g in find_groups(folder) if g.folder == folder]
    s = score_group(g)
    note = "; ".join(s.notes)
    failed = [r for r in s.runs if not r.compliant]
    if failed:
        note = (note + "; " if note else "") + f"{failed[0].file}: {failed[0].problem}"
    rcp = s.rcp.text(short=True)  # the wording of ttt score and ttt report
    minutes = [r.minutes for r in s.runs if r.compliant and r.minutes is not None]
    mean = sum(minutes) / len(minutes) if minutes else None
    return Row(bench.name, len(s.runs), sum(r.converged for r in s.runs), sum(r.compliant for r in s.runs),
               s.score_minutes, rcp, note, mean)  # fmt: skip


def format_rows(rows: list[Row]) -> str:
    w = max([16] + [len(r.rcp) + 2 for r in rows])  # "not enough runs (1 of >= 3)"
    head = (
        f"{'benchmark':<18}{'runs converged':>16}{'ttt check':>12}{'score (min)':>13}{'mean run (min)':>16}  "
        f"{'RCP':<{w}}note"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        score = "-" if r.score is None else f"{r.score:.3f}"
        mean = "-" if r.mean_minutes is None else f"{r.mean_minutes:.3f}"
        lines.append(
            f"{r.benchmark:<18}{f'{r.converged}/{r.runs}':>16}{f'{r.compliant}/{r.runs} pass':>12}{score:>13}"
            f"{mean:>16}  {r.rcp:<{w}}{r.note}"
        )
    return "\n".join(lines)
