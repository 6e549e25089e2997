"""The compute side of the local-step strategies (diloco, sparseloco; docs/DESIGN.md section 8).

With ``plan.local_steps`` > 0 every round boundary of the Engine's loop is one inner optimizer
step of this worker alone, and an outer round is submitted only when the strategy says one is
due. ``max_steps`` and the history count inner steps. Engine mixes this class in; it uses the
Engine's state, worker, watchdog and round helpers (``_wait``, ``_measure``).
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from acco_loco.acco import RoundKind

from . import checkpoint as ckpt
from .rounds import RoundRequest
from .streams import RoundHandle

log = logging.getLogger("acco_loco")


class LocalStepsLoop:
    def _local_boundary(self, exhausted: bool) -> bool:
        """The micro-batches just run make one inner step of this worker alone; an outer round
        follows when it is due, or when this worker's data ran out. ``max_steps`` and the history
        count inner steps. True when training must stop."""
        entry = None if exhausted else self._inner_step()
        stopping = self.step >= self._stop_at
        stop = stopping
        if exhausted or self.strategy.round_due(self.step, stopping):
            stop = self._outer_round(exhausted, wait=stopping or exhausted) or stop
        elif stopping:
            stop = self._drain() or stop  # fit() returns with no round in flight
        if entry is not None:
            stop = self._record_inner(entry) or stop
        return stop

    def _inner_step(self) -> dict:
        """Apply this worker's inner step (no communication); its history entry, to be completed
        by _record_inner. Loss, samples and micro-batches are this worker's own."""
        self.flat.check_grads_attached()
        st, grad = self.state, self.flat.grads[self.flat.active]
        inner = self.strategy.inner_step(self.ctx, grad, st.pending_count, st.pending_samples,
                                         st.pending_loss, self.step)  # a device tensor: read there, once
        entry = {"step": self.step + 1, "loss": inner.loss, "lr": inner.lr, "samples": st.pending_samples,
                 "micro_batches": st.pending_count, "global_micro_batches": None, "grad_norm": inner.grad_norm,
                 "skipped": inner.skipped, "bad_ranks": [self.rank] if inner.skipped else [],
                 "min_micro_batches": self.accumulation.pacer.current}
        if inner.skipped:
            log.warning("inner step %d skipped on rank %d: non-finite gradient or update; this worker's "
                        "parameters and optimizer state are as before it", self.step + 1, self.rank)
        st.step += 1
        grad.zero_()
        st.start_accumulator(self.device)
        return entry

    def _outer_round(self, exhausted: bool, wait: bool) -> bool:
        """Finish the round in flight, submit the next outer round (waiting for it unless the
        plan overlaps); True when training must stop."""
        if self._drain():
            return True
        self.strategy.before_round(self.ctx, self.step >= self._stop_at)
        req = RoundRequest(index=self.round_index, kind=RoundKind.COMMIT, step_index=self.step,
                           grad_index=self.flat.active, count=0, samples=0,
                           loss_sum=torch.zeros((), device=self.device), exhausted=exhausted)
        handle = self.worker.submit(req.index, partial(self.strategy.run_round, self.ctx, req))
        self._submitted_at = time.perf_counter()
        self.state.round_index += 1
        self.watchdog.round = req.index
        if not self.plan.overlap or wait:
            return self._finish_outer(handle)
        self._inflight = handle
        return False

    def _drain(self) -> bool:
        """Finish the outer round in flight, if any; True when training must stop."""
        if self._inflight is None:
            return False
        handle, self._inflight = self._inflight, None
        return self._finish_outer(handle)

    def _finish_outer(self, handle: RoundHandle) -> bool:
        result = self._wait(handle)
        stop = self.strategy.after_round(self.ctx, result)
        self._measure(result)
        self._outer_done.append({"round": result.index, "loss": result.loss, "samples": result.samples,
                                 "micro_batches": result.count, "skipped": result.skipped,
                                 "bytes": result.bytes_sent})
        if result.skipped:
            log.warning("outer round %d skipped: %s rank(s) %s; theta_sync is as before it", result.index,
                        result.skip_reason, result.bad_ranks)
        if result.exhausted_ranks:
            self._warn_stopped_early(result.exhausted_ranks)
            return True
        return stop

    def _record_inner(self, entry: dict) -> bool:
        """Complete and append an inner step's entry (outer rounds finished since the last one:
        their bytes and results); a periodic checkpoint first finishes the round in flight."""
        now = time.perf_counter()
        entry.update({"wire_bytes": self._step_bytes, "time_s": now - self._clock, "rounds": self._step_rounds,
                      "outer": self._outer_done, **self._link_bytes()})
        self.history.append(entry)
        self._clock = now
        self._step_rounds = self._step_bytes = 0
        self._outer_done = []
        cfg = self.cfg
        if ckpt.periodic_due(self):
            stop = self._drain()  # a checkpoint needs no round in flight; the merge waits as before
            ckpt.save_periodic(self, cfg.checkpoint_dir)
            return stop
        return False
