"""The steps `ttt run` (train/loop.py) and `ttt synth` (train/synth.py) share: opening what the command
writes (trackers, the result log, the live line), the init phase's first lines, the model build, and closing
what was opened. One copy, so that the two logs begin the same way and both commands end the same way."""

from __future__ import annotations

from dataclasses import dataclass

from timetotrain.mlperf.logger import ResultLog
from timetotrain.progress import LiveLine
from timetotrain.train import prepare
from timetotrain.train.prepare import Prepared
from timetotrain.train.step import Training
from timetotrain.train.trackers import Trackers, open_trackers


@dataclass
class Outputs:
    """What a command writes while it runs. On ranks other than global rank 0: a log bound to no file,
    no trackers, no live line."""

    log: ResultLog
    trackers: Trackers | None
    live: LiveLine | None

    def close(self) -> None:
        """The live line first (its last line stays above what follows), then the log (renamed from
        .partial, or removed when the clock never ran), then the trackers."""
        if self.live:
            self.live.close()
        self.log.close()
        if self.trackers is not None:
            self.trackers.close()


def open_outputs(prep: Prepared, prefix: str, mode: dict, item: tuple[str, int], opts) -> Outputs:
    """Trackers before the log: a missing tracker package stops the command before any result file exists.
    `prefix` names the tracker run, `mode` adds to its config, `item` is the task's (item name, items per
    sample); `opts` gives tensorboard, wandb, logdir and echo."""
    d, tier = prep.dist, prep.tier
    trackers = None
    if d.main:
        name = f"{prefix}{prep.bench.name}-{tier.name}-seed{prep.seed}"
        config = {"benchmark": prep.bench.name, "tier": tier.name, "seed": prep.seed, **mode,
                  "global_batch_size": tier.global_batch_size, "item": item[0], "items_per_sample": item[1]}  # fmt: skip
        trackers = open_trackers(opts.tensorboard, opts.wandb, name, config, opts.logdir / "wandb")
    log = ResultLog(prep.logdir if d.main else None, echo=opts.echo and d.main)
    if trackers is not None:
        log.listeners.append(trackers.on_event)
    return Outputs(log, trackers, LiveLine() if d.main else None)


def log_init(log: ResultLog, prep: Prepared, cache_clear: bool, org: str, platform: str | None, extra: dict):
    """`cache_clear`, `init_start`, then every key of the init block (prepare.log_init_keys)."""
    log.event("cache_clear", value=cache_clear)
    log.start("init_start")
    prepare.log_init_keys(log, prep, org, platform, extra)


def build(prep: Prepared, out: Outputs) -> Training:
    """The model, optimizer and schedule, inside init; loading starting weights is not timed, but reported."""
    tr = prepare.build(prep)
    if tr.load_seconds is not None:
        out.log.event("ttt_init_checkpoint_load_seconds", round(tr.load_seconds, 3))
        if out.live:
            out.live.print(f"loaded {prep.init_checkpoint} in {tr.load_seconds:.1f} s")
    return tr
