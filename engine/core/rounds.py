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
    # the full parameters this round gathered, for the loop to install (None: ctx.gather_buf); a
    # view of the round's gradient buffer where the context keeps no buffer of its own
    gathered: torch.Tensor | None = None


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
    values must stay as they are until the push of piece k + 2 returns (or ``finish``).
    ``restorable``: the caller fills ``held`` again from the model before any later gather into
    it (a reduced gradient buffer, engine/strategies/sharded.py ``refresh_held``), so a gather
    whose ``finish`` reports non-finite shards may leave ``held`` part-updated: a delta gatherer
    then adds each piece as it arrives instead of keeping every piece's rows until the end."""

    def begin(self, comm: Comm, held: torch.Tensor, restorable: bool = False) -> list[tuple[int, int]]: ...
    def push(self, comm: Comm, k: int, new_shard: torch.Tensor, start: int = 0) -> None: ...
    def finish(self, comm: Comm, held: torch.Tensor) -> list[int]: ...
    def gather(self, comm: Comm, new_shard: torch.Tensor, held: torch.Tensor, restorable: bool = False) -> list[int]: ...


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
    # the full parameters every replica holds after the last round, in a buffer of their own; None:
    # each round gathers into the gradient buffer it has just reduced (``gather_target``)
    gather_buf: torch.Tensor | None
    dims: ParallelDims | None = None  # the layout and the engine's groups (None: a round built by hand)
    # Muon under model_sharding='node': the node's whole-matrix Newton-Schulz (engine/parallel/node_matrices.py)
    node_matrices: Any = None

    def gather_target(self, grad_index: int) -> torch.Tensor:
        """Where the round that reduces gradient buffer ``grad_index`` gathers the new parameters:
        ``gather_buf``, or that gradient buffer itself once the reducer has read it, seen as the
        compute dtype (its first bytes when the gradient dtype is wider: an fp32 buffer holds
        bf16 parameters in its first half)."""
        if self.gather_buf is not None:
            return self.gather_buf
        return compute_view(self.flat.grads[grad_index], self.flat.dtype)


def compute_view(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A whole padded gradient buffer's storage as ``grads.numel()`` values of ``dtype`` (no
    copy); ``dtype`` must be no wider than the buffer's."""
    if grads.dtype == dtype:
        return grads
    if dtype.itemsize > grads.dtype.itemsize:
        raise ValueError(f"a {grads.dtype} gradient buffer cannot hold {dtype} parameters: keep a gather buffer")
    return grads.view(torch.uint8)[:grads.numel() * dtype.itemsize].view(dtype)


def gather_buffer(flat: FlatParams, strategy) -> torch.Tensor | None:
    """The context's ``gather_buf`` for a run on ``flat``: None (its rounds gather into the
    gradient buffer each has just reduced: a sharded strategy's, docs/design/zero1.md) where the
    gradient dtype is at least as wide as the parameters'; else a copy of the parameters, the
    buffer every replica's values live in between rounds (also for a strategy whose parameters
    are its state there, ``gathered_is_state``, and for one whose rounds do not gather into a
    gradient buffer, ``gathers_into_gradients`` false: the local-step strategies)."""
    into_grads = getattr(strategy, "gathers_into_gradients", False) and not getattr(strategy, "gathered_is_state", False)
    if into_grads and flat.grads[0].dtype.itemsize >= flat.dtype.itemsize:
        return None
    return flat.read_into(torch.empty_like(flat.grads[0], dtype=flat.dtype))
