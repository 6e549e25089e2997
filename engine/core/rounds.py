"""What the compute side hands a strategy (RoundRequest), what it gets back (RoundResult), and
what every strategy's rounds work with (RoundContext). The rounds themselves live in
``engine/strategies/``; they run on the comm thread (CPU) or the comm stream (CUDA)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from acco_loco.acco import RoundKind
from acco_loco.optim import OptimizerSpec, ShardState

from ..parallel.comm import Comm
from .flat import FlatParams

if TYPE_CHECKING:  # the config imports the strategies' registry; a round needs only its fields
    from ..config import EngineConfig
    from ..parallel.dims import ParallelDims


class NonFiniteGradientError(FloatingPointError):
    """A NaN/Inf gradient reached a round and nan_policy is "stop"."""


@dataclass
class RoundRequest:
    index: int
    kind: RoundKind
    step_index: int  # 0-based committed step this round belongs to (drives the lr schedule)
    grad_index: int  # which flat gradient buffer holds this round's sum
    count: int  # this worker's micro-batches
    samples: int  # this worker's samples
    loss_sum: torch.Tensor  # sum of this worker's micro-batch losses (a 0-d tensor)
    exhausted: bool  # this worker's data ran out: everyone stops after this round
    first_of_step: bool = True  # the first round of an optimizer step (error state is marked)
    micro_batch_s: float = 0.0  # this worker's mean compute seconds per micro-batch (0: none run)


@dataclass
class RoundResult:
    index: int
    kind: RoundKind
    step_index: int
    local_count: int
    count: int  # global micro-batches behind the applied gradient (kept half included)
    samples: int
    loss: float  # mean micro-batch loss over that gradient
    lr: float
    grad_norm: float
    skipped: bool  # non-finite gradient: the shard was left unchanged
    empty: bool  # no micro-batch anywhere: nothing applied
    bad_ranks: list[int]
    exhausted_ranks: list[int]
    bytes_sent: int
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    skip_reason: str = ""  # why a skipped step was skipped, for the warning
    micro_batch_s: list[float] | None = None  # every rank's RoundRequest.micro_batch_s (all-reduced)


def squared_norm_f64(x: torch.Tensor) -> torch.Tensor:
    """sum(x**2) accumulated in float64 (for sums of squares that overflow fp32)."""
    return torch.linalg.vector_norm(x, dtype=torch.float64).square()


@dataclass
class Reduced:
    """What a gradient reducer computed: the fp32 sum over workers of this rank's shard, and
    whether the gradient it took held a NaN/Inf (a 0-d float64 device flag) when it looked on
    its way through it (None: it did not look; the round checks the gradient itself)."""

    sum: torch.Tensor
    input_nonfinite: torch.Tensor | None = None


class GradReducer(Protocol):
    """A worker's gradient sum -> the fp32 sum of its owned shard (engine/parallel/collectives.py,
    engine/parallel/two_level.py); it owns its error state (``feedback``) and that state's checkpoint."""

    feedback: Any

    def reduce(self, comm: Comm, full: torch.Tensor, count: int, out: torch.Tensor | None = None) -> Reduced: ...
    def begin_step(self) -> None: ...
    def end_step(self, committed_step: int, skipped: bool) -> None: ...
    def state_dict(self, mid_step: bool) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, tensors: dict[str, torch.Tensor], where: str) -> None: ...


class ParamGatherer(Protocol):
    """Each owner's new shard -> the full buffer every replica holds, piece by piece. ``push``
    reads values [a, b) of piece k from ``new_shard``, whose first value is the shard's ``start``
    (0: the whole shard; a piece's start: a piece-sized scratch holding at least [a, b)); the
    values must stay as they are until the push of piece k + 2 returns (or ``finish``)."""

    def begin(self, comm: Comm, held: torch.Tensor) -> list[tuple[int, int]]: ...
    def push(self, comm: Comm, k: int, new_shard: torch.Tensor, start: int = 0) -> None: ...
    def finish(self, comm: Comm, held: torch.Tensor) -> list[int]: ...
    def gather(self, comm: Comm, new_shard: torch.Tensor, held: torch.Tensor) -> list[int]: ...


@dataclass(frozen=True)
class RoundContext:
    """What a round works with, built once by the engine; no field is ever replaced (each object
    changes only through its owner: the shard state through its methods, the error state
    through the reducer). Strategies keep their own state on themselves."""

    cfg: EngineConfig
    comm: Comm
    flat: FlatParams
    spec: OptimizerSpec
    shard_state: ShardState  # this worker's fp32 master shard and optimizer moments
    grads: GradReducer
    params: ParamGatherer
    gather_buf: torch.Tensor  # the full parameters every replica holds after the last round
    dims: ParallelDims | None = None  # the layout and the engine's groups (None: a round built by hand)
