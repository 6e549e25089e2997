"""The tallies of a local-step strategy (engine/strategies/local_steps.py): a worker's period,
one inner step, and what the outer round's small all-reduce tells every rank."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PeriodTotals:
    """This worker's work since the last outer round was submitted."""

    micro_batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0

    def as_list(self) -> list:
        return [self.micro_batches, self.samples, self.loss_sum]


@dataclass
class InnerStep:
    """What one inner step did, for the history."""

    lr: float
    grad_norm: float
    loss: float
    skipped: bool


@dataclass
class OuterTotals:
    """What the outer round's small all-reduce tells every rank."""

    count: int  # micro-batches of the period, all workers
    samples: int
    loss_sum: float
    shares: list[float]  # a_w = n_w / sum n: each worker's share of the period's samples
    exhausted_ranks: list[int]
    bad_ranks: list[int]  # their pseudo-gradient was not finite
    done_ranks: list[int]  # they reached their step budget (outer_period_s)
    rank_samples: list[int] = field(default_factory=list)  # every rank's samples in the period
