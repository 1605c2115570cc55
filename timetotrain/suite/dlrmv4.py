"""dlrmv4: HSTU sequential recommendation on Yambda-5B, MLPerf Training 6.1 (ruleset 6.1.0;
docs/benchmarks/dlrmv4.md, which gives the source of every number here as file:line).

`reference` is the closed 6.1 configuration. Only the global batch size and the base LR are tunable
(closed_dlrmv4.yaml:14-18): a new GBS takes the LR of the reference's linear scaling law, 1e-6 x GBS / 8,192,
unless --set lr chooses another within 0.5-1.5 x of it (refused before the clock otherwise, in either
division: open_dlrmv4.yaml keeps the band), and the eval grid and the first eval follow the GBS as the rule
file computes them (tasks/seqrec_rules.py). Every other --set of a closed run is refused before the clock
by `mlperf.keys.check_rules` (the official rule file, or `closed_violation` for the target, the eval cadence
and the end LR).

Rules only, so far: the HSTU model (models/hstu) and the Yambda reader (data/yambda*) are built elsewhere,
so this declaration holds no model config yet (`model` is None), its task and its family refuse everything
that needs data or a model in one line (`PENDING`), it has no tiny tier, and the registry does not list it.
The integration puts models.hstu's FAMILY and the reference HSTU config here in place of `_PENDING_FAMILY`
and None, the real task in place of `_RulesOnly`, and the line in spec/registry.py.
"""

from __future__ import annotations

from timetotrain.errors import UserError
from timetotrain.models.family import ModelFamily
from timetotrain.spec.benchmark import Benchmark, EndLRRule, Optimizer, RcpHparams, Tier
from timetotrain.tasks.seqrec_rules import FirstEval, LRBand, SeqRecData, SeqRecRules, eval_interval_steps

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
# LR (closed_dlrmv4.yaml:109-117; eps 1e-8, no weight decay: yambda_5b.gin:108-115), which the task logs.
ADAM = Optimizer(name="adam", betas=(0.95, 0.999), eps=1e-8, weight_decay=0.0, clip=1.0, decay_mask="all")

_DATA = SeqRecData(
    train_samples=TRAIN_SAMPLES,
    max_seq_len=MAX_SEQ_LEN,
    eval_every_data_pct=EVAL_EVERY_DATA_PCT,
    first_eval=FIRST_EVAL,
    lr_band=LR_BAND,
)

REFERENCE = Tier(
    name="reference",
    model=None,  # the integration: the reference HSTU config of models/hstu
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
    description="MLPerf Training 6.1 closed configuration: HSTU on Yambda-5B (rules only: model and data not built)",
)

PENDING = (
    "dlrmv4: only its rules are declared here; the HSTU model and the Yambda reader are not part of this "
    "build yet (issue 38)"
)


def _pending(*_args, **_kw):
    raise UserError(PENDING)


# Every hook refuses in one line: `ttt run` of this declaration (TTT_EXTRA_BENCHMARKS) stops in its preflight
# with PENDING, and `ttt check` of a dlrmv4 log then names it instead of failing on a missing family.
_PENDING_FAMILY = ModelFamily(
    name="hstu", build=_pending, init=_pending, param_count=_pending, active_param_count=_pending,
    flops_per_token=_pending, block_params=_pending, activation_elements=_pending,
)  # fmt: skip


class _RulesOnly(SeqRecRules):
    """The task's rule hooks; the hooks that need the data or the model refuse in one line, before any log
    line (resolve and synthetic run in the preflight)."""

    def resolve(self, tier, data_dir, verify=True, init_checkpoint=None):
        raise UserError(PENDING)

    def open(self, tier, resolved, seed, share, device):
        raise UserError(PENDING)

    def synthetic(self, tier, local_batch, generator, device):
        raise UserError(PENDING)

    def flops_per_sample(self, family, tier):
        raise UserError(PENDING)

    def sample_items(self, tier):
        raise UserError(PENDING)


BENCHMARK = Benchmark(
    name="dlrmv4",
    area="Recommendation (sequential, generative)",
    task=_RulesOnly(),
    family=_PENDING_FAMILY,  # the integration: models.hstu.FAMILY
    tiers={"reference": REFERENCE},
    optimizer=ADAM,
    schedule="warmup_from_zero",  # base x step / 24,000, then base (train/schedule.py)
    closed_rules=("training_6.1.0/closed_common.yaml", "training_6.1.0/closed_dlrmv4.yaml"),
    ruleset="6.1.0",
    # rcps_dlrmv4.json: the scaling law's LR and the fixed warmup; the end LR follows the base LR (None).
    rcp_hparams={gbs: RcpHparams(scaling_lr(gbs), WARMUP_STEPS) for gbs in (8192, 16384, 32768)},
    gbs_hparams=gbs_hparams,
    end_lr_rule=EndLRRule(1.0),
)
