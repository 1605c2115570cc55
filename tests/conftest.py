"""Shared test helpers."""

import importlib
import os
from pathlib import Path

# OpenMP threads (torch's intra-op pool: 2 on 2 cores) spin a while after each parallel region before they
# sleep. With two xdist workers on two cores a spinning thread takes the core the other process needs, and
# tests of many tiny ops (decode loops, evals) burned 2.7x the CPU: tests/test_untrained_misses_target.py
# 120 against 44 CPU-s, two sessions side by side. PASSIVE sleeps at once; the same threads split the same
# work, so no result changes (a llama31_8b tiny run's losses are identical). Set before torch loads libgomp,
# which reads it once; the workers, the fork server and every process a test starts inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from forked import run_ranks, run_ttt  # noqa: E402


def require(name: str):
    """Import and return module `name`; skip the test when it is missing, except under CI=true where it fails.

    A laptop without the optional test peers should still run the rest of the suite, but CI must never
    turn a missing dependency into a silent pass.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        message = f"{name} is not importable ({exc})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; required under CI=true", pytrace=False)
        pytest.skip(f"{message}; install the test extras to run this test")


REPO = Path(__file__).resolve().parents[1]

# torch's intra-op thread count when the session starts. Tests share one process: a fixture that sets one
# thread to compare with one-thread workers (test_deepseek_v3_ep, test_ep_fsdp) had left every later test
# on one thread, twice as slow on 2 cores.
THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _threads_restored():
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (pyproject's addopts): two for the whole suite, whose subprocess starts,
    single-threaded unit tests and one-thread ranks leave a core idle much of the time; none (this
    process) when files or tests are named, where starting workers costs more than it gains."""
    named = [a for a in config.args if Path(a.split("::")[0]).resolve() != REPO / "tests"]
    return 0 if named else min(2, os.cpu_count() or 1)


# The files that take longest (a minute or more of a worker on 2 cores: the runs to target, the multi-rank
# layouts), collected first. Under `--dist loadfile` (pyproject's addopts) xdist hands whole files to the
# workers in collection order, so a long file collected late runs on while the other worker has finished;
# longest first keeps the two workers' ends close. Every other file keeps its (alphabetical) place.
FIRST = (
    "test_gpt_oss.py",
    "test_e2e_tiny.py",
    "test_distributed.py",
    "test_synth.py",
    "test_plan_builds.py",
    "test_simulate.py",
    "test_reproducible.py",
    "test_layouts_pp_moe.py",
    "test_flux_tiny.py",
    "test_lora_tiny.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(
        key=lambda item: rank.get(item.path.name, len(FIRST))
    )  # stable: a file's tests keep their order


# The fast lane (`-m "not slow"`) stays under 3 minutes only while every test over about 3 s is marked slow.
# Timing depends on the host and its load, so a slow unmarked test is named at the end of the session (and
# under TTT_SLOW_MARKS=strict fails it) rather than in a test of its own.
SLOW_S = float(os.environ.get("TTT_SLOW_S", "3"))
_UNMARKED: list[tuple[float, str]] = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > SLOW_S and "slow" not in report.keywords:
        _UNMARKED.append((report.duration, report.nodeid))
    if report.skipped and NO_FIXTURE in str(report.longrepr):
        _NO_FIXTURE.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if _UNMARKED:
        terminalreporter.section(f"over {SLOW_S:g} s and not marked slow")
        for seconds, nodeid in sorted(_UNMARKED, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
    if _NO_FIXTURE:
        # A fresh clone has no ../shared/data: one line says what was left out and how to get it, where
        # `-ra` lists each skip by its own reason.
        where = f"the data fixtures are not in {shared_data_dir()}"
        if _FETCH.get("fetched"):
            where += (
                " (fetched there from their public sources, which do not hold the MLPerf v5.1 result logs)"
            )
        elif _FETCH.get("failed"):
            where += f" and fetching them into {_FETCH['cache']} failed, leaving nothing: {_FETCH['failed']}"
        terminalreporter.write_line(
            f"ttt: {len(_NO_FIXTURE)} test(s) skipped: {where}; get them with `ttt data download fixtures --out "
            "DIR` (--mirror URL|DIR where GitHub is out of reach) and run again with TTT_SHARED_DATA=DIR; any "
            "folder already in that layout (c4/, cc12m/, coco_mini/, govreport/, tokenizers/, e.g. copied from "
            "another machine) can be passed as it is with TTT_SHARED_DATA=DIR, or put next to this clone as "
            "../shared/data (the MLPerf v5.1 result logs come only that way)",
            yellow=True,
        )


# Where ../shared/data is absent and TTT_SHARED_DATA unset (a fresh clone), the session fetches the fixtures
# once into the user's cache (timetotrain/data/fixtures.py fetch_cached) and points TTT_SHARED_DATA there for
# its tests, xdist workers and subprocesses. TTT_FETCH_FIXTURES=0 turns it off; TTT_FIXTURES_MIRROR=URL|DIR
# fetches from a copy in `ttt data download fixtures --mirror`'s layout instead of GitHub.
FETCH_ENV = "TTT_FETCH_FIXTURES"
MIRROR_ENV = "TTT_FIXTURES_MIRROR"
_FETCH: dict = {}


@pytest.hookimpl(tryfirst=True)  # before xdist starts its workers (trylast), which inherit the environment
def pytest_sessionstart(session):
    if (
        hasattr(session.config, "workerinput")
        or "TTT_SHARED_DATA" in os.environ
        or shared_data_dir().exists()
    ):
        return
    if os.environ.get(FETCH_ENV, "1") == "0":
        return
    from timetotrain.data import fixtures

    cache = fixtures.cache_dir()
    _FETCH["cache"] = cache
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not (cache / fixtures.COMPLETE).is_file():
        reporter.write_line(
            f"ttt: no data fixtures at {shared_data_dir()}: fetching them once into {cache} "
            f"({FETCH_ENV}=0 skips this)"
        )
    try:
        fixtures.fetch_cached(cache, os.environ.get(MIRROR_ENV) or fixtures.RAW)
    except Exception as e:  # offline, a changed source, a bug: the tests that need the data skip, said once
        _FETCH["failed"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return
    _FETCH["fetched"] = True
    os.environ["TTT_SHARED_DATA"] = str(cache)


def pytest_sessionfinish(session, exitstatus):
    if _UNMARKED and os.environ.get("TTT_SLOW_MARKS") == "strict" and exitstatus == 0:
        session.exitstatus = 1


def shared_data_dir() -> Path:
    """The data fixtures' folder: TTT_SHARED_DATA, else ../shared/data beside the clone."""
    return Path(os.environ.get("TTT_SHARED_DATA", REPO.parent / "shared" / "data"))


NO_FIXTURE = "data fixture not found"  # the skip reason's tag the session summary counts
_NO_FIXTURE: set[str] = set()


def require_file(path: Path) -> Path:
    """A fixture file from ../shared/data: skip locally when absent, fail under CI=true."""
    if not path.exists():
        message = f"{NO_FIXTURE}: {path} (set TTT_SHARED_DATA to the data fixtures' folder)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; required under CI=true", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def c4_src() -> Path:
    return require_file(shared_data_dir() / "c4" / "en")


@pytest.fixture(scope="session")
def c4_prepared(c4_src, tmp_path_factory) -> Path:
    """The shared C4 sample tokenized once per session, as `ttt data prepare` writes it."""
    from timetotrain.data import c4

    out = tmp_path_factory.mktemp("c4")
    for split in ("train", "validation"):
        c4.prepare(c4_src, split, "llama3", out, workers=2)
    return out


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it), for torchrun's rendezvous: fixed ports collide
    when test runs overlap on one machine."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mllog(path: Path) -> list[dict]:
    """The MLLOG records of a result file, in order."""
    import json

    return [
        json.loads(ln.split(":::MLLOG ", 1)[1]) for ln in path.read_text().splitlines() if ":::MLLOG " in ln
    ]


def ttt_command(*argv: str, nproc: int = 1) -> list[str]:
    """`python -m timetotrain ARGV`, or under torchrun with `nproc` local processes on a free port."""
    import sys

    if nproc == 1:
        return [sys.executable, "-m", "timetotrain", *argv]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_port", str(free_port()), "-m", "timetotrain", *argv,
    ]  # fmt: skip


def ttt_run(*argv: str, nproc: int = 1, env: dict | None = None, timeout: float = 600, cwd=None):
    """`ttt ARGV` as `subprocess.run(..., capture_output=True, text=True)` reports it: on one process forked
    from this one (tests/forked.py: no fresh interpreter to start), on `nproc` > 1 under torchrun."""
    import subprocess

    if nproc == 1:
        return run_ttt(*argv, env=env, timeout=timeout, cwd=cwd)
    cmd = ttt_command(*argv, nproc=nproc)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def layout_workers(script: str, root: Path, nproc: int) -> tuple[list[dict], dict]:
    """Run `script` (a test file that is also a torchrun worker, as tests/test_layouts.py) on `nproc` gloo
    ranks writing into `root`: each rank's `rank{r}.json` and rank 0's `weights.pt`."""
    import json

    run_ranks(script, [str(root)], nproc, free_port())
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(nproc)]
    return ranks, torch.load(root / "weights.pt")


def layout_results_written(out: Path, results: dict, weights: dict) -> None:
    """A `layout_workers` rank's last act: its results, rank 0's weights, and the process group ended."""
    import json

    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 0:
        torch.save(weights, out / "weights.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def grpo_problems(bench, tier, folder: Path) -> Path:
    """The GRPO tier's arithmetic problems, written once under `folder` (the GRPO layout tests)."""
    out = folder / "problems"
    if not out.exists():
        out.mkdir(parents=True)
        bench.task.data_recipe(tier, out).call(out)
    return out


def grpo_trained(tr, data, steps: int, accum: int) -> dict:
    """`steps` GRPO steps through the harness (rollouts by `prepare`, then `Training.step`), then an eval:
    every step's global train_loss and rollout figures, and the pass@k (the GRPO layout tests)."""
    from timetotrain.tasks.grpo import rollout_figures

    losses, stats = [], []
    for step in range(steps):
        batch = data.prepare(tr.model, data.batch(step))
        loss, _, *sums = tr.step(step, batch, accum, data.loss, sums=data.step_sums()).tolist()
        losses.append(loss)
        stats.append(rollout_figures(sums))
    return {"loss": losses, "stats": stats, "pass": data.evaluate(tr.model)}


def grpo_layout_worker(out: Path, by_world: dict, specs: dict, train, bench, tier) -> None:
    """A GRPO layout test's torchrun worker: every scenario of its world size, `train(plan, rank, problems)`
    on the rank's own copy of the problems, then `layout_results_written`."""
    import torch.distributed as dist

    from timetotrain.train import parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = grpo_problems(bench, tier, out / f"rank{rank}")
    results, weights = {}, {}
    for name in by_world[world]:
        results[name], weights[name] = train(parallel.parse(specs[name], world), rank, problems)
    layout_results_written(out, results, weights)


def moe_layout_trained(bench, tier, plan, rank: int, batches: list) -> tuple:
    """(the `Training`, the global train_loss of every step, the placements of the trained parameters) of
    `tier` under `plan` through the harness's own build and step, `batches` of token ids as a causal LM (the
    MoE layout tests: tests/test_layouts_moe.py, tests/test_layouts_moe_tp.py)."""
    from timetotrain.tasks.causal_lm import lm_loss
    from timetotrain.train.step import build_training

    tr = build_training(bench, tier, torch.device("cpu"), 7, plan)
    accum = (tier.global_batch_size // plan.data_parallel) // tier.micro_batch_size
    losses = [
        tr.step(s, {"ids": b}, accum, lambda m, b: lm_loss(m, b["ids"], None))[0].item()
        for s, b in enumerate(batches)
    ]
    placed = {
        n: str(getattr(p, "placements", "plain")) for n, p in tr.bare.named_parameters() if p.requires_grad
    }
    return tr, losses, placed


def trained_weights(model) -> dict:
    """Every trained parameter whole in the model's layout: DTensors gathered (a TP plan's stacked rows put
    back, train/tensor_parallel.py), expert slices all-gathered over their expert-parallel group (in expert
    order)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from timetotrain.train.expert_parallel import expert_dtensors
    from timetotrain.train.tensor_parallel import unstack

    experts = expert_dtensors(model) if dist.is_initialized() else {}
    out = {}
    for n, p in model.named_parameters():
        t = experts.get(n, p)
        out[n] = (unstack(t.full_tensor(), p) if isinstance(t, DTensor) else t).detach().clone()
    return out


_LAYOUT_RUNS: dict = {}


def first_backward(tr, batch: dict, accum: int, loss_fn) -> None:
    """One step's forwards and backwards of `batch` through a built `Training` (its pipeline schedule, or
    the micro-batches of one process), no optimizer step: the gradients a layout test compares."""
    from timetotrain.train.pipeline import Pipeline
    from timetotrain.train.step import _forward_backward

    if isinstance(tr.model, Pipeline):
        tr.model.forward_backward(batch, accum, loss_fn)
    else:
        _forward_backward(tr.model, batch, accum, loss_fn, None)


def layout_run(script: str, root: Path, by_world: dict[int, list[str]], name: str) -> tuple[list[dict], dict]:
    """`layout_workers` for the world size that runs scenario `name`, once per (script, root, world)."""
    nproc = next(w for w, names in by_world.items() if name in names)
    key = (script, root, nproc)
    if key not in _LAYOUT_RUNS:
        folder = root / str(nproc)
        folder.mkdir(parents=True, exist_ok=True)
        _LAYOUT_RUNS[key] = layout_workers(script, folder, nproc)
    return _LAYOUT_RUNS[key]


def assert_trains_as_one_process(ranks, weights, name, expected, final, atol: float = 1e-6) -> None:
    """Every rank's global train_loss of scenario `name` equals one process's `expected` at rtol 1e-5, the
    run trained, and rank 0's gathered `weights` equal the one-process `final` ones."""
    for r in ranks:
        assert r[name] == ranks[0][name]  # every rank reports the same global loss
        torch.testing.assert_close(torch.tensor(r[name]), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0] - 0.2  # it trained: a layout that froze some weights would not match
    got = weights[name]
    assert got.keys() == final.keys() and final
    for n, w in final.items():
        torch.testing.assert_close(got[n], w, rtol=1e-4, atol=atol, msg=n)


# llama31_8b tiny's short runs on gloo (OMP_NUM_THREADS=1) take the seed of the recorded FSDP2 golden
# (tests/golden/llama31_8b_tiny_fsdp2.json), so that one run serves the files that read it: the golden
# FSDP2 run is also test_distributed's FSDP2 side, the DDP run test_distributed's DDP side and the first of
# test_reproducible's two DDP runs.
LLAMA_SEED = 4242


def launch_llama_tiny(data, logdir, nproc, *extra, env_extra=None, wait=True):
    """`ttt run llama31_8b --tier tiny --seed LLAMA_SEED EXTRA` on `nproc` processes of one thread each."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    args = ["run", "llama31_8b", "--tier", "tiny", "--data", str(data), "--logdir", str(logdir), "--quiet"]
    args += ["--seed", str(LLAMA_SEED), *extra]
    if nproc == 1 and wait:  # forked: no fresh interpreter (3.5 s of imports) where no process is tested
        return ttt_run(*args, env=env, timeout=600)
    cmd = ttt_command(*args, nproc=nproc)
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def llama_fsdp2_20(c4_prepared, tmp_path_factory):
    """(process, logdir) of llama31_8b tiny under FSDP2 on 2 processes for the golden's 20 steps."""
    out = tmp_path_factory.mktemp("llama_fsdp2_20")
    return launch_llama_tiny(c4_prepared, out, 2, "--max-steps", "20", "--parallel", "fsdp=2"), out


@pytest.fixture(scope="session")
def llama_ddp_20(c4_prepared, tmp_path_factory):
    """(process, logdir) of llama31_8b tiny under DDP on 2 processes for 20 steps (the warmup's end and the
    first eval)."""
    out = tmp_path_factory.mktemp("llama_ddp_20")
    return launch_llama_tiny(c4_prepared, out, 2, "--max-steps", "20", "--parallel", "dp=2"), out


@pytest.fixture(scope="session")
def criteo_tiny(tmp_path_factory):
    """(process, folder) of `ttt data synth-criteo --scale tiny --seed 0`, made once for the dlrm_dcnv2 files
    that train on it (tests/test_dlrm_dcnv2_tiny.py, tests/test_dlrm_dcnv2_distributed.py)."""
    out = tmp_path_factory.mktemp("criteo_tiny") / "data"
    argv = ["data", "synth-criteo", "--scale", "tiny", "--out", str(out), "--seed", "0"]
    return ttt_run(*argv, env={**os.environ, "OMP_NUM_THREADS": "1"}), out


@pytest.fixture(scope="session")
def graph_tiny(tmp_path_factory) -> Path:
    """`ttt data synth-graph --scale tiny --seed 0`, made once for the files that read it (tests/test_igbh.py,
    tests/test_rgat_tiny.py)."""
    from timetotrain.cli import main

    out = tmp_path_factory.mktemp("graph_tiny") / "graph"
    assert main(["data", "synth-graph", "--scale", "tiny", "--out", str(out), "--seed", "0"]) == 0
    return out


def random_hf_llama(cfg):
    """An HF `LlamaForCausalLM` equivalent to our `LlamaConfig` `cfg`, fp32, eager attention, seeded random
    weights: std 0.03 gives logits of about +-1 (large enough that a wrong mapping shows, small enough that
    fp32 rounding of two different kernels stays within 1e-6), and non-unit norms catch a swapped norm."""
    import torch

    from timetotrain.models.llama.hf import hf_config_kwargs

    transformers = require("transformers")
    hf_cfg = transformers.LlamaConfig(**hf_config_kwargs(cfg))
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.03)
    return hf


def small_llama(**overrides):
    """The small Llama shape the checkpoint and LoRA tests share (d 64, 2 layers, 4 heads / 2 KV heads)."""
    from timetotrain.models.llama import LlamaConfig

    shape = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    return LlamaConfig(**{**shape, **overrides})


def small_deepseek_v3():
    """The small DeepSeek-V3 shape the expert-parallel tests share: MLA with q_lora, 16 experts top-4 in 4
    groups, one dense layer, YaRN (original context 8) at 32 tokens."""
    from timetotrain.models.common.layers import YarnScaling
    from timetotrain.models.deepseek_v3 import DeepSeekV3Config

    return DeepSeekV3Config(
        dim=32, n_layers=2, n_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8,
        v_head_dim=8, ffn_dim=48, n_experts=16, top_k=4, expert_ffn_dim=16, n_groups=4, topk_groups=2,
        first_dense=1, vocab_size=128, max_seq_len=32, bias_rate=1e-2, init_std=0.05,
        rope_scaling=YarnScaling(factor=4.0, original_max_position=8),
    )  # fmt: skip


def official_errors(log: Path, ruleset: str, tier: str) -> list[str]:
    """The official compliance engine's messages on `log` under `ruleset` (none: it passes). A reference
    log is judged as a submission is, from `common.yaml` down the chain it enqueues (the division's
    common file, then `<division>_<bench>.yaml`). Another tier's log is judged by `common.yaml` and
    `<division>_common.yaml` only: the division's benchmark file states the reference tier's values (and a
    benchmark the round does not list, the test-only toy, by `common.yaml` alone)."""
    from mlperf_logging.compliance_checker import mlp_compliance, mlp_parser

    from timetotrain.spec.official import official_benchmark

    checker = mlp_compliance.make_checker("training", ruleset, quiet=True, werror=False)
    lines, errors = mlp_parser.parse_file(str(log), ruleset=ruleset)
    if errors:
        return [f"parse error: {e}" for _, e in errors]
    queue = mlp_compliance.enqueued_configs  # the engine's module-level queue of files to check
    queue.clear()
    if tier == "reference":
        checker.check_loglines(lines, f"training_{ruleset}/common.yaml")
    else:
        first = {ln.key: ln.value["value"] for ln in reversed(lines)}
        names = ["common.yaml"]
        if official_benchmark(first["submission_benchmark"], ruleset):  # it only names the round's benchmarks
            names.append(f"{first['submission_division']}_common.yaml")
        for name in names:
            path = Path(mlp_compliance.__file__).parent / f"training_{ruleset}" / name
            checker.configured_checks(lines, str(path))
            queue.clear()  # what those files enqueue (the division's benchmark file) is not checked
    return [*checker.overwritable.values(), *checker.not_overwritable]


def strict_loads(text: str):
    """json.loads that fails where strict parsers (python -m json.tool, jq, JSON.parse) fail: Python's own
    accepts NaN and Infinity."""
    import json

    def reject(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=reject)


def assert_parse_refuses(cases) -> None:
    """Each (spec, world, needle): `--parallel spec` on `world` ranks is refused in one line saying `needle`."""
    from timetotrain.errors import UserError
    from timetotrain.train import parallel

    for spec, world, needle in cases:
        with pytest.raises(UserError, match=needle) as e:
            parallel.parse(spec, world)
        assert "\n" not in str(e.value), spec
