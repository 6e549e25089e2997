"""The round schedules of the data-parallel strategies, as data.

A *round* is one trip through the communication side: reduce the gradients accumulated by the
compute side, run an optimizer step on the owned shard, gather the new parameters. While a round
is in flight the compute side accumulates the next gradients (when the plan overlaps).

zero1  one commit round per step, nothing overlaps (the reference).
dpu    one commit round per step, overlapped: the gradient applied to theta_t was computed on
       theta_{t-1} (delayed parameter update, one step stale, no correction).
acco   two rounds per step, both starting from the committed theta_t (Nabli et al., ACCO,
       arXiv 2406.02613):
         estimate: thetatilde_{t+1} = Opt(theta_t, gtilde_t / ctilde)   (state not written)
         commit:   theta_{t+1}      = Opt(theta_t, (gtilde_t + g_t) / (ctilde + c))
       gtilde_t was accumulated on thetatilde_t, g_t on theta_t. Each half is sent once: the
       owner keeps the reduced gtilde shard (fp32) from the estimate round and adds g_t's
       reduced shard in the commit round.

Counts: every round all-reduces the micro-batch counts; a worker's weight in the average is its
number of micro-batches, so fast workers that accumulate more count more.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class RoundKind(str, Enum):
    COMMIT = "commit"  # writes optimizer state, produces theta_{t+1}
    ESTIMATE = "estimate"  # functional step, produces thetatilde_{t+1}


@dataclass(frozen=True)
class RoundPlan:
    name: str
    overlap: bool  # compute runs while a round is in flight
    kinds: tuple[RoundKind, ...]  # the rounds of one optimizer step, in order
    local_steps: int = 0  # optimizer steps each worker takes alone between rounds (DiLoCo's H)

    def kind(self, round_index: int) -> RoundKind:
        return self.kinds[round_index % len(self.kinds)]

    @property
    def rounds_per_step(self) -> int:
        return len(self.kinds)


@dataclass
class KeptHalf:
    """The reduced estimate-round gradient an owner keeps for the commit round (ACCO)."""

    grad_sum: torch.Tensor  # fp32 sum over workers of the gtilde shard
    count: int  # global micro-batches behind it
    loss_sum: float
    samples: int = 0
    skipped: bool = False  # the estimate half was non-finite: the whole step is skipped
    bad_ranks: tuple[int, ...] = ()  # the ranks it came from, for the warning


def step_gradient(kind: RoundKind, grad_sum: torch.Tensor, kept: KeptHalf | None) -> torch.Tensor:
    """Gradient sum a round's optimizer step uses (its count adds ``kept.count`` likewise).

    An ACCO commit adds the kept estimate half, into ``grad_sum`` itself (the round's own
    buffer, not needed apart afterwards) when the dtypes agree; every other round uses its own
    sum alone.
    """
    if kind is RoundKind.COMMIT and kept is not None:
        if grad_sum.dtype == kept.grad_sum.dtype:
            return grad_sum.add_(kept.grad_sum)
        return grad_sum + kept.grad_sum
    return grad_sum
