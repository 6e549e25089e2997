"""The loop of the local-step strategies (diloco, sparseloco; docs/local_steps.md).

Every round boundary is one inner optimizer step of this worker alone, and an outer round is
submitted only when the strategy says one is due. ``max_steps`` and the history count inner
steps; an entry lists the outer rounds that finished since the previous one (``outer``).
"""

from __future__ import annotations

import logging

import torch

from acco_loco.acco import RoundKind

from ..core.rounds import RoundRequest
from ..runtime.streams import RoundHandle
from .base import RoundLoop
from .parts import LoopParts

log = logging.getLogger("acco_loco")


class LocalStepsLoop(RoundLoop):
    def __init__(self, parts: LoopParts):
        super().__init__(parts)
        self.outer_done: list[dict] = []  # outer rounds finished since the last history entry

    def boundary(self, exhausted: bool) -> bool:
        """The micro-batches just run make one inner step of this worker alone; an outer round
        follows when it is due, or when this worker's data ran out."""
        p = self.parts
        exhausted = p.strategy.agree_exhausted(exhausted)  # a node replica stops together
        fields = None if exhausted else self.inner_step()
        stopping = p.run.at_end(p.state.step)
        stop = stopping
        if exhausted or p.strategy.round_due(p.state.step, stopping):
            stop = self.outer_round(exhausted, wait=stopping or exhausted) or stop
        elif stopping:
            stop = self.drain() or stop  # fit() returns with no round in flight
        if fields is not None:
            outer, self.outer_done = self.outer_done, []
            stop = self.record(**fields, outer=outer) or stop
        return stop

    def inner_step(self) -> dict:
        """Apply this worker's inner step (no communication); the fields of its history entry,
        recorded after the outer round it may start. Loss, samples and micro-batches are this
        worker's own."""
        p = self.parts
        st, flat = p.state, p.flat
        flat.check_grads_attached()
        grad = flat.grads[flat.active]
        inner = p.strategy.inner_step(p.ctx, grad, st.pending_count, st.pending_samples,
                                      st.pending_loss, st.step)  # a device tensor: read there, once
        fields = {"step": st.step + 1, "loss": inner.loss, "lr": inner.lr, "samples": st.pending_samples,
                  "micro_batches": st.pending_count, "global_micro_batches": None, "grad_norm": inner.grad_norm,
                  "skipped": inner.skipped, "bad_ranks": [p.rank] if inner.skipped else [],
                  "min_micro_batches": p.accumulation.pacer.current}
        if inner.skipped:
            log.warning("inner step %d skipped on rank %d: non-finite gradient or update; this worker's "
                        "parameters and optimizer state are as before it", st.step + 1, p.rank)
        st.step += 1
        grad.zero_()
        st.start_accumulator(p.device)
        return fields

    def outer_round(self, exhausted: bool, wait: bool) -> bool:
        """Finish the round in flight, submit the next outer round (waiting for it unless the
        plan overlaps); True when training must stop."""
        p = self.parts
        if self.drain():
            return True
        p.strategy.before_round(p.ctx, p.run.at_end(p.state.step))
        req = RoundRequest(index=p.state.round_index, kind=RoundKind.COMMIT, step_index=p.state.step,
                           grad_index=p.flat.active, count=0, samples=0,
                           loss_sum=torch.zeros((), device=p.device), exhausted=exhausted)
        handle = self.submit_round(req)
        if not p.plan.overlap or wait:
            return self.finish(handle)
        self.inflight = handle
        return False

    def finish(self, handle: RoundHandle) -> bool:
        p = self.parts
        result = self.wait(handle)
        stop = p.strategy.after_round(p.ctx, result)
        self.measure(result)
        self.outer_done.append({"round": result.index, "loss": result.loss, "samples": result.samples,
                                "micro_batches": result.count, "skipped": result.skipped,
                                "bytes": result.bytes_sent})
        if result.skipped:
            log.warning("outer round %d skipped: %s rank(s) %s; theta_sync is as before it", result.index,
                        result.skip_reason, result.bad_ranks)
        if result.exhausted_ranks:
            return self.stopped_early(result.exhausted_ranks)
        return stop
