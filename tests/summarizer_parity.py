"""`ttt score` beside the official result_summarizer on one submission tree: what the reference-tier rules
tests (dlrm_dcnv2, dlrmv4) compare for the systems they write."""

import subprocess
import sys

import pytest
from conftest import require

from timetotrain.mlperf.score import score_tree


def system_json(org: str, name: str) -> dict:
    """A closed, on-premise system description the summarizer accepts."""
    return {
        "submitter": org, "division": "closed", "status": "Available on-premise", "system_name": name,
        "number_of_nodes": "1", "host_processor_model_name": "Example CPU", "host_processor_core_count": "64",
        "host_processors_per_node": "2", "accelerator_model_name": "Example GPU", "accelerators_per_node": "8",
        "framework": "PyTorch 2.13", "hw_notes": "", "sw_notes": "",
    }  # fmt: skip


def assert_score_equals_summarizer(org_dir, ruleset: str, bench: str, cases: dict, tmp_path) -> dict:
    """`cases`: system -> (GBS, ..., RCP verdict, the start of its message). Score, GBS, samples to converge,
    RCP verdict and scaling factor of every system equal the summarizer's; returns ours by system."""
    pd = require("pandas")
    ours = {s.system: s for s in score_tree(org_dir, ruleset)}
    assert sorted(ours) == sorted(cases)
    cmd = [sys.executable, "-m", "mlperf_logging.result_summarizer", str(org_dir), "training", ruleset, "--csv",
           str(tmp_path / "summary.csv")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "summary.csv").set_index("system")
    detailed = pd.read_csv(tmp_path / "summary_detailed.csv").set_index("system")
    for system, (gbs, *_, verdict, msg) in cases.items():
        s, row, det = ours[system], rows.loc[system], detailed.loc[system]
        assert s.score_minutes == pytest.approx(float(row[bench]), rel=1e-12)
        assert s.global_batch_size == det[f"{bench}:GBS"] == gbs
        assert s.samples_to_converge == pytest.approx(det[f"{bench}:samples_to_converge"], rel=1e-12)
        assert s.rcp.verdict == det[f"{bench}:RCP"] == verdict, (system, s.rcp.message)
        assert s.rcp.message.startswith(msg), s.rcp.message
        assert s.scaling_factor == pytest.approx(det[f"{bench}:rcp_scaling_factor"], rel=1e-12)
    return ours
