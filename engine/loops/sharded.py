"""The loop of the sharded strategies (zero1, dpu, acco, local_sgd, onebit_adam): every round
boundary submits the accumulated gradient as a round; a round that commits is a step.

At a boundary the compute side waits for the round in flight (in the batch-growing mode it kept
accumulating until that round was done), installs the parameters it gathered, submits the
gradients it just accumulated as the next round and goes on accumulating into the other buffer
(with overlap), or waits for the round it submitted (without).
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from acco_loco.acco import RoundKind

from .. import checkpoint as ckpt
from ..rounds import RoundRequest, RoundResult
from ..streams import RoundHandle
from .base import RoundLoop

log = logging.getLogger("acco_loco")


class ShardedLoop(RoundLoop):
    def __init__(self, engine):
        super().__init__(engine)
        self.step_local = 0  # this worker's micro-batches in the rounds of the step being recorded

    def boundary(self, exhausted: bool) -> bool:
        e = self.engine
        if self.drain():
            return True
        if exhausted and e.state.pending_count == 0 and e.world_size == 1:
            e.warn_stopped_early([0])
            return True
        e.flat.check_grads_attached()
        handle = self.submit(exhausted)
        if not e.plan.overlap or exhausted:
            return self.finish(handle)
        self.inflight = handle
        return False

    def submit(self, exhausted: bool) -> RoundHandle:
        e = self.engine
        st, flat, plan = e.state, e.flat, e.plan
        req = RoundRequest(
            index=st.round_index, kind=plan.kind(st.round_index), step_index=st.step,
            grad_index=flat.active, count=st.pending_count, samples=st.pending_samples,
            loss_sum=st.pending_loss.clone(), exhausted=exhausted,
            first_of_step=st.round_index % plan.rounds_per_step == 0,
            micro_batch_s=self.round_compute_s / st.pending_count if st.pending_count else 0.0)
        self.round_compute_s = 0.0
        if e.worker.stream is not None:
            # the comm stream reads this compute-stream tensor: keep its memory until it has
            req.loss_sum.record_stream(e.worker.stream)
        handle = e.worker.submit(req.index, partial(e.strategy.run_round, e.ctx, req))
        self.submitted_at = time.perf_counter()
        st.round_index += 1
        e.round_counts.append(req.count)
        e.watchdog.round = req.index
        # the compute side moves to the other buffer; the round owns this one until it is done
        nxt = 1 - flat.active
        flat.point_grads(nxt)
        flat.grads[nxt].zero_()
        st.start_accumulator(e.device)
        return handle

    def finish(self, handle: RoundHandle) -> bool:
        """Wait for a round, install its parameters, record a committed step; True to stop."""
        e = self.engine
        result = self.wait(handle)
        with torch.no_grad():
            e.flat.data.copy_(e.ctx.gather_buf)
        self.measure(result)
        self.step_local += result.local_count
        if result.kind is RoundKind.COMMIT and not result.empty:
            self.record_step(result)
        if result.exhausted_ranks:
            e.warn_stopped_early(result.exhausted_ranks)
            return True
        return e.step >= e.stop_at

    def record_step(self, result: RoundResult) -> None:
        e = self.engine
        e.state.step += 1
        entry = {
            "step": e.step, "loss": result.loss, "lr": result.lr, "samples": result.samples,
            "micro_batches": self.step_local, "global_micro_batches": result.count,
            "wire_bytes": None, "time_s": None, "grad_norm": result.grad_norm,  # filled in by append
            "skipped": result.skipped, "bad_ranks": result.bad_ranks, "rounds": None,
            "min_micro_batches": e.accumulation.pacer.current,
        }
        if result.skipped:
            log.warning("step %d skipped: %s rank(s) %s; the master, the optimizer state and the "
                        "error feedback are as before the step", e.step, result.skip_reason or
                        "non-finite gradient from", result.bad_ranks or "unknown (the reduced sum overflowed)")
        self.append(entry)
        self.step_local = 0
        if ckpt.periodic_due(e):
            ckpt.save_periodic(e, e.cfg.checkpoint_dir)
