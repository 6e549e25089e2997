"""The loop of the local-step strategies (diloco, sparseloco; docs/DESIGN.md section 8).

Every round boundary is one inner optimizer step of this worker alone, and an outer round is
submitted only when the strategy says one is due. ``max_steps`` and the history count inner
steps; an entry lists the outer rounds that finished since the previous one (``outer``).
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from acco_loco.acco import RoundKind

from .. import checkpoint as ckpt
from ..rounds import RoundRequest
from ..streams import RoundHandle
from .base import RoundLoop

log = logging.getLogger("acco_loco")


class LocalStepsLoop(RoundLoop):
    def __init__(self, engine):
        super().__init__(engine)
        self.outer_done: list[dict] = []  # outer rounds finished since the last history entry

    def boundary(self, exhausted: bool) -> bool:
        """The micro-batches just run make one inner step of this worker alone; an outer round
        follows when it is due, or when this worker's data ran out."""
        e = self.engine
        exhausted = e.strategy.agree_exhausted(exhausted)  # a node replica stops together
        entry = None if exhausted else self.inner_step()
        stopping = e.step >= e.stop_at
        stop = stopping
        if exhausted or e.strategy.round_due(e.step, stopping):
            stop = self.outer_round(exhausted, wait=stopping or exhausted) or stop
        elif stopping:
            stop = self.drain() or stop  # fit() returns with no round in flight
        if entry is not None:
            stop = self.record_inner(entry) or stop
        return stop

    def inner_step(self) -> dict:
        """Apply this worker's inner step (no communication); its history entry, to be completed
        by record_inner. Loss, samples and micro-batches are this worker's own."""
        e = self.engine
        e.flat.check_grads_attached()
        st, grad = e.state, e.flat.grads[e.flat.active]
        inner = e.strategy.inner_step(e.ctx, grad, st.pending_count, st.pending_samples,
                                      st.pending_loss, e.step)  # a device tensor: read there, once
        entry = {"step": e.step + 1, "loss": inner.loss, "lr": inner.lr, "samples": st.pending_samples,
                 "micro_batches": st.pending_count, "global_micro_batches": None, "grad_norm": inner.grad_norm,
                 "skipped": inner.skipped, "bad_ranks": [e.rank] if inner.skipped else [],
                 "min_micro_batches": e.accumulation.pacer.current}
        if inner.skipped:
            log.warning("inner step %d skipped on rank %d: non-finite gradient or update; this worker's "
                        "parameters and optimizer state are as before it", e.step + 1, e.rank)
        st.step += 1
        grad.zero_()
        st.start_accumulator(e.device)
        return entry

    def outer_round(self, exhausted: bool, wait: bool) -> bool:
        """Finish the round in flight, submit the next outer round (waiting for it unless the
        plan overlaps); True when training must stop."""
        e = self.engine
        if self.drain():
            return True
        e.strategy.before_round(e.ctx, e.step >= e.stop_at)
        req = RoundRequest(index=e.round_index, kind=RoundKind.COMMIT, step_index=e.step,
                           grad_index=e.flat.active, count=0, samples=0,
                           loss_sum=torch.zeros((), device=e.device), exhausted=exhausted)
        handle = e.worker.submit(req.index, partial(e.strategy.run_round, e.ctx, req))
        self.submitted_at = time.perf_counter()
        e.state.round_index += 1
        e.watchdog.round = req.index
        if not e.plan.overlap or wait:
            return self.finish(handle)
        self.inflight = handle
        return False

    def finish(self, handle: RoundHandle) -> bool:
        e = self.engine
        result = self.wait(handle)
        stop = e.strategy.after_round(e.ctx, result)
        self.measure(result)
        self.outer_done.append({"round": result.index, "loss": result.loss, "samples": result.samples,
                                "micro_batches": result.count, "skipped": result.skipped,
                                "bytes": result.bytes_sent})
        if result.skipped:
            log.warning("outer round %d skipped: %s rank(s) %s; theta_sync is as before it", result.index,
                        result.skip_reason, result.bad_ranks)
        if result.exhausted_ranks:
            e.warn_stopped_early(result.exhausted_ranks)
            return True
        return stop

    def record_inner(self, entry: dict) -> bool:
        """Complete and append an inner step's entry (outer rounds finished since the last one:
        their bytes and results); a periodic checkpoint first finishes the round in flight."""
        e = self.engine
        self.append(entry, outer=self.outer_done)
        self.outer_done = []
        if ckpt.periodic_due(e):
            stop = self.drain()  # a checkpoint needs no round in flight; the merge waits as before
            ckpt.save_periodic(e, e.cfg.checkpoint_dir)
            return stop
        return False
