"""zero1: one commit round per step, nothing overlaps; the synchronous reference."""

from acco_loco.acco import RoundKind, RoundPlan

from .sharded import ShardedStrategy


class Zero1(ShardedStrategy):
    plan = RoundPlan("zero1", overlap=False, kinds=(RoundKind.COMMIT,))
    quality_proxy = ("acco", "loco4", "int4")  # the same codecs and error feedback, or a subset of them
