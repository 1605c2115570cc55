"""What every tiny tier must show before its target means anything: the model a run starts from (random
init, or the base a fine-tuning/continuing tier loads) evaluates worse than the target by a stated margin,
and the first evaluation comes after real training (at least one step, with a learning rate above zero).

The margin: 5% of the target's value. A base that lands within that of the target meets it on another host's
rounding or another seed (the audit's LoRA base on an AMD EPYC host scored 5.2282 against 5.278, 1% under),
so such a tier measures nothing. Derived from each tier's own target, so it tightens or loosens with it."""

from timetotrain.train import schedule

MARGIN = 0.05


def assert_misses_target(bench, tier, untrained: float) -> None:
    """`untrained` (the eval metric of the starting model) is worse than the tier's target by the margin."""
    margin = MARGIN * abs(tier.target)
    if bench.task.metric.higher_is_better:
        assert untrained < tier.target - margin, (untrained, tier.target, margin)
    else:
        assert untrained > tier.target + margin, (untrained, tier.target, margin)


def assert_first_eval_after_training(bench, tier) -> None:
    """The first evaluation comes after at least one step, and some step before it has a non-zero LR."""
    first = bench.task.first_eval_step(tier)
    assert first >= 1
    lr = schedule.for_tier(bench.schedule, tier)
    assert max(lr(step) for step in range(first)) > 0, (first, tier.lr)
