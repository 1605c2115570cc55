"""`ttt plan --simulate` for the models with embedding tables (dlrmv4's HSTU, dlrm_dcnv2) against a real run.

The tiny tier on `dp=2` (each rank its table shards, all-to-all of the lookups, the dense part under DDP),
simulated (fake process group, fake tensors) and measured for real (2 gloo processes under torchrun, real
tensors) with the same tracker through the same build and step: parameter, optimizer and DDP bucket bytes
and the largest tensor of the build equal to the byte, the gradients too where the ids a shard receives are
not data (dlrm_dcnv2's whole tables), else within 1%; the forward and backward peaks within 10%. At the
reference shapes no rank's build allocates a whole table: its largest tensor is its own shard.

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
from timetotrain.train.embedding_parallel import UNPOOLED_SPLIT_ROWS, place, rank_rows
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
@pytest.mark.parametrize("bench,world,rank", [("dlrmv4", 512, 511), ("dlrm_dcnv2", 8, 0)])
def test_the_reference_build_allocates_no_whole_table(bench, world, rank):
    """The tables are cut before they are allocated (`parallel.shard_tables_before_fill`), so the largest
    tensor a rank's build allocates (its tables and their init, the warm-up) is its own shard: dlrmv4's last
    rank of 512, 1/512 of every table (1.1 GiB, the 293 M x 512 rows are 559 GiB), dlrm_dcnv2's rank 0 of 8,
    the most loaded (25.5 M of the 204 M rows: 12 GiB, where the build used to hold all 97 GiB)."""
    b, t = prepare.resolve_tier(bench, "reference", [])
    tables = b.family.embedding_tables(t.model)
    m = _in_child(simulate_rank, b, t, world, f"dp={world}", rank, "bf16", 0)
    shards = place(tables.sizes, world, None if tables.pooled else UNPOOLED_SPLIT_ROWS)
    shard = (rank_rows(shards, world)[rank] + 1) * tables.dim * 4  # DLRM's padding row
    assert m.largest <= shard < sum(tables.sizes) * tables.dim * 4 / 4, (m.largest_shape, m.largest, shard)
    assert m.parameters >= m.largest and m.gradients > 0 and m.optimizer > 0


if __name__ == "__main__":
    _measure_real(sys.argv[1], Path(sys.argv[2]))
