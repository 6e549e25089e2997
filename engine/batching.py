"""How many micro-batches this worker runs before it ends a round (the compute side's rule).

* ``fixed`` with ``global_micro_batches``: the step's global batch split over its rounds and the
  workers (acco_loco/batch.py), equally or by measured speed. The speeds travel in each
  round's small all-reduce, so every rank computes the same shares from the same rounds.
* ``fixed`` without it: ``micro_batches`` per worker and round.
* ``grow``: at least the pacer's minimum (engine/pacing.py), then until the round in flight is
  done; the engine's loop decides the end, this only gives the minimum.
"""

from __future__ import annotations

from acco_loco.acco import RoundPlan
from acco_loco.batch import SpeedEstimate, equal_shares, round_targets

from .pacing import Pacer


class Accumulation:
    def __init__(self, cfg, plan: RoundPlan, rank: int, world: int, paced: bool):
        self.cfg, self.plan, self.rank, self.world = cfg, plan, rank, world
        self.grow = cfg.accumulation == "grow"
        self.pacer = Pacer(cfg.max_round_overhead if paced and self.grow else 0.0, cfg.micro_batches,
                           cfg.max_micro_batches)
        self.targets = None
        if cfg.global_micro_batches is not None:
            self.targets = round_targets(cfg.global_micro_batches, plan.rounds_per_step)
            check_global_batch(cfg.global_micro_batches, plan, world)
        self.speeds = SpeedEstimate(world) if cfg.balance == "speed" else None

    def shares(self, round_index: int) -> list[int] | None:
        """Every worker's micro-batches in that round under a global batch, else None."""
        if self.targets is None:
            return None
        total = self.targets[round_index % self.plan.rounds_per_step]
        if self.speeds is not None:
            return self.speeds.shares(total, round_index)
        return equal_shares(total, self.world, round_index)

    def minimum(self, round_index: int) -> int:
        """This worker's micro-batches for that round (grow: the least it runs)."""
        shares = self.shares(round_index)
        if shares is not None:
            return shares[self.rank]
        return self.pacer.current if self.grow else self.cfg.micro_batches

    def on_round(self, micro_batch_s: list[float] | None, comm_cpu_s: float) -> None:
        """A finished round's measurements (the same on every rank for micro_batch_s)."""
        self.pacer.on_round(comm_cpu_s)
        if self.speeds is not None and micro_batch_s is not None:
            self.speeds.update(micro_batch_s)

    def state_dict(self) -> dict:
        return {"speeds": self.speeds.state_dict()} if self.speeds is not None else {}

    def load_state_dict(self, meta: dict) -> None:
        if self.speeds is not None and "speeds" in meta:
            self.speeds.load_state_dict(meta["speeds"])


def check_global_batch(global_micro_batches: int, plan: RoundPlan, world: int) -> None:
    """Every worker runs at least one micro-batch in every round (nobody idles)."""
    least = min(round_targets(global_micro_batches, plan.rounds_per_step))
    if least >= world:
        return
    need = plan.rounds_per_step * world
    split = (f"{plan.name} splits each step's batch over {plan.rounds_per_step} rounds, and "
             if plan.rounds_per_step > 1 else "")
    raise ValueError(f"global_micro_batches={global_micro_batches} is too small for {world} workers: "
                     f"{split}every worker runs at least one micro-batch per round, so at least {need} "
                     f"are needed; raise global_micro_batches (or lower the micro-batch size to keep "
                     f"the samples per step)")
