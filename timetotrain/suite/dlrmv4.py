"""dlrmv4: HSTU sequential recommendation on Yambda-5B, MLPerf Training 6.1 (ruleset 6.1.0;
docs/benchmarks/dlrmv4.md, which gives the source of every number here as file:line).

`reference` is the closed 6.1 configuration. Only the global batch size and the base LR are tunable
(closed_dlrmv4.yaml:14-18): a new GBS takes the LR of the reference's linear scaling law, 1e-6 x GBS / 8,192,
unless --set lr chooses another within 0.5-1.5 x of it (refused before the clock otherwise, in either
division: open_dlrmv4.yaml keeps the band), and the eval grid and the first eval follow the GBS as the rule
file computes them (tasks/seqrec_rules.py). Every other --set of a closed run is refused before the clock
by `mlperf.keys.check_rules` (the official rule file, or `closed_violation` for the target, the eval cadence
and the end LR).

`tiny` streams a synthetic Yambda (`ttt data synth-yambda --scale tiny`: 10 day windows of 256 users) in the
same strict time order through a small HSTU (2 STU layers of width 32, 11 tables of dim 32), with the exact
AUC over the whole held-out day; its target comes from its own RCP sweep (docs/benchmarks/dlrmv4.md, "Tiny
tier"). Model-parallel tables under --parallel are not built: the hstu tables are unpooled, and
train/embedding_parallel.py shards pooled bags only.
"""

from __future__ import annotations

from timetotrain.models.hstu import FAMILY, HSTUConfig
from timetotrain.spec.benchmark import Benchmark, EndLRRule, Optimizer, RcpHparams, Tier
from timetotrain.tasks.seqrec_rules import FirstEval, LRBand, eval_interval_steps
from timetotrain.tasks.sequential_recommendation import SequentialRecommendation, YambdaData

TRAIN_SAMPLES = 2_290_835_423  # closed_dlrmv4.yaml:10, :53
EVAL_SAMPLES = 2_058_204  # closed_dlrmv4.yaml:58: the whole held-out window
MAX_SEQ_LEN = 4096  # closed_dlrmv4.yaml:63
EVAL_EVERY_DATA_PCT = 0.001  # closed_dlrmv4.yaml:136
FIRST_EVAL = FirstEval(slope=4480, intercept=135_331_840, denominator=3)  # closed_dlrmv4.yaml:43
LR_BAND = LRBand(low=0.5e-6, high=1.5e-6, per_gbs=8192)  # closed_dlrmv4.yaml:47-48
WARMUP_STEPS = 24_000  # closed_dlrmv4.yaml:124, from 0 (:129)
TARGET = 0.75  # closed_dlrmv4.yaml:11, :146
REFERENCE_GBS = 8192  # the smallest RCP (rcps_dlrmv4.json:8), 8 ranks x BATCH_SIZE 1024 (yambda_5b.gin:4-6)


def scaling_lr(gbs: int) -> float:
    """The base LR of the reference's linear scaling law, the middle of the band (closed_dlrmv4.yaml:14-18);
    the RCPs ran at it (rcps_dlrmv4.json:10, :45, :80). The gin's 1e-6 (yambda_5b.gin:96-99), not the
    README's 1e-7 (README.MD:597), which the band refuses at GBS 8,192."""
    return 1e-6 * gbs / REFERENCE_GBS


def gbs_hparams(gbs: int) -> dict[str, object]:
    """What a new --set global_batch_size takes unless --set lr is given: the scaling law's LR. The end LR
    follows the base LR (`apply_overrides`): constant after the warmup."""
    return {"lr": scaling_lr(gbs)}


# The rules' dense optimizer (closed_dlrmv4.yaml:67-104): Adam (0.95, 0.999), eps 1e-8, no weight decay,
# global-norm clip 1.0 on the dense parameters. The embedding tables train with RowWiseAdagrad at the same
# LR and warmup (closed_dlrmv4.yaml:109-117; eps 1e-8, no weight decay: yambda_5b.gin:108-115), which the
# task logs; the clip leaves them out (yambda_5b.gin:117-122).
ROWWISE_ADAGRAD = Optimizer(name="adagrad", eps=1e-8, weight_decay=0.0, rowwise=True)
ADAM = Optimizer(
    name="adam", betas=(0.95, 0.999), eps=1e-8, weight_decay=0.0, clip=1.0, decay_mask="all",
    tables=ROWWISE_ADAGRAD,
)  # fmt: skip

_DATA = YambdaData(
    train_samples=TRAIN_SAMPLES,
    max_seq_len=MAX_SEQ_LEN,
    eval_every_data_pct=EVAL_EVERY_DATA_PCT,
    first_eval=FIRST_EVAL,
    lr_band=LR_BAND,
)

REFERENCE = Tier(
    name="reference",
    model=HSTUConfig(),  # the reference's DlrmHSTU on Yambda-5B (models/hstu/config.py)
    data=_DATA,
    global_batch_size=REFERENCE_GBS,
    micro_batch_size=1024,  # the reference's per-rank batch (yambda_5b.gin:4-6)
    lr=scaling_lr(REFERENCE_GBS),
    end_lr=scaling_lr(REFERENCE_GBS),
    warmup_steps=WARMUP_STEPS,
    max_steps=TRAIN_SAMPLES // REFERENCE_GBS,
    # 280 steps at 8,192 (2,293,760 samples); the task computes the grid at every GBS as the rules do, so this
    # is what `closed_violation` compares a --set eval_every_samples with.
    eval_every_samples=eval_interval_steps(_DATA, REFERENCE_GBS) * REFERENCE_GBS,
    eval_samples=EVAL_SAMPLES,
    target=TARGET,
    runs=10,  # benchmark_meta.py:29
    division="closed",
    description="MLPerf Training 6.1 closed configuration: HSTU 3 x 512 on Yambda-5B, 11 tables (293 M rows) x 512",
)

# Tiny: `ttt data synth-yambda --scale tiny` (seed 0): 10 day windows of 256 users, anchors with at least 10
# earlier events; windows 0-8 train (24,902 anchors), window 9 is held out (3,312). A small HSTU: 2 STU layers
# of width 32 (2 heads of 16), the 11 tables at dim 32 (the four id tables at the data's sizes, the seven
# crosses hashed into 16,384 rows each), a history of the last 10 of each pool, no dropout (a single short
# pass). The reference's optimizer pair and warmup form (from 0) over 20 steps; an eval every 5% of the pass.
_T_HISTORY = 30
_T_TABLES = (
    ("item_id", 2000), ("artist_id", 100), ("album_id", 400), ("uid", 256),
    *((name, 16_384) for name in (
        "user_x_artist", "user_x_album", "user_x_hour", "item_x_hour", "artist_x_hour", "user_x_is_organic",
        "user_x_artist_x_hour",
    )),
)  # fmt: skip
_T_MODEL = HSTUConfig(
    tables=_T_TABLES, table_dim=32, dim=32, heads=2, linear_dim=16, qk_dim=16, layers=2, preprocessor_hidden=32,
    max_seq_len=8 + _T_HISTORY + 1, mlp_hidden=32, position_buckets=256, time_buckets=128, input_dropout=0.0,
    linear_dropout=0.0,
)  # fmt: skip
_T_TRAIN, _T_EVAL, _T_GBS = 24_902, 3_312, 64
_T_DATA = YambdaData(
    train_samples=_T_TRAIN,
    max_seq_len=_T_MODEL.max_seq_len,
    eval_every_data_pct=0.05,
    history_length=_T_HISTORY,
    min_history=10,
    num_train_ts=9,
    eval_holdout_ts=9,
    eval_batch=1024,
    synth_scale="tiny",
)
_T_LR = 0.01

TINY = Tier(
    name="tiny",
    model=_T_MODEL,
    data=_T_DATA,
    global_batch_size=_T_GBS,
    micro_batch_size=_T_GBS,
    lr=_T_LR,
    end_lr=_T_LR,
    warmup_steps=20,
    max_steps=_T_TRAIN // _T_GBS,
    eval_every_samples=eval_interval_steps(_T_DATA, _T_GBS) * _T_GBS,
    eval_samples=_T_EVAL,
    target=0.60,
    runs=10,
    division="open",
    cpu_threads=1,
    description="synthetic Yambda, 256 users over 10 days; HSTU 2 x 32, 11 tables (<= 16,384 rows) x 32",
)

BENCHMARK = Benchmark(
    name="dlrmv4",
    area="Recommendation (sequential, generative)",
    task=SequentialRecommendation(),
    family=FAMILY,
    tiers={"reference": REFERENCE, "tiny": TINY},
    optimizer=ADAM,
    schedule="warmup_from_zero",  # base x step / 24,000, then base (train/schedule.py)
    closed_rules=("training_6.1.0/closed_common.yaml", "training_6.1.0/closed_dlrmv4.yaml"),
    ruleset="6.1.0",
    # rcps_dlrmv4.json: the scaling law's LR and the fixed warmup; the end LR follows the base LR (None).
    rcp_hparams={gbs: RcpHparams(scaling_lr(gbs), WARMUP_STEPS) for gbs in (8192, 16384, 32768)},
    gbs_hparams=gbs_hparams,
    end_lr_rule=EndLRRule(1.0),
)
