"""Clock: a run's wall-clock figures, time to the first optimizer step and throughput after it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Clock:
    """Wall-clock figures: time to the first optimizer step, and throughput after it."""

    launched: float = field(default_factory=time.time)
    first_step_s: float | None = None
    loop_start: float = 0.0
    last_tick: float = 0.0
    steps_timed: int = 0

    last_step_s: float = 0.0

    def tick(self, step_started: float) -> None:
        now = time.time()
        self.last_step_s = now - step_started
        self.last_tick = now
        if self.first_step_s is None:
            self.first_step_s = now - self.launched
            self.loop_start = now  # throughput excludes the first step (allocator and thread warm-up)
        else:
            self.steps_timed += 1

    def tokens_per_sec(self, tokens_per_step: int) -> float:
        """From the end of step 1 to the end of the newest step: after the loop, the last step's figure
        (what MLflow logged there), not diluted by the final evaluation and checkpoint."""
        span = self.last_tick - self.loop_start
        return self.steps_timed * tokens_per_step / max(1e-9, span) if self.steps_timed else 0.0

    def eta_s(self, steps_left: int) -> float:
        return steps_left * (time.time() - self.loop_start) / max(1, self.steps_timed)
