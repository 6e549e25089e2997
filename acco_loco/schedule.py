"""Learning-rate schedules as plain functions of the committed step.

The engine calls ``lr_at`` once per committed optimizer step with the index of that step
(0-based), so the schedule advances exactly once per commit whatever the strategy does between.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def validate_schedule(name: str, warmup_steps: int, min_lr_ratio: float) -> None:
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"unknown lr_schedule {name!r}: choose one of {SCHEDULES}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    # isfinite first: NaN passes no comparison, and a bool is not a ratio
    if (isinstance(min_lr_ratio, bool) or not isinstance(min_lr_ratio, (int, float))
            or not math.isfinite(min_lr_ratio) or not 0.0 <= min_lr_ratio <= 1.0):
        raise ValueError(f"min_lr_ratio must be a finite number in [0, 1], got {min_lr_ratio!r}")


def lr_at(step: int, base_lr: float, name: str = "constant", warmup_steps: int = 0,
          total_steps: int = 1, min_lr_ratio: float = 0.0) -> float:
    """Learning rate for committed step ``step`` (0-based).

    Warmup rises linearly from base_lr/(warmup+1) to base_lr; afterwards ``linear`` and
    ``cosine`` decay to ``min_lr_ratio * base_lr`` at ``total_steps``.
    """
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / (warmup_steps + 1)
    if name == "constant":
        return base_lr
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    floor = base_lr * min_lr_ratio
    if name == "linear":
        return floor + (base_lr - floor) * (1.0 - progress)
    if name == "cosine":
        return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_schedule {name!r}: choose one of {SCHEDULES}")
