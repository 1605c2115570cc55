"""`ttt plan dlrm_dcnv2`: per-rank embedding, dense and optimizer memory for the placement `ttt run` builds."""

from timetotrain.cli import main
from timetotrain.spec import registry
from timetotrain.train.embedding_memory import GiB, per_rank


def test_reference_on_8_gpus_shards_the_tables():
    bench = registry.get("dlrm_dcnv2")
    tier = bench.tier("reference")
    doc = per_rank(bench, tier, 8, 80)
    ranks = doc["ranks"]
    assert sum(r["table_rows"] for r in ranks) == tier.model.rows == 204_184_588
    # Element-wise Adagrad (the reference's EXACT_ADAGRAD): its state is as large as the tables.
    assert all(r["embedding_optimizer"] == r["embedding_weights"] for r in ranks)
    assert sum(r["embedding_weights"] for r in ranks) == (tier.model.rows + 8) * 128 * 4
    assert all(r["dense_weights_grads_optimizer"] == 12 * 16_044_545 for r in ranks)
    assert doc["fits"] and max(r["total"] for r in ranks) < 0.9 * 80 * GiB
    one = per_rank(bench, tier, 1, 80)  # one GPU holds the whole 97 GiB of tables: does not fit
    assert not one["fits"] and one["ranks"][0]["embedding_weights"] > 97 * GiB


def test_the_command_prints_per_rank_memory(capsys):
    assert main(["plan", "dlrm_dcnv2", "--tier", "reference", "--gpus", "8", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert "emb weights" in out and "dense+opt" in out and "fits" in out and "--parallel dp=8" in out
    assert main(["plan", "dlrm_dcnv2", "--tier", "reference", "--gpus", "7", "--gpu-mem", "80"]) == 2
    assert "does not split over 7" in capsys.readouterr().err


def test_simulate_with_layers_is_refused_not_ignored(capsys):
    """The model is simulated whole (tests/test_simulate_tables.py); extrapolating over depth is refused."""
    argv = ["plan", "dlrm_dcnv2", "--tier", "reference", "--gpus", "8", "--gpu-mem", "80"]
    assert main([*argv, "--simulate", "--layers", "2"]) == 2
    err = capsys.readouterr().err
    assert "--layers 2: dlrm_dcnv2 is simulated at its full depth" in err and err.count("\n") == 1
