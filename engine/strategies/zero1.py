"""zero1: one commit round per step, nothing overlaps; the synchronous reference."""

from acco_loco.acco import RoundKind, RoundPlan

from .sharded import ShardedStrategy


class Zero1(ShardedStrategy):
    plan = RoundPlan("zero1", overlap=False, kinds=(RoundKind.COMMIT,))
