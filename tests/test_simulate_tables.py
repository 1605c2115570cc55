"""`ttt plan --simulate` for the models with embedding tables (dlrmv4's HSTU, dlrm_dcnv2) against a real run.

The tiny tier on `dp=2` (each rank its table shards, all-to-all of the lookups, the dense part under DDP),
simulated (fake process group, fake tensors) and measured for real (2 gloo processes under torchrun, real
tensors) with the same tracker through the same build and step: parameter, optimizer and DDP bucket bytes
and the largest tensor of the build equal to the byte, the gradients too where the ids a shard receives are not data
(dlrm_dcnv2's whole tables), else within 1%. At dlrmv4's reference shape the build
allocates no whole table: the largest tensor of the simulated rank is its own shard.

Run as a script (by torchrun) this file is the worker: it writes its rank's measured bytes to a file."""

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import free_port
from forked import run_ranks

from timetotrain.cli import main
from timetotrain.train import prepare
from timetotrain.train.simulate import _in_child, simulate_rank

pytestmark = pytest.mark.distributed


def _measure_real(bench: str, out: Path) -> None:
    b, t = prepare.resolve_tier(bench, "tiny", [])
    rank = int(os.environ["RANK"])
    m = simulate_rank(b, t, 2, "dp=2", rank, "fp32", 0, fake=False)
    out.with_suffix(f".{rank}.json").write_text(json.dumps(dataclasses.asdict(m)))


@pytest.mark.slow
@pytest.mark.parametrize("bench", ["dlrmv4", "dlrm_dcnv2"])
def test_simulated_table_bytes_match_a_real_gloo_run(bench, tmp_path, capsys):
    out = tmp_path / "real"
    run_ranks(__file__, [bench, str(out)], 2, free_port())
    main(["plan", bench, "--tier", "tiny", "--gpus", "2", "--gpu-mem", "1", "--precision", "fp32", "--simulate",
          "--json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    sim = doc["simulation"]
    for rank in (0, 1):
        real = json.loads(out.with_suffix(f".{rank}.json").read_text())
        fake = sim["ranks"][str(rank)]
        for key in ("parameters", "optimizer", "buckets", "largest"):
            assert fake[key] == real[key] > 0, (rank, key, fake[key], real[key])
        # A shard's sparse gradient holds a row per id that lands in it: on dlrmv4's row-wise shards that is
        # data (rank 0 of the tiny tier gets 3,208 of the 3,232 ids an even split gives), on dlrm_dcnv2's
        # whole tables every id of them (equal).
        tolerance = 0.01 if bench == "dlrmv4" else 0
        assert abs(fake["gradients"] - real["gradients"]) <= tolerance * real["gradients"], (rank, fake, real)
        for phase in ("forward", "backward"):
            f, r = sum(fake["phases"][phase].values()), sum(real["phases"][phase].values())
            assert abs(f - r) <= 0.10 * r, (rank, phase, f, r)
        assert sim["counted_bytes"][str(rank)] == doc["ranks"][rank]["total"]


@pytest.mark.slow
def test_the_reference_build_allocates_no_whole_table():
    """dlrmv4 reference on 512 ranks: the 293 M x 512 rows are cut before they are allocated, so the
    largest tensor the last rank's build allocates (its tables and their init, the warm-up) is its own shard
    of the tables (1/512 of every table, 1.2 GB), not a table (the largest: 100 M rows, 205 GB)."""
    b, t = prepare.resolve_tier("dlrmv4", "reference", [])
    world = 512
    m = _in_child(simulate_rank, b, t, world, f"dp={world}", world - 1, "bf16", 0)
    rows, dim = sum(t.model.table_sizes), t.model.table_dim
    shard = (rows // world + len(t.model.table_sizes)) * dim * 4  # each table cut on its own: a row more each
    assert m.largest <= shard < min(t.model.table_sizes) * dim * 4, (m.largest_shape, m.largest, shard)
    assert m.parameters >= m.largest and m.gradients > 0 and m.optimizer > 0


if __name__ == "__main__":
    _measure_real(sys.argv[1], Path(sys.argv[2]))
