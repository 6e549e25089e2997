"""How many micro-batches this worker runs before it ends a round (the compute side's rule).

* ``fixed`` with ``global_micro_batches``: the step's global batch split over its rounds and the
  workers (acco_loco/batch.py), equally or by measured speed. The speeds travel in each
  round's small all-reduce, so every rank computes the same shares from the same rounds.
* ``fixed`` without it: ``micro_batches`` per worker and round.
* ``grow``: at least the pacer's minimum (engine/batch/pacing.py), then until the round in flight is
  done; the engine's loop decides the end, this only gives the minimum.

Under model_sharding="node" a node's G ranks run in lockstep (FSDP2's collectives in every
forward and backward), so they run the same number of micro-batches in every round: a round's
micro-batches are dealt to the nodes in units of G (one per rank), equally or by the node's
speed (its slowest rank's), and ``grow`` is refused (engine/config.py).
"""

from __future__ import annotations

from acco_loco.acco import RoundPlan
from acco_loco.batch import SpeedEstimate, equal_shares, round_targets

from .pacing import Pacer


class Accumulation:
    def __init__(self, cfg, plan: RoundPlan, rank: int, world: int, paced: bool, lockstep: int = 1):
        self.cfg, self.plan, self.rank, self.world = cfg, plan, rank, world
        self.lockstep = lockstep  # ranks that run the same micro-batches (a node's, under model sharding)
        self.grow = cfg.accumulation == "grow"
        self.pacer = Pacer(cfg.max_round_overhead if paced and self.grow else 0.0, cfg.micro_batches,
                           cfg.max_micro_batches)
        self.targets = None
        if cfg.global_micro_batches is not None:
            self.targets = round_targets(cfg.global_micro_batches, plan.rounds_per_step)
            check_global_batch(cfg.global_micro_batches, plan, world, lockstep)
        self.speeds = SpeedEstimate(world // lockstep) if cfg.balance == "speed" else None

    def shares(self, round_index: int) -> list[int] | None:
        """Every worker's micro-batches in that round under a global batch, else None."""
        if self.targets is None:
            return None
        g = self.lockstep
        units = self.targets[round_index % self.plan.rounds_per_step] // g
        if self.speeds is not None:
            per_group = self.speeds.shares(units, round_index)
        else:
            per_group = equal_shares(units, self.world // g, round_index)
        return [per_group[rank // g] for rank in range(self.world)]

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
            g = self.lockstep  # a node in lockstep goes at its slowest rank's pace
            self.speeds.update([max(micro_batch_s[i:i + g]) for i in range(0, len(micro_batch_s), g)])

    def state_dict(self) -> dict:
        return {"speeds": self.speeds.state_dict()} if self.speeds is not None else {}

    def load_state_dict(self, meta: dict) -> None:
        if self.speeds is not None and "speeds" in meta:
            self.speeds.load_state_dict(meta["speeds"])


def check_global_batch(global_micro_batches: int, plan: RoundPlan, world: int, lockstep: int = 1) -> None:
    """Every worker runs at least one micro-batch in every round (nobody idles); ranks in
    lockstep (a node's, under model sharding) get them in units of one each."""
    targets = round_targets(global_micro_batches, plan.rounds_per_step)
    split = (f"{plan.name} splits each step's batch over {plan.rounds_per_step} rounds, and "
             if plan.rounds_per_step > 1 else "")
    if lockstep > 1 and any(t % lockstep for t in targets):
        raise ValueError(f"global_micro_batches={global_micro_batches} does not suit model_sharding='node' with "
                         f"{lockstep} ranks per node: {split}a node's ranks run the same number of micro-batches "
                         f"(FSDP2 holds them in lockstep), so each round's micro-batches ({targets}) must be a "
                         f"multiple of {lockstep}; use a multiple of {lockstep * plan.rounds_per_step}")
    if min(targets) >= world:
        return
    need = plan.rounds_per_step * world
    raise ValueError(f"global_micro_batches={global_micro_batches} is too small for {world} workers: "
                     f"{split}every worker runs at least one micro-batch per round, so at least {need} "
                     f"are needed; raise global_micro_batches (or lower the micro-batch size to keep "
                     f"the samples per step)")
