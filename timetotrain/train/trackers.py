"""Experiment trackers (`--tensorboard DIR`, `--wandb`) fed from the result log's own events.

A tracker listens to what `ResultLog` records, so it sees exactly the values of the MLPerf log: train_loss
(read by the loop one step late, already on the host), each eval value, and the model's telemetry at eval
points (MoE: expert load). The learning rate comes from the schedule function (a host float) and tokens/s
from the host clock. Nothing here touches a device tensor: a tracker adds no host sync to a step.

Both libraries are optional extras (`pip install timetotrain[tensorboard]`, `timetotrain[wandb]`); W&B runs
offline unless WANDB_MODE says otherwise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from timetotrain.errors import UserError
from timetotrain.mlperf.results import ROLLOUT_STATS_KEY


class Trackers:
    """The writers a run asked for, behind one `on_event` listener."""

    def __init__(self, tensorboard: Path | None, wandb: bool, name: str, config: dict, wandb_dir: Path):
        self.tb = None
        self.wb = None
        self.gbs = int(config.get("global_batch_size") or 1)
        self.items_per_sample = int(config.get("items_per_sample") or 1)
        self.item_name = str(config.get("item", "tokens"))
        self.lr_at: Callable[[int], float] | None = None  # step index -> lr (the schedule)
        self._t0: float | None = None
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: only --tensorboard
            except ImportError as e:
                raise UserError(
                    "--tensorboard needs the tensorboard package: pip install 'timetotrain[tensorboard]'"
                ) from e
            self.tb = SummaryWriter(log_dir=str(Path(tensorboard) / name))
        if wandb:
            try:
                import wandb as wandb_lib  # optional: only --wandb
            except ImportError as e:
                raise UserError("--wandb needs the wandb package: pip install 'timetotrain[wandb]'") from e
            wandb_dir.mkdir(parents=True, exist_ok=True)
            self.wb = wandb_lib.init(
                project=os.environ.get("WANDB_PROJECT", "timetotrain"),
                name=name,
                config=config,
                dir=str(wandb_dir),
                mode=os.environ.get("WANDB_MODE", "offline"),
            )

    @property
    def active(self) -> bool:
        return self.tb is not None or self.wb is not None

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log(values, step=step)

    def on_event(self, key: str, value, metadata: dict | None) -> None:
        md = metadata or {}
        if key == "run_start":
            self._t0 = time.monotonic()
        elif key == "train_loss":
            step = int(md.get("step_num", 0))
            values = {"train_loss": float(value)}
            if self.lr_at is not None and step > 0:
                values["lr"] = float(self.lr_at(step - 1))  # the step counted from 1 ran with lr(step - 1)
            if self._t0 is not None and "samples_count" in md:
                elapsed = max(time.monotonic() - self._t0, 1e-9)
                values[f"{self.item_name}_per_s"] = md["samples_count"] * self.items_per_sample / elapsed
            self.scalars(values, step)
        elif key == "eval_accuracy":
            self.scalars({"eval_accuracy": float(value)}, self._step_of(md))
        elif key == ROLLOUT_STATS_KEY and isinstance(value, dict):  # GRPO: reward, completion length, ...
            self.scalars({f"rollouts/{k}": float(v) for k, v in value.items()}, int(md.get("step_num", 0)))
        elif key == "ttt_expert_load" and isinstance(value, dict):
            self.scalars({f"expert_load/{k}": float(v) for k, v in value.items()}, self._step_of(md))
        elif key == "ttt_tokens_per_expert" and isinstance(value, list):
            totals = [float(sum(col)) for col in zip(*value, strict=True)]
            step = self._step_of(md)
            self.scalars({f"tokens_per_expert/{e}": v for e, v in enumerate(totals)}, step)
        elif key.startswith("ttt_synth_") and isinstance(value, int | float):
            self.scalars({"synth/" + key.removeprefix("ttt_synth_"): float(value)}, 0)

    def _step_of(self, md: dict) -> int:
        if "samples_count" in md:
            return int(md["samples_count"]) // self.gbs
        if "epoch_num" in md:
            return int(round(float(md["epoch_num"]) * 1000))  # epochs in thousandths: tasks counted in epochs
        return 0

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wb is not None:
            self.wb.finish()
            self.wb = None


def open_trackers(
    tensorboard: Path | None, wandb: bool, name: str, config: dict, wandb_dir: Path
) -> Trackers | None:
    if tensorboard is None and not wandb:
        return None
    return Trackers(tensorboard, wandb, name, config, wandb_dir)
