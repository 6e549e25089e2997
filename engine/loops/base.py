"""What every compute loop shares: the round in flight, waiting for it, and the history.

The Engine owns the lifecycle (process group, device, worker thread, watchdog, checkpoints) and
the micro-batches; at a round boundary it asks its loop what the boundary does (``boundary``).
A loop reads the engine's public parts (``state``, ``ctx``, ``worker``, ``accumulation``, ...)
and keeps its own: the round in flight and the tallies of the step being recorded.
"""

from __future__ import annotations

import time

from ..checkpoint import Cadence
from ..rounds import RoundResult
from ..streams import RoundHandle


class RoundLoop:
    def __init__(self, engine):
        self.engine = engine
        self.inflight: RoundHandle | None = None
        self.submitted_at = 0.0
        self.step_rounds = 0  # rounds finished since the last history entry
        self.step_bytes = 0  # their bytes
        self.round_compute_s = 0.0  # this worker's compute seconds in the round it accumulates
        self.clock = time.perf_counter()  # when the last history entry (or the loop) started
        counter = engine.comm.counter
        self.link_mark = (counter.intra, counter.inter)  # after the start-up broadcast
        self.cpu_mark = (time.process_time(), time.thread_time())
        # checkpoint_every_s: the step of the next time-based checkpoint, agreed at each save
        self.cadence = Cadence(engine.step) if engine.cfg.checkpoint_every_s is not None else None
        self.pending_save = None  # checkpoint_async: the periodic save being written (engine/checkpoint.py)

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

    def round_may_end(self) -> bool:
        """Whether this worker's micro-batches complete the round: its share of them (grow: at
        least that many, and more while the round in flight is still on the wire)."""
        e = self.engine
        grow, least = e.accumulation.grow, e.accumulation.minimum(e.round_index)
        if e.state.pending_count < least:
            return False
        if not grow or self.inflight is None:
            return True
        if e.cfg.max_micro_batches is not None and e.state.pending_count >= e.cfg.max_micro_batches:
            return True
        if self.inflight.done():
            return True
        return time.perf_counter() - self.submitted_at > e.cfg.timeout_s  # the wait names the peer that holds it up

    def on_micro_batch(self, seconds: float) -> None:
        self.round_compute_s += seconds

    def restart_clock(self) -> None:
        self.clock = time.perf_counter()

    # ------------------------------------------------------------------ shared helpers
    def wait(self, handle: RoundHandle) -> RoundResult:
        """The round's result, or the error a user should see (a lost peer is named)."""
        e = self.engine
        try:
            return handle.wait(e.cfg.timeout_s)
        except Exception as exc:
            err = e.explain(exc, f"round {handle.index} on rank {e.rank}")
            if err is exc:
                raise
            raise err from exc

    def measure(self, result: RoundResult) -> None:
        """A finished round's CPU, rounds, bytes and phases, for the next history entry."""
        e = self.engine
        # what the other threads (comm, gloo) used since the last round ended: on CPU it is
        # taken from the compute side's cores
        proc, main = time.process_time(), time.thread_time()
        comm_cpu = max(0.0, (proc - self.cpu_mark[0]) - (main - self.cpu_mark[1]))
        self.cpu_mark = (proc, main)
        e.comm_cpu_s.append(comm_cpu)
        e.accumulation.on_round(result.micro_batch_s, comm_cpu)
        self.step_rounds += 1
        self.step_bytes += result.bytes_sent
        if e.cfg.record_timeline:
            for phase, (a, b) in result.phases.items():
                e.timeline.append((phase, e.rank, a, b, result.index))

    def link_bytes(self) -> dict:
        """Bytes this rank sent since the last history entry, to its own node and to others."""
        c = self.engine.comm.counter
        intra, inter = c.intra - self.link_mark[0], c.inter - self.link_mark[1]
        self.link_mark = (c.intra, c.inter)
        return {"wire_bytes_intra": intra, "wire_bytes_inter": inter}

    def append(self, entry: dict, **more) -> None:
        """Complete a history entry with the step's tallies, its time and ``more``, and append it."""
        now = time.perf_counter()
        entry.update({"wire_bytes": self.step_bytes, "time_s": now - self.clock, "rounds": self.step_rounds,
                      **more, **self.link_bytes()})
        self.engine.history.append(entry)
        self.clock = now
        self.step_rounds = self.step_bytes = 0
