"""How many micro-batches a round needs at least, from what the last rounds cost.

A round costs the comm side a fixed amount of CPU (encode, decode, the optimizer step on the
shard, the collectives' copies) whatever its micro-batch count. On CPU that work shares the cores
the compute side uses, so a round of m micro-batches of t seconds each keeps at most
``m t / (m t + c)`` of the compute-only throughput, where c is the comm side's CPU seconds per
round. With ``max_round_overhead = f`` the engine keeps ``c <= f m t``:

    m_min = clamp(ceil(c / (f t)), micro_batches, max_micro_batches)

c and t are medians over the last rounds and micro-batches (the first round, which warms the
allocator up, is left out). On a fast link this is what sets the round length: the transfer
ends before one micro-batch does, and without the floor every round would pay c for one
micro-batch. On a slow link the adaptive rule (accumulate until the round in flight is done)
already asks for more, and the floor does not bind.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


def min_micro_batches(comm_cpu_s: float, micro_batch_s: float, max_overhead: float, floor: int,
                      cap: int | None) -> int:
    """The rule above; ``floor`` when it is off (``max_overhead <= 0``) or nothing is measured."""
    if max_overhead <= 0 or comm_cpu_s <= 0 or micro_batch_s <= 0:
        return floor
    m = max(floor, math.ceil(comm_cpu_s / (max_overhead * micro_batch_s) - 1e-9))
    return m if cap is None else min(m, cap)


class Pacer:
    """Keeps the recent measurements and the current minimum."""

    def __init__(self, max_overhead: float, floor: int, cap: int | None, window: int = 8):
        self.max_overhead, self.floor, self.cap = max_overhead, floor, cap
        self.comm_cpu = deque(maxlen=window)
        self.micro_batch = deque(maxlen=2 * window)
        self.rounds_seen = 0
        self.current = floor

    def on_micro_batch(self, seconds: float) -> None:
        if self.max_overhead > 0:
            self.micro_batch.append(seconds)

    def on_round(self, comm_cpu_s: float) -> int:
        if self.max_overhead <= 0:  # off: the floor never moves
            return self.current
        self.rounds_seen += 1
        if self.rounds_seen > 1:  # the first round pays for first-touch allocations
            self.comm_cpu.append(comm_cpu_s)
        if self.comm_cpu and self.micro_batch:
            self.current = min_micro_batches(statistics.median(self.comm_cpu), statistics.median(self.micro_batch),
                                             self.max_overhead, self.floor, self.cap)
        return self.current
