"""dlrm_dcnv2's reference tier against the official 6.0.0 tools: a log of the reference tier's shape (our
hyperparameter block, an eval every TOTAL_TRAINING_SAMPLES // (GBS x 20) steps with `epoch_num` from 0,
eval_samples once) passes closed_dlrm_dcnv2.yaml through `ttt check`; `ttt score --ruleset 6.0.0` equals the
official result_summarizer on a submission tree of such logs (RCP found, interpolated, failing); closed
runs that change what the rules fix are refused before init_start."""

import json

import pytest
from fakelogs import ttt_main
from summarizer_parity import assert_score_equals_summarizer, system_json

from timetotrain.cli import main
from timetotrain.spec import registry

pytestmark = pytest.mark.parity

ORG = "Acme"
T0 = 1_770_000_000_000
BENCH = registry.get("dlrm_dcnv2")
REF = BENCH.tiers["reference"]
TRAIN = REF.data.train_rows
LR = {32768: 0.004, 40960: 0.004, 55296: 0.004, 65536: 0.004}

# system: (GBS, evals to converge of the 10 runs (None: aborted after one epoch), RCP verdict, message)
CASES = {
    "found_pass": (55296, [17, 18, 17, 17, 18, 17, 18, 17, 17, 18], "Pass", "RCP found"),
    "interp_pass": (65536, [16, 17, 15, 16, 16, 17, 16, 15, 16, 17], "Pass", "RCP Interpolation"),
    "found_fail": (55296, [13, 13, 14, 13, 13, 14, 13, 13, 13, 14], "Fail", "RCP found"),
    "one_aborted": (32768, [16, 16, 17, 15, 16, 17, 16, 16, 15, None], "Pass", "RCP found"),
}


def _rec(t, event, key, value=None, **meta):
    md = {"file": "timetotrain/train/loop.py", "lineno": 100, **meta}
    return ":::MLLOG " + json.dumps(
        {"namespace": "", "time_ms": t, "event_type": event, "key": key, "value": value, "metadata": md}
    )


def ref_log(path, system, seed, gbs, converge, start_ms, interval_ms=20_000):
    """A reference-tier run at `gbs` as `ttt run` logs it, meeting the target at eval `converge`."""
    from timetotrain.spec.benchmark import apply_overrides

    tier = apply_overrides(BENCH, REF, [f"global_batch_size={gbs}", f"lr={LR[gbs]}"] if gbs != 65536 else [])
    every = BENCH.task.eval_every_steps(tier)
    batches = tier.max_steps
    lines = [_rec(start_ms - 9000, "POINT_IN_TIME", "cache_clear", True)]
    lines.append(_rec(start_ms - 9000, "INTERVAL_START", "init_start"))
    keys = [
        ("submission_benchmark", "dlrm_dcnv2"),
        ("submission_org", ORG),
        ("submission_division", "closed"),
        ("submission_status", "onprem"),
        ("submission_platform", f"1x{system}"),
        ("seed", seed),
        *BENCH.hyperparameters(tier),
    ]
    lines += [_rec(start_ms - 5000, "POINT_IN_TIME", k, v) for k, v in keys]
    lines.append(_rec(start_ms, "INTERVAL_END", "init_stop"))
    lines.append(_rec(start_ms, "INTERVAL_START", "run_start"))
    lines.append(_rec(start_ms + 1, "INTERVAL_START", "block_start", samples_count=0))
    evals = converge if converge is not None else batches // every
    t = start_ms + 1
    for k in range(1, evals + 1):
        step = k * every
        e = {"epoch_num": step / batches}
        t += interval_ms
        acc = 0.8028 if (converge is not None and k == evals) else 0.75 + 0.05 * k / (evals + 1)
        lines.append(_rec(t, "INTERVAL_END", "block_stop", samples_count=step * gbs))
        lines.append(_rec(t, "INTERVAL_START", "eval_start", **e))
        lines.append(_rec(t + 900, "POINT_IN_TIME", "eval_accuracy", acc, **e))
        lines.append(_rec(t + 900, "INTERVAL_END", "eval_stop", **e))
        if k < evals:
            lines.append(_rec(t + 901, "INTERVAL_START", "block_start", samples_count=step * gbs))
    status = "success" if converge is not None else "aborted"
    lines.append(_rec(t + 950, "INTERVAL_END", "run_stop", status=status, samples_count=evals * every * gbs))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    from mlperf_logging.rcp_checker import rcp_checker

    from timetotrain.mlperf.results import captured_logging

    org = tmp_path_factory.mktemp("v60dlrm") / ORG
    (org / "systems").mkdir(parents=True)
    for s, (system, (gbs, evals, *_)) in enumerate(CASES.items()):
        (org / "systems" / f"{system}.json").write_text(json.dumps(system_json(ORG, system), indent=4))
        folder = org / "results" / system / "dlrm_dcnv2"
        for i, conv in enumerate(evals):
            ref_log(
                folder / f"result_{i}.txt",
                system,
                500 + 10 * s + i,
                gbs,
                conv,
                T0 + s * 86_400_000 + i * 3_600_000,
            )
        with captured_logging():
            rcp_checker.check_directory(
                str(folder), "training", "6.0.0", False, False, rcp_pass="pruned_rcps", set_scaling=True
            )
    return org


def test_a_reference_tier_log_passes_the_closed_rules(tree, capsys):
    log = tree / "results" / "found_pass" / "dlrm_dcnv2" / "result_0.txt"
    assert ttt_main(["check", str(log)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "official" in out


@pytest.mark.slow  # 40 logs through the official checkers and the summarizer: ~50 s on 2 cores
def test_score_equals_the_official_result_summarizer(tree, tmp_path):
    assert_score_equals_summarizer(tree, "6.0.0", "dlrm_dcnv2", CASES, tmp_path)


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "setting,words",
    [
        ("target=0.8", "quality target is fixed"),
        ("global_batch_size=8192", "no reference convergence point"),
        ("warmup_steps=10", "no LR schedule"),
        ("eval_every_samples=1000000", "evaluation runs every"),
    ],
)
def test_closed_overrides_are_refused_before_init_start(tmp_path, capsys, setting, words):
    (tmp_path / "empty").mkdir()
    argv = ["run", "dlrm_dcnv2", "--tier", "reference", "--data", str(tmp_path / "empty"), "--logdir",
            str(tmp_path / "logs"), "--set", setting]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not list(tmp_path.rglob("result_*"))
