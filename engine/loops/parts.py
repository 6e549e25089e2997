"""The parts a compute loop works with, each owning its own state; the engine builds them once
and a strategy's ``make_loop`` builds its loop from them (no loop sees the Engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the types only: the runtime imports stay where they are used
    from acco_loco.acco import RoundPlan

    from ..batch.accumulation import Accumulation
    from ..checkpoint.periodic import PeriodicSaver
    from ..config import EngineConfig
    from ..core.counters import EngineState
    from ..core.flat import FlatParams
    from ..core.rounds import RoundContext
    from ..core.run import RunState
    from ..runtime.streams import CommWorker
    from ..runtime.watchdog import Watchdog
    from ..strategies.base import Strategy


@dataclass(frozen=True)
class LoopParts:
    cfg: EngineConfig
    ctx: RoundContext  # comm, the flat buffers, the shard and its moments, reducer and gatherer
    strategy: Strategy  # what a round does (run on the comm side) and what it keeps between rounds
    worker: CommWorker  # the comm thread (and CUDA stream) rounds run on
    accumulation: Accumulation  # how many micro-batches end a round
    state: EngineState  # step, round index, the pending accumulator: saved by a checkpoint
    run: RunState  # history, round counts, timeline, comm CPU, the loop's end
    saver: PeriodicSaver  # periodic checkpoints and the one being written
    watchdog: Watchdog  # heartbeats; names a lost peer
    device: torch.device

    @property
    def plan(self) -> RoundPlan:
        return self.strategy.plan

    @property
    def flat(self) -> FlatParams:
        return self.ctx.flat

    @property
    def rank(self) -> int:
        return self.ctx.comm.rank

    @property
    def world_size(self) -> int:
        return self.ctx.comm.world_size
