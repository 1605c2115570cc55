"""bench/gpu_probe.py (the prepared GPU probe behind bench/gpu_check.sh) runs end to end in its `--cpu-smoke`
mode: one JSON record per figure, appended as measured; a spent budget turns the remaining figures into
`skipped` records instead of stopping the script (what a cut-short run on a lent GPU relies on)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PROBE = Path(__file__).resolve().parents[1] / "bench" / "gpu_probe.py"


def probe():
    spec = importlib.util.spec_from_file_location("gpu_probe", PROBE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_probe", mod)
    spec.loader.exec_module(mod)
    return mod


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_cpu_smoke_writes_one_record_per_figure(tmp_path):
    assert probe().main(["--cpu-smoke", "--out", str(tmp_path), "--only", "head_loss,attention"]) == 0
    recs = records(tmp_path)
    assert [r["kind"] for r in recs] == ["env", "head_loss", "attention", "attention", "done"]
    assert all(r.get("status", "ok") == "ok" for r in recs), recs
    head = recs[1]
    assert head["max_rel_diff"] == {"loss": 0.0, "dh": 0.0, "dW": 0.0}  # the same arithmetic on a CPU
    assert head["fp32_buffer_s"] > 0 and head["bf16_logits_s"] > 0


def test_a_spent_budget_skips_and_still_reports(tmp_path):
    assert probe().main(["--cpu-smoke", "--out", str(tmp_path), "--only", "synth", "--budget-s", "-1"]) == 0
    recs = records(tmp_path)
    synth = [r for r in recs if r["kind"] in ("synth", "extrapolated")]
    assert synth and all(r["status"] == "skipped" for r in synth)
    assert recs[-1]["kind"] == "done"


def test_cpu_smoke_of_the_window_cast_and_mxfp8_records(tmp_path):
    """The records issue 26's later items add: the sliding window (mask path measured; the native kernel,
    absent on a CPU, said so), the experts' once-per-step cast (gradients equal), MXFP8 (emulated here)."""
    assert probe().main(["--cpu-smoke", "--out", str(tmp_path), "--only", "window,moe_cast,mxfp8"]) == 0
    recs = records(tmp_path)
    assert [r["kind"] for r in recs] == ["env", "window", "moe_cast", "synth", "done"]
    assert all(r.get("status", "ok") == "ok" for r in recs), recs
    window, cast, mx = recs[1], recs[2], recs[3]
    assert window["mask_fwd_bwd_ms"] > 0 and window["native_window_works"] is False
    assert window["native"].startswith("unavailable") and "native_fwd_bwd_ms" not in window
    assert cast["max_abs_grad_diff"] == 0.0 and cast["casts_saved_per_step"] == 3
    assert (mx["precision"], mx["fp8_recipe"]) == ("fp8", "mxfp8") and mx["tokens_per_s"] > 0


def test_cpu_smoke_of_the_compile_coverage_record(tmp_path):
    """Per family: its blocks' graph counts and breaks, what stays eager, eager vs compiled step time (the
    smoke compiles with `aot_eager`, fp32; tests/test_compile_coverage.py pins every family's counts)."""
    argv = ["--cpu-smoke", "--out", str(tmp_path), "--only", "compile_coverage", "--families", "llama"]
    assert probe().main(argv) == 0
    recs = records(tmp_path)
    assert [r["kind"] for r in recs] == ["env", "compile_coverage", "done"]
    cov = recs[1]
    assert cov["status"] == "ok", cov
    assert (cov["graphs"], cov["breaks"]) == (1, 0) and cov["eager_outside"] == ["embed", "norm", "head"]
    assert cov["backend"] == "aot_eager" and cov["eager_step_s"] > 0 and cov["compiled_step_s"] > 0
    assert cov["loss_abs_diff"] <= 1e-5  # fp32: the compiled blocks compute what the eager ones do
