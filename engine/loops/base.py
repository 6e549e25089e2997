"""What every compute loop shares: the round in flight, submitting a round, waiting for it,
and recording a committed step.

The Engine owns the lifecycle (process group, device, worker thread, watchdog, checkpoints) and
the micro-batches; at a round boundary it asks its loop what the boundary does (``boundary``).
A loop is built from the engine's parts (``LoopParts``: never the engine itself) and keeps its
own state: the round in flight. Every loop submits through ``submit_round`` and appends a
history entry through ``record``.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from ..core.rounds import RoundRequest, RoundResult
from ..runtime.streams import RoundHandle
from ..runtime.watchdog import may_be_peer_failure
from .parts import LoopParts

log = logging.getLogger("acco_loco")


class RoundLoop:
    def __init__(self, parts: LoopParts):
        self.parts = parts
        self.inflight: RoundHandle | None = None
        self.submitted_at = 0.0
        self.round_compute_s = 0.0  # this worker's compute seconds in the round it accumulates

    # ------------------------------------------------------------------ what a loop decides
    def boundary(self, exhausted: bool) -> bool:
        """The micro-batches of a round are in (or the data ran out): do what the boundary does;
        True when training must stop."""
        raise NotImplementedError

    def finish(self, handle: RoundHandle) -> bool:
        """Wait for a round and do what its end does; True when training must stop."""
        raise NotImplementedError

    def drain(self) -> bool:
        """Finish the round in flight, if any (before a save, at close); True when training must stop."""
        if self.inflight is None:
            return False
        handle, self.inflight = self.inflight, None
        return self.finish(handle)

    def abandon(self) -> None:
        """After an error: the round in flight is left (the comm side was told to stop)."""
        self.inflight = None

    def round_may_end(self) -> bool:
        """Whether this worker's micro-batches complete the round: its share of them (grow: at
        least that many, and more while the round in flight is still on the wire)."""
        p = self.parts
        grow, least = p.accumulation.grow, p.accumulation.minimum(p.state.round_index)
        if p.state.pending_count < least:
            return False
        if not grow or self.inflight is None:
            return True
        if p.cfg.max_micro_batches is not None and p.state.pending_count >= p.cfg.max_micro_batches:
            return True
        if self.inflight.done():
            return True
        return time.perf_counter() - self.submitted_at > p.cfg.timeout_s  # the wait names the peer that holds it up

    def on_micro_batch(self, seconds: float) -> None:
        self.round_compute_s += seconds

    # ------------------------------------------------------------------ shared verbs
    def request(self, exhausted: bool) -> RoundRequest:
        """The micro-batches accumulated since the last round, as the next round's request."""
        p = self.parts
        st, plan = p.state, p.plan
        req = RoundRequest(
            index=st.round_index, kind=plan.kind(st.round_index), step_index=st.step,
            grad_index=p.flat.active, count=st.pending_count, samples=st.pending_samples,
            loss_sum=st.pending_loss.clone(), exhausted=exhausted,
            first_of_step=st.round_index % plan.rounds_per_step == 0,
            micro_batch_s=self.round_compute_s / st.pending_count if st.pending_count else 0.0)
        self.round_compute_s = 0.0
        return req

    def submit_round(self, req: RoundRequest) -> RoundHandle:
        """Hand a round to the comm side (the strategy's ``run_round``) and count it: the round
        index, this worker's micro-batches in it, the round the heartbeats publish."""
        p = self.parts
        if p.worker.stream is not None:
            # the comm stream reads this compute-stream tensor: keep its memory until it has
            req.loss_sum.record_stream(p.worker.stream)
        handle = p.worker.submit(req.index, partial(p.strategy.run_round, p.ctx, req))
        self.submitted_at = time.perf_counter()
        p.state.round_index += 1
        p.run.submitted(req.count)
        p.watchdog.round = req.index
        return handle

    def wait(self, handle: RoundHandle) -> RoundResult:
        """The round's result, or the error a user should see (a lost peer is named)."""
        p = self.parts
        try:
            return handle.wait(p.cfg.timeout_s)
        except Exception as exc:
            err = self.explain(exc, f"round {handle.index} on rank {p.rank}")
            if err is exc:
                raise
            raise err from exc

    def explain(self, exc: Exception, where: str) -> Exception:
        """The error a user should see for a failed round: the round's own exception (with
        where it happened), or WorkerLostError when the failure is a peer that died or stalled."""
        if self.parts.world_size > 1 and may_be_peer_failure(exc):
            lost = self.parts.watchdog.diagnose(where)
            if lost.ranks or isinstance(exc, TimeoutError):
                return lost
        exc.add_note(f"(raised on the communication side: {where})")
        return exc

    def measure(self, result: RoundResult) -> None:
        """A finished round's CPU, rounds, bytes and phases, for the next history entry and the pacing."""
        comm_cpu = self.parts.run.round_done(result)
        self.parts.accumulation.on_round(result.micro_batch_s, comm_cpu)

    def record(self, **fields) -> bool:
        """Append a committed step's history entry (``RunState.record`` takes ``fields``); a
        periodic checkpoint due at this step follows, after the round in flight is finished.
        True when that round says stop."""
        p = self.parts
        p.run.record(**fields)
        if not p.saver.due(p.state.step):
            return False
        stop = self.drain()  # a checkpoint needs no round in flight
        p.saver.save()
        return stop

    def stopped_early(self, ranks: list[int]) -> bool:
        """Some rank's data ran out: say so; True (training stops)."""
        log.warning("training stopped at step %d: the data of rank(s) %s ran out; %d micro-batches "
                    "accumulated on this rank stay pending and are used if fit() continues",
                    self.parts.state.step, ranks, self.parts.state.pending_count)
        return True
