"""Small, fabricated MLPerf result logs for scoring, RCP, packaging and report tests.

A fabricated tier log carries the keys `ttt run` logs (from the suite's tier data), so the tier's rule
file and the official engine accept it exactly when a real one would; the numbers are made up.
"""

from __future__ import annotations

import json
from pathlib import Path

T0 = 1_767_225_600_000  # 2026-01-01, ms


def _line(t: int, event: str, key: str, value=None, **meta) -> str:
    md = {"file": "timetotrain/train/loop.py", "lineno": meta.pop("lineno", 100), **meta}
    rec = {"namespace": "", "time_ms": t, "event_type": event, "key": key, "value": value, "metadata": md}
    return ":::MLLOG " + json.dumps(rec)


def tier_log(
    path: Path,
    seed: int,
    converge_at: int | None,
    minutes: float,
    *,
    benchmark: str = "llama31_8b",
    tier: str = "tiny",
    start_ms: int = T0,
    gbs: int | None = None,
    curve=None,
    steps=None,
) -> Path:
    """A run of `tier` that reaches the target at sample `converge_at` (None: never, then aborted) and
    whose run_start -> run_stop takes `minutes`; `steps`, a list of (samples_count, train_loss, figures or
    None), adds the per-step lines the loop writes (figures: GRPO's `ttt_rollout_stats`)."""
    from timetotrain.spec import registry

    bench = registry.get(benchmark)
    t = bench.tiers[tier]
    gbs = gbs or t.global_batch_size
    every = t.eval_every_samples
    last = converge_at if converge_at is not None else 6 * every
    points = list(range(every, last + 1, every))
    curve = curve or (
        lambda k, n: t.target + 0.8 * (n - 1 - k) / max(n - 1, 1) + (0.0 if k == n - 1 else 0.05)
    )
    values = [curve(k, len(points)) for k in range(len(points))]
    if converge_at is None:
        values = [max(v, t.target + 0.1) for v in values]
    lines = [
        _line(start_ms - 3000, "POINT_IN_TIME", "cache_clear", True),
        _line(start_ms - 3000, "INTERVAL_START", "init_start"),
    ]
    keys = [
        ("submission_benchmark", benchmark),
        ("submission_org", "timetotrain"),
        ("submission_division", t.division),
        ("submission_status", "onprem"),
        ("submission_platform", "test-box"),
        ("seed", seed),
        ("global_batch_size", gbs),
        ("gradient_accumulation_steps", max(1, gbs // t.micro_batch_size)),
        ("micro_batch_size", min(t.micro_batch_size, gbs)),
        ("max_sequence_length", t.data.seq_len),
        ("max_steps", t.max_steps),
        ("opt_base_learning_rate", t.lr),
        ("opt_end_learning_rate", t.end_lr),
        ("opt_learning_rate_warmup_steps", t.warmup_steps),
        ("opt_learning_rate_decay_steps", t.decay_steps),
        *bench.optimizer.log_keys(),
        ("train_samples", t.max_steps * gbs),
        ("eval_samples", t.eval_samples),
        ("ttt_model", bench.model_key(t)),
        ("ttt_tier", tier),
        ("ttt_eval_every_samples", every),
        # What `ttt run` logs on one process in fp32 (mlperf/keys.py), required exactly once from 6.1 on.
        ("tensor_parallelism", 1),
        ("pipeline_parallelism", 1),
        ("context_parallelism", 1),
        ("expert_parallelism", 1),
        ("lowest_numerical_precision_in_linear", "fp32"),
        ("lowest_numerical_precision_in_attn", "fp32"),
        ("lowest_numerical_precision_in_comm", "fp32"),
        ("config_filename", f"{benchmark}_{tier}"),
    ]
    for i, (k, v) in enumerate(keys):
        lines.append(_line(start_ms - 2000, "POINT_IN_TIME", k, v, lineno=200 + i))
    lines.append(_line(start_ms, "INTERVAL_END", "init_stop"))
    lines.append(_line(start_ms, "INTERVAL_START", "run_start"))
    stop = start_ms + round(minutes * 60_000)
    lines.append(_line(start_ms + 1, "INTERVAL_START", "block_start", samples_count=0))
    for k, (at, loss, figures) in enumerate(steps or []):
        lines.append(
            _line(start_ms + 1, "POINT_IN_TIME", "train_loss", loss, step_num=k + 1, samples_count=at)
        )
        if figures is not None:
            lines.append(
                _line(
                    start_ms + 1,
                    "POINT_IN_TIME",
                    "ttt_rollout_stats",
                    figures,
                    step_num=k + 1,
                    samples_count=at,
                )
            )
    for k, (s, v) in enumerate(zip(points, values, strict=True)):
        ts = start_ms + 1 + round((stop - start_ms - 2) * (k + 1) / len(points))
        lines.append(_line(ts - 1, "INTERVAL_END", "block_stop", samples_count=s))
        lines.append(_line(ts - 1, "INTERVAL_START", "eval_start", samples_count=s))
        lines.append(_line(ts - 1, "POINT_IN_TIME", "eval_accuracy", v, samples_count=s))
        lines.append(_line(ts - 1, "INTERVAL_END", "eval_stop", samples_count=s))
        if k < len(points) - 1:
            lines.append(_line(ts - 1, "INTERVAL_START", "block_start", samples_count=s))
    status = "success" if converge_at is not None else "aborted"
    lines.append(_line(stop, "INTERVAL_END", "run_stop", status=status, samples_count=last))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def grpo_steps(seed: int, n: int = 20, gbs: int = 64) -> list[tuple[int, float, dict]]:
    """n made-up GRPO steps: a falling loss and a rising reward, different for every seed."""
    return [
        (gbs * (k + 1), 0.05 - 0.01 * k - 0.05 * seed,
         {"reward": round(0.05 + 0.02 * k + 0.1 * seed, 6), "completion_tokens": 4.5, "zero_std_groups": 0.25,
          "truncated": 0.1, "dropped": 0.1})
        for k in range(n)
    ]  # fmt: skip


def rcp_only_log(
    path: Path, benchmark: str, gbs: int, converge_at: float | None, key: str = "samples_count"
) -> Path:
    """Just the lines the RCP checker reads: enough to compare verdicts, not a compliant log."""
    lines = [
        _line(T0, "POINT_IN_TIME", "submission_benchmark", benchmark),
        _line(T0, "POINT_IN_TIME", "global_batch_size", gbs),
        _line(T0 + 1, "POINT_IN_TIME", "eval_accuracy", 1.0, **{key: converge_at or 1}),
        _line(T0 + 2, "INTERVAL_END", "run_stop", status="success" if converge_at else "aborted"),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def curve_log(path: Path, benchmark: str, gbs: int, every: int, converge_at: int, target: float) -> Path:
    """An official benchmark's run for plots: evals every `every` samples, falling by 0.01 a point to
    just under a lower-is-better `target` at `converge_at`, and a successful run_stop."""
    points = range(every, converge_at + 1, every)
    lines = [
        _line(T0, "POINT_IN_TIME", "submission_benchmark", benchmark),
        _line(T0, "POINT_IN_TIME", "global_batch_size", gbs),
        _line(T0 + 1, "INTERVAL_START", "run_start"),
    ]
    for k, s in enumerate(points):
        value = target + 0.01 * (len(points) - 1 - k) - 0.001
        lines.append(_line(T0 + 2 + k, "POINT_IN_TIME", "eval_accuracy", value, samples_count=s))
    lines.append(_line(T0 + 600_000, "INTERVAL_END", "run_stop", status="success"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_runs(folder: Path, n: int = 10, aborted: tuple[int, ...] = (), start_seed: int = 100) -> list[Path]:
    """n tiny-tier runs with distinct seeds; convergence between 3,200 and 4,480 samples."""
    out = []
    for i in range(n):
        conv = None if i in aborted else 320 * (10 + (i * 7) % 5)
        minutes = 1.0 + 0.05 * ((i * 3) % 7)
        out.append(
            tier_log(folder / f"result_{i}.txt", start_seed + i, conv, minutes, start_ms=T0 + i * 600_000)
        )
    return out


def ttt_main(argv: list[str]) -> int:
    """score/package/report/check as `ttt` runs them: parsed by the parser `add_commands` builds, a
    UserError turned into exit 2 as cli.main does."""
    import argparse

    from timetotrain.cli.results import add_commands
    from timetotrain.errors import UserError

    parser = argparse.ArgumentParser(prog="ttt")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        import sys

        print(f"ttt: error: {e}", file=sys.stderr)
        return 2


def logged_keys(bench, tier) -> list:
    """The (key, value) pairs a run of `tier` logs for the rule files: submission keys, then hyperparameters."""
    from timetotrain.mlperf.keys import submission_keys

    return submission_keys(bench, tier, "org", "platform") + bench.hyperparameters(tier)


def uncovered_rule_keys(rule_files, logged: list) -> list[str]:
    """ "<file>: <key>" for every key a rule file checks (eval_accuracy aside: a run logs it, not its
    hyperparameter block) that the (key, value) pairs `logged` do not hold: a rule silently not exercised."""
    import yaml

    keys = {k for k, _ in logged}
    out = []
    for f in rule_files:
        for item in yaml.safe_load(f.read_text()):
            name = item.get("KEY", {}).get("NAME")
            if name and name != "eval_accuracy" and name not in keys:
                out.append(f"{f.name}: {name}")
    return out
