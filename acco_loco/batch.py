"""The user's global batch, split over a step's rounds and over the workers (pure arithmetic).

A step's global batch is G micro-batches summed over every worker and every round of the step.
A strategy with R rounds per step gives round r of the step

    G_r = floor(G / R) + (1 if r >= R - G mod R else 0)

(ACCO, R = 2: the estimate round floor(G/2), the commit round the rest). Each round's G_r is
shared out over the W workers, at least one micro-batch each:

* ``equal``: floor(G_r / W) each, the remainder to consecutive ranks starting at
  ``round_index mod W``, so over W rounds every rank takes the same extra.
* ``speed``: proportional to each worker's speed 1 / t_w (t_w its smoothed seconds per
  micro-batch), by largest remainders (Hamilton's method) with at least one each; ties go to
  the lower rank.

Either way the shares sum to G_r exactly, so the step's batch is G whatever the speeds. The
gradient applied is still the count-weighted mean (acco_loco/acco.py), so moving micro-batches
between workers does not change what is averaged, only who computes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def round_targets(global_micro_batches: int, rounds_per_step: int) -> tuple[int, ...]:
    """G_r for each round of a step (the later rounds take the remainder)."""
    base, extra = divmod(global_micro_batches, rounds_per_step)
    return tuple(base + (1 if r >= rounds_per_step - extra else 0) for r in range(rounds_per_step))


def equal_shares(total: int, world: int, round_index: int) -> list[int]:
    """``total`` micro-batches over ``world`` workers, the remainder rotating with the round."""
    base, extra = divmod(total, world)
    first = round_index % world
    return [base + (1 if (rank - first) % world < extra else 0) for rank in range(world)]


def speed_shares(total: int, seconds_per_micro_batch: list[float]) -> list[int]:
    """``total`` micro-batches in proportion to 1 / t, at least one each (needs total >= len(t))."""
    world = len(seconds_per_micro_batch)
    if total < world:
        raise ValueError(f"{total} micro-batches cannot give each of {world} workers one")
    speeds = [1.0 / t for t in seconds_per_micro_batch]
    quotas = [total * s / sum(speeds) for s in speeds]
    shares = [max(1, math.floor(q)) for q in quotas]
    while sum(shares) > total:  # the floor of one took too much: from the most over its quota
        w = max((w for w in range(world) if shares[w] > 1), key=lambda w: (shares[w] - quotas[w], -w))
        shares[w] -= 1
    while sum(shares) < total:  # largest remainders first, ties to the lower rank
        w = max(range(world), key=lambda w: (quotas[w] - shares[w], -w))
        shares[w] += 1
    return shares


@dataclass
class SpeedEstimate:
    """Every worker's seconds per micro-batch, smoothed over rounds (an exponential moving
    average with weight ``alpha`` on the newest round). Every rank feeds it the same all-reduced
    measurements in the same order, so every rank holds the same estimate."""

    world: int
    alpha: float = 0.5
    seconds: list[float] | None = field(default=None)  # None until every worker was measured

    def update(self, measured: list[float]) -> None:
        """One round's measurements; a worker that ran no micro-batch reports 0 (kept as before)."""
        if len(measured) != self.world:
            raise ValueError(f"expected {self.world} measurements, got {len(measured)}")
        if self.seconds is None:
            if all(t > 0 and math.isfinite(t) for t in measured):
                self.seconds = list(measured)
            return
        self.seconds = [old if not (t > 0 and math.isfinite(t)) else (1 - self.alpha) * old + self.alpha * t
                        for old, t in zip(self.seconds, measured)]

    def shares(self, total: int, round_index: int) -> list[int]:
        """Speed shares once every worker has been measured; equal shares until then."""
        if self.seconds is None:
            return equal_shares(total, self.world, round_index)
        return speed_shares(total, self.seconds)

    def state_dict(self) -> dict:
        return {"seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.seconds = None if state.get("seconds") is None else [float(t) for t in state["seconds"]]
