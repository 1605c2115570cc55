"""What `ttt run` says on the terminal while it trains and when it stops (docs/terminal.md).

The live line answers "slow or stuck?": the step, the loss and throughput, the target in the benchmark's own
metric and direction, the next eval point, the best eval so far, and an ETA to that eval from this run's own
step times (a moving average of the host clock between the loss reads the loop makes anyway: no device
sync of its own, and no figure from another run). The loop builds the line only when the line is due.

The stop line is one line whatever ended the run: its status (success, aborted, fail, stopped by SIGTERM or
SIGINT, failed) and the result log's path.
"""

from __future__ import annotations

import collections
import signal
import time
from pathlib import Path

ETA_WINDOW = 20  # intervals in the moving average of the step time: recent enough to follow a slowdown


class StepTimes:
    """Seconds per step over the last ETA_WINDOW intervals between marks (host clock only)."""

    def __init__(self, window: int = ETA_WINDOW):
        self._spans: collections.deque[tuple[float, int]] = collections.deque(maxlen=window)
        self._last: tuple[float, int] | None = None

    def mark(self, step: int, now: float | None = None) -> None:
        """`step` steps have run by `now` (the loop's count of launched steps: the loss it reads one step
        late waits for the step before, so the spacing of marks is the step time)."""
        now = time.monotonic() if now is None else now
        if self._last is not None and step > self._last[1]:
            self._spans.append((now - self._last[0], step - self._last[1]))
        self._last = (now, step)

    def pause(self) -> None:
        """Something other than steps happens next (an eval): the next interval is not a step time."""
        self._last = None

    def per_step(self) -> float | None:
        if not self._spans:
            return None
        return sum(s for s, _ in self._spans) / sum(n for _, n in self._spans)


def short_metric(name: str) -> str:
    """The metric's own word: 'validation log-perplexity (mean cross-entropy)' -> 'log-perplexity'."""
    return name.split(" (")[0].removeprefix("validation ").split(" of ")[0]


def fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


class Progress:
    """The run's figures the live line shows besides the step's own: target, next eval, best, ETA."""

    def __init__(self, task, tier, stop_after: int):
        self.task, self.tier, self.stop_after = task, tier, stop_after
        self.metric = task.metric
        self.target = f"target {short_metric(self.metric.name)}{self.metric.comparison}{tier.target}"
        self.best: float | None = None
        self.times = StepTimes()
        self._next: tuple[int, int | None] = (-1, None)  # (from step, next eval step)
        self.samples_per_epoch: int | None = None  # known once the data is open (epoch-counted tasks)

    def evaluated(self, value: float) -> None:
        better = self.best is None or (
            value > self.best if self.metric.higher_is_better else value < self.best
        )
        if better and value == value:  # a NaN is never the best
            self.best = value
        self.times.pause()

    def next_eval(self, step: int) -> int | None:
        """The first step after `step` that evaluates, or None when the step limit comes first; found once
        per eval interval (the task's cadence can be any function of the step)."""
        start, found = self._next
        if start < 0 or step < start or (found is not None and step >= found):
            found = next(
                (s for s in range(step + 1, self.stop_after + 1) if self.task.eval_due(self.tier, s)), None
            )
            self._next = (step, found)
        return found

    def text(self, step: int) -> str:
        """'target ...  best ...  next eval step N (samples S) in ETA', and the step time the ETA is from."""
        nxt = self.next_eval(step)
        best = f"best {self.best:.4f}" if self.best is not None else "best -"
        if nxt is None:
            where, left = f"step limit {self.stop_after} (no eval before it)", self.stop_after - step
        else:
            where, left = f"next eval step {nxt} ({self._point(nxt)})", nxt - step
        per = self.times.per_step()
        eta = (
            ", ETA: no step timed yet" if per is None else f" in {fmt_seconds(left * per)} ({per:.3g} s/step)"
        )
        return f"{self.target}  {best}  {where}{eta}"

    def _point(self, step: int) -> str:
        samples = step * self.tier.global_batch_size
        if self.metric.unit == "epochs" and self.samples_per_epoch:
            return f"epoch {samples / self.samples_per_epoch:.2f}"
        return f"samples {samples:,}"


def status_word(status: str, sig: int | None) -> str:
    return f"stopped by {signal.Signals(sig).name}" if sig else status


def stop_line(status: str, reason: str, log: Path | None, figures: str = "") -> str:
    """The one line a stopped run prints: its status, why, what it did, and where its log is."""
    where = f"log {log}" if log is not None else "no result log (the clock never started)"
    more = f"; {figures}" if figures else ""
    return f"ttt run {status}: {reason}{more}; {where}"
