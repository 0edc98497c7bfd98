"""``[run].time_budget_s``: a run whose lr schedule ends on the wall clock.

:class:`TimeBudget` starts its clock before the first training step of this process (a resumed run
gets a whole budget of its own), measures the step rate over a moving window once the first steps
are past (compilation and the first batches are slow), and after every step gives the schedule's
new end::

    total = min(run.steps, step + rate * (deadline - now))

so the cosine reaches ``[train].min_lr_ratio`` at the deadline. The budget covers training steps:
the final checkpoint (and a final evaluation) come after it. The clock is injectable so tests run
the estimate deterministically.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

__all__ = ["TimeBudget", "rate_warmup_steps"]

RATE_WINDOW = 50
"""Steps in the moving window the step rate is measured over."""


def rate_warmup_steps(max_steps: int) -> int:
    """Steps of this run not timed for the rate (compilation, first batches): 20, or a tenth of a
    run shorter than 200 steps (at least 1)."""
    return max(1, min(20, max_steps // 10))


class TimeBudget:
    """The schedule's end from the measured step rate and a deadline.

    Args:
        seconds: the budget, in seconds of wall clock from :meth:`start`.
        max_total: ``[run].steps``, the most the schedule's end may be (steps counted over the run).
        clock: seconds, monotonic (``time.monotonic``; a test passes a fake one).
        warmup_steps: steps after :meth:`start` that are not timed (:func:`rate_warmup_steps`).
        window: steps the rate is measured over (a moving window).
    """

    def __init__(self, seconds: float, max_total: int, *, clock: Callable[[], float] = time.monotonic,
                 warmup_steps: int | None = None, window: int = RATE_WINDOW) -> None:
        self.seconds, self.max_total, self.clock = seconds, max_total, clock
        self.warmup_steps = rate_warmup_steps(max_total) if warmup_steps is None else warmup_steps
        self.deadline: float | None = None
        self._now = 0.0  # the clock at the last start() or after_step()
        self.first_step = 0
        self.total = max_total
        self.rate: float | None = None  # steps per second, once measured
        self._marks: deque[tuple[int, float]] = deque(maxlen=window + 1)

    def start(self, step: int) -> None:
        """Start the clock; ``step`` is the steps already done (0, or the resumed step)."""
        self._now = self.clock()
        self.deadline = self._now + self.seconds
        self.first_step = step

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def after_step(self, step: int) -> int:
        """Record that ``step`` (counted over the run) is done; returns the schedule's end (steps),
        ``max_total`` until the rate is measured."""
        now = self.clock()
        if step - self.first_step >= self.warmup_steps:
            self._marks.append((step, now))
        if len(self._marks) >= 2:
            (s0, t0), (s1, t1) = self._marks[0], self._marks[-1]
            if t1 > t0:
                self.rate = (s1 - s0) / (t1 - t0)
        if self.rate is not None:
            left = max(self.deadline - now, 0.0)
            # float until the min: an infinite budget gives max_total, not an OverflowError
            self.total = max(step, int(min(self.max_total, step + self.rate * left)))
        self._now = now
        return self.total

    def elapsed(self) -> float:
        """Seconds from :meth:`start` to the last :meth:`after_step` (call :meth:`start` first)."""
        return self._now - (self.deadline - self.seconds)

    def expired(self, step: int) -> bool:
        """Whether training ends after ``step``: the deadline passed (as of the last
        :meth:`after_step`), or the schedule's end is reached (call :meth:`start` first)."""
        return self._now >= self.deadline or step >= self.total
