"""The loop of the sharded strategies (zero1, dpu, acco, local_sgd, onebit_adam): every round
boundary submits the accumulated gradient as a round; a round that commits is a step.

At a boundary the compute side waits for the round in flight (in the batch-growing mode it kept
accumulating until that round was done), installs the parameters it gathered, submits the
gradients it just accumulated as the next round and goes on accumulating into the other buffer
(with overlap), or waits for the round it submitted (without). A sharded round gathers into the
gradient buffer it has reduced (``RoundContext.gather_target``): the install reads it before the
next submit hands that buffer back to compute, which zeroes it.
"""

from __future__ import annotations

import logging

import torch

from acco_loco.acco import RoundKind

from ..core.rounds import RoundResult
from ..runtime.streams import RoundHandle
from .base import RoundLoop
from .parts import LoopParts

log = logging.getLogger("acco_loco")


class ShardedLoop(RoundLoop):
    def __init__(self, parts: LoopParts):
        super().__init__(parts)
        self.step_local = 0  # this worker's micro-batches in the rounds of the step being recorded

    def boundary(self, exhausted: bool) -> bool:
        p = self.parts
        if self.drain():
            return True
        if exhausted and p.state.pending_count == 0 and p.world_size == 1:
            return self.stopped_early([0])
        p.flat.check_grads_attached()
        handle = self.submit(exhausted)
        if not p.strategy.overlaps(p.state.step) or exhausted:
            return self.finish(handle)
        self.inflight = handle
        return False

    def submit(self, exhausted: bool) -> RoundHandle:
        p = self.parts
        flat = p.flat
        handle = self.submit_round(self.request(exhausted))
        # the compute side moves to the other buffer; the round owns this one until it is done
        # (one buffer: no overlap, the round gathers into it and ``finish`` zeroes it after)
        if len(flat.grads) > 1:
            nxt = 1 - flat.active
            flat.point_grads(nxt)
            flat.grads[nxt].zero_()
        p.state.start_accumulator(p.device)
        return handle

    def finish(self, handle: RoundHandle) -> bool:
        """Wait for a round, install its parameters, record a committed step; True to stop."""
        p = self.parts
        result = self.wait(handle)
        gathered = result.gathered if result.gathered is not None else p.ctx.gather_buf
        with torch.no_grad():
            # before compute reuses the buffer: a round may have gathered into the gradient buffer
            # it reduced, which compute zeroes when it next accumulates into it (``submit``)
            p.flat.install(gathered)
            if len(p.flat.grads) == 1:
                p.flat.grads[0].zero_()
            elif p.cfg.poison_freed_buffers and gathered is not p.ctx.gather_buf:
                # installed: any later read of the freed gradient buffer shows NaN
                held = gathered.untyped_storage().data_ptr()
                for buf in p.flat.grads:
                    if buf.untyped_storage().data_ptr() == held:
                        buf.fill_(float("nan"))
        self.measure(result)
        self.step_local += result.local_count
        stop = False
        if result.kind is RoundKind.COMMIT and not result.empty:
            stop = self.record_step(result)
        if result.exhausted_ranks:
            return self.stopped_early(result.exhausted_ranks)
        return stop or p.run.at_end(p.state.step)

    def record_step(self, result: RoundResult) -> bool:
        p = self.parts
        p.state.step += 1
        if result.skipped:
            log.warning("step %d skipped: %s rank(s) %s; the master, the optimizer state and the "
                        "error feedback are as before the step", p.state.step, result.skip_reason or
                        "non-finite gradient from", result.bad_ranks or "unknown (the reduced sum overflowed)")
        local, self.step_local = self.step_local, 0
        return self.record(step=p.state.step, loss=result.loss, lr=result.lr, samples=result.samples,
                           micro_batches=local, global_micro_batches=result.count,
                           grad_norm=result.grad_norm, skipped=result.skipped, bad_ranks=result.bad_ranks,
                           min_micro_batches=p.accumulation.pacer.current)
