"""zero1: one commit round per step, nothing overlaps; the synchronous reference."""

from acco_loco.acco import PLANS

from .sharded import ShardedStrategy


class Zero1(ShardedStrategy):
    plan = PLANS["zero1"]
