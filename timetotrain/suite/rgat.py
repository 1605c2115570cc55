"""rgat: R-GAT node classification on IGBH-full, MLPerf Training 5.1 (retired after 5.1; ruleset 5.1.0).
docs/benchmarks/rgat.md."""

from __future__ import annotations

from timetotrain.data.graph_synth import SCALES
from timetotrain.data.igbh import NODE_TYPES, RELATIONS
from timetotrain.models.rgat import FAMILY, RGATConfig
from timetotrain.spec.benchmark import Benchmark, Optimizer, RcpHparams, Tier
from timetotrain.tasks.node_classification import (
    GraphData,
    NodeClassification,
    batches_per_epoch,
    eval_interval,
)

# IGBH-full: the labeled papers and the reference split (split_seeds.py).
LABELED = 157_675_969
TRAIN_SEEDS = int(0.6 * LABELED)  # 94,605,581
VAL_SEEDS = int(0.005 * LABELED)  # 788,379

# GBS -> base LR of the 5.1.0 RCPs (rcps_rgat.json records no warmup: Adam at a constant LR).
RCP_HPARAMS = {
    4096: RcpHparams(1e-3, 0),
    16384: RcpHparams(2e-3, 0),
    32768: RcpHparams(2e-3, 0),
    65536: RcpHparams(3e-3, 0),
    262144: RcpHparams(5e-3, 0),
}


def _per_epoch(train_seeds: int, gbs: int, epochs: int) -> tuple[int, int]:
    """(max_steps for `epochs` epochs of whole batches, the seeds between evals within an epoch) at the
    reference's cadence (tasks/node_classification.py `eval_due`, which the loop follows)."""
    batches = batches_per_epoch(train_seeds, gbs)
    return epochs * batches, eval_interval(batches, GraphData.eval_fraction) * gbs


_REF_GBS = 4096  # 4 x the reference's 1,024 per GPU: the smallest GBS with an RCP
_ref_steps, _ref_every = _per_epoch(TRAIN_SEEDS, _REF_GBS, 2)

REFERENCE = Tier(
    name="reference",
    model=RGATConfig(relations=RELATIONS),
    data=GraphData(num_labeled=LABELED),
    global_batch_size=_REF_GBS,
    micro_batch_size=_REF_GBS,
    lr=1e-3,
    end_lr=1e-3,
    warmup_steps=0,
    max_steps=_ref_steps,
    eval_every_samples=_ref_every,
    eval_samples=VAL_SEEDS,
    target=0.72,
    runs=10,
    division="closed",
    description="IGBH-full, 3 x HeteroConv(GATConv 4 x 128) over 11 relations, fanouts 15/10/5, 2 epochs at most",
)

# Tiny: the generated graph at `tiny` scale (graph_synth.SCALES), the same model family at hidden 64 with
# two layers and fanouts 10/5: the synthetic graph's hubs (journals, fields of study) make a 3-hop
# neighbourhood of 256 seeds most of the graph, 5x the work per step for no change in what is learned.
# Validation is 5% of the labeled papers (1,500 seeds), as 0.5% (150) would make accuracy too noisy.
_T = SCALES["tiny"]
_T_LABELED = int(_T.labeled_fraction * _T.papers)
_T_GBS = 256
_t_steps, _t_every = _per_epoch(int(0.6 * _T_LABELED), _T_GBS, 4)

TINY = Tier(
    name="tiny",
    model=RGATConfig(relations=RELATIONS, in_dim=_T.dim, hidden=64, heads=4, n_layers=2, classes=_T.classes),
    data=GraphData(
        fanouts=(10, 5),
        val_fraction=0.05,
        eval_batch=512,
        num_nodes=tuple(
            zip(
                NODE_TYPES,
                (_T.papers, _T.authors, _T.institutes, _T.fos, _T.journals, _T.conferences),
                strict=True,
            )
        ),
        num_labeled=_T_LABELED,
        how_to_make="write it with `ttt data synth-graph --scale tiny --out DIR`",
    ),
    global_batch_size=_T_GBS,
    micro_batch_size=_T_GBS,
    lr=3e-3,
    end_lr=3e-3,
    warmup_steps=0,
    max_steps=_t_steps,
    eval_every_samples=_t_every,
    eval_samples=int(0.05 * _T_LABELED),
    target=0.93,
    runs=10,
    division="open",
    description="synthetic IGBH-like graph, 50k papers, 64-d, 20 classes; 2 x HeteroGAT(4 x 16), fanouts 10/5",
)

BENCHMARK = Benchmark(
    name="rgat",
    area="Graph neural network (node classification)",
    task=NodeClassification(),
    family=FAMILY,
    tiers={"reference": REFERENCE, "tiny": TINY},
    optimizer=Optimizer(
        name="adam", betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, clip=None, decay_mask="all"
    ),
    schedule="warmup_constant",
    closed_rules=("training_5.1.0/closed_common.yaml", "training_5.1.0/closed_rgat.yaml"),
    ruleset="5.1.0",
    rcp_hparams=RCP_HPARAMS,
)
