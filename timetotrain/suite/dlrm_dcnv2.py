"""dlrm_dcnv2: DLRM with a DCNv2 cross network on the MLPerf multi-hot Criteo 1TB, MLPerf Training 6.0.
docs/benchmarks/dlrm_dcnv2.md."""

from __future__ import annotations

from timetotrain.data import criteo, criteo_synth
from timetotrain.models.dlrm_dcnv2 import FAMILY, DLRMConfig
from timetotrain.spec.benchmark import Benchmark, Optimizer, RcpHparams, Tier
from timetotrain.tasks.click_through_rate import ClickThroughRate, CTRData

# Days 0..22 and the validation half of day 23 (closed_dlrm_dcnv2.yaml: eval_samples == 89,137,319).
TRAIN_ROWS = criteo_synth.FULL_TRAIN
VAL_ROWS = criteo.val_rows(criteo_synth.FULL_LAST_DAY)

# GBS -> base LR of the 6.0.0 RCPs (rcps_dlrm_dcnv2.json: Adagrad at a constant LR, no warmup or decay).
RCP_HPARAMS = {
    32768: RcpHparams(0.004, 0),
    55296: RcpHparams(0.004, 0),
    65536: RcpHparams(0.004, 0),
    102400: RcpHparams(0.004, 0),
    135168: RcpHparams(0.0034, 0),
    160000: RcpHparams(0.004, 0),
}


def _tier_steps(train_rows: int, gbs: int) -> tuple[int, int]:
    """(one epoch of whole batches, the samples between evals at the reference's cadence)."""
    return criteo.batches(train_rows, gbs), criteo.eval_every(train_rows, gbs) * gbs


_REF_GBS = 65536  # the README's 8-GPU run (GLOBAL_BATCH_SIZE=65536), with its RCP's LR 0.004
_ref_steps, _ref_every = _tier_steps(TRAIN_ROWS, _REF_GBS)

REFERENCE = Tier(
    name="reference",
    model=DLRMConfig(),
    data=CTRData(train_rows=TRAIN_ROWS, val_rows=VAL_ROWS),
    global_batch_size=_REF_GBS,
    micro_batch_size=_REF_GBS,
    lr=0.004,
    end_lr=0.004,
    warmup_steps=0,
    max_steps=_ref_steps,
    eval_every_samples=_ref_every,
    eval_samples=VAL_ROWS,
    target=0.80275,
    runs=10,
    division="closed",
    description="Criteo 1TB multi-hot, 26 tables (204M rows) x 128, DCNv2 3 x rank 512, one epoch at most",
)

# Tiny: the generated dataset at `tiny` scale (criteo_synth.SCALES: tables capped at 2,000 rows, 23 days of
# 8,192 rows, 16,384 validation rows, the reference's multi-hot sizes), the same architecture narrowed to
# 16-d embeddings and proportionally smaller MLPs and cross net.
_T = criteo_synth.SCALES["tiny"]
_T_TRAIN = sum(_T.train_day_rows)
_T_GBS = 512
_t_steps, _t_every = _tier_steps(_T_TRAIN, _T_GBS)

TINY = Tier(
    name="tiny",
    model=DLRMConfig(
        table_sizes=_T.table_sizes,
        multi_hot=_T.multi_hot,
        dim=16,
        bottom=(64, 32, 16),
        top=(128, 128, 64, 32, 1),
        dcn_layers=3,
        dcn_rank=32,
    ),  # fmt: skip
    data=CTRData(
        train_rows=_T_TRAIN, val_rows=criteo.val_rows(_T.last_day_rows), eval_batch=8192, synth_scale="tiny"
    ),
    global_batch_size=_T_GBS,
    micro_batch_size=_T_GBS,
    lr=0.02,
    end_lr=0.02,
    warmup_steps=0,
    max_steps=_t_steps,
    eval_every_samples=_t_every,
    eval_samples=criteo.val_rows(_T.last_day_rows),
    target=0.70,
    runs=10,
    division="open",
    description="synthetic multi-hot Criteo, 26 tables capped at 2,000 rows x 16, DCNv2 3 x rank 32",
)

BENCHMARK = Benchmark(
    name="dlrm_dcnv2",
    area="Recommendation (click-through rate)",
    task=ClickThroughRate(),
    family=FAMILY,
    tiers={"reference": REFERENCE, "tiny": TINY},
    optimizer=Optimizer(name="adagrad", eps=1e-8, weight_decay=0.0, clip=None, decay_mask="all"),
    schedule="warmup_constant",
    closed_rules=("training_6.0.0/closed_common.yaml", "training_6.0.0/closed_dlrm_dcnv2.yaml"),
    ruleset="6.0.0",
    rcp_hparams=RCP_HPARAMS,
)
