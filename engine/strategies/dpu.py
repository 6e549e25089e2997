"""dpu: delayed parameter update. One commit round per step, overlapped with the next step's
compute, so the gradient applied to theta_t was computed on theta_{t-1} (one step stale)."""

from acco_loco.acco import RoundKind, RoundPlan

from .sharded import ShardedStrategy


class DelayedUpdate(ShardedStrategy):
    plan = RoundPlan("dpu", overlap=True, kinds=(RoundKind.COMMIT,))
