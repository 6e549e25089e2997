"""What a run has done and when its loop stops: the history, the micro-batches of each round,
the timeline, the comm side's CPU per round, and the step a loop of feed() calls ends at.

Beside ``EngineState`` (the counters a checkpoint keeps), ``RunState`` is what a checkpoint does
not keep: it is this process's account of the run. The loops tell it what happened through its
verbs (``submitted``, ``round_done``, ``computed``, ``record``); the engine shows it read-only
(``engine.history``, ``engine.round_counts``, ``engine.timeline``, ``engine.comm_cpu_s``). A
history entry is built in one place, ``record``."""

from __future__ import annotations

import time

from .rounds import RoundResult


class RunState:
    def __init__(self, rank: int, counter, record_timeline: bool, max_steps: int):
        """``counter``: the comm's byte counter (``intra``/``inter`` bytes sent so far), read
        after the start-up broadcast so that an entry counts only its own step's bytes."""
        self._rank, self._counter, self._record_timeline = rank, counter, record_timeline
        self._history: list[dict] = []
        self._round_counts: list[int] = []  # this worker's micro-batches in each submitted round
        self._timeline: list[tuple] = []
        self._comm_cpu_s: list[float] = []  # CPU seconds of every thread but the compute loop, per round
        self._max_steps = max_steps
        self._stop_at = max_steps  # fit(steps=...) and begin(steps) stop their loop earlier
        self._stopped = False  # the last boundary said stop (the data of some rank ran out, or the horizon)
        # the tallies of the step being recorded
        self._rounds = 0  # rounds finished since the last entry
        self._bytes = 0  # their bytes
        self._clock = time.perf_counter()  # when the last entry (or the loop) started
        self._link_mark = (counter.intra, counter.inter)
        self._cpu_mark = (time.process_time(), time.thread_time())

    # ------------------------------------------------------------------ read-only views
    history = property(lambda self: self._history, doc="one dict per committed step")
    round_counts = property(lambda self: self._round_counts, doc="this worker's micro-batches per submitted round")
    timeline = property(lambda self: self._timeline, doc="(phase, rank, t0, t1, round) with record_timeline")
    comm_cpu_s = property(lambda self: self._comm_cpu_s, doc="the comm side's CPU seconds per finished round")
    stop_at = property(lambda self: self._stop_at, doc="the step at which the current loop ends")

    # ------------------------------------------------------------------ when a loop stops
    def begin(self, step: int, steps: int | None) -> None:
        """A loop of feed() calls starts at ``step`` and ends ``steps`` later (None: at max_steps)."""
        self._stop_at = loop_end(step, self._max_steps, steps)
        self._stopped = False
        self.restart_clock()

    def stop(self) -> None:
        """A round boundary said stop: some rank's data ran out, or the loop's end was reached."""
        self._stopped = True

    def done(self, step: int) -> bool:
        return self._stopped or step >= self._stop_at

    def at_end(self, step: int) -> bool:
        """Whether ``step`` committed steps reach the current loop's end."""
        return step >= self._stop_at

    def why_done(self, step: int) -> str:
        return done_message(step, self._max_steps, self._stop_at)

    # ------------------------------------------------------------------ what happened
    def restart_clock(self) -> None:
        self._clock = time.perf_counter()

    def submitted(self, count: int) -> None:
        """A round was submitted with ``count`` micro-batches of this worker's."""
        self._round_counts.append(count)

    def computed(self, t0: float, t1: float, round_index: int) -> None:
        """A micro-batch ran from ``t0`` to ``t1`` towards round ``round_index``."""
        if self._record_timeline:
            self._timeline.append(("compute", self._rank, t0, t1, round_index))

    def round_done(self, result: RoundResult) -> float:
        """A finished round: its rounds, bytes and phases count towards the next entry. Returns
        the CPU seconds the other threads (comm, gloo) used since the last round ended: on CPU
        they are taken from the compute side's cores."""
        proc, main = time.process_time(), time.thread_time()
        comm_cpu = max(0.0, (proc - self._cpu_mark[0]) - (main - self._cpu_mark[1]))
        self._cpu_mark = (proc, main)
        self._comm_cpu_s.append(comm_cpu)
        self._rounds += 1
        self._bytes += result.bytes_sent
        if self._record_timeline:
            for phase, (a, b) in result.phases.items():
                self._timeline.append((phase, self._rank, a, b, result.index))
        return comm_cpu

    def record(self, *, step: int, loss: float, lr: float, samples: int, micro_batches: int,
               global_micro_batches: int | None, grad_norm: float | None, skipped: bool,
               bad_ranks: list[int], min_micro_batches: int, **more) -> dict:
        """Append a committed step's history entry (docs/design/wire.md; StepResult's
        fields): the given fields, the rounds and bytes since the last entry, its wall time, the
        bytes sent within and across nodes, and ``more`` (local steps: ``outer``)."""
        now = time.perf_counter()
        c = self._counter
        intra, inter = c.intra - self._link_mark[0], c.inter - self._link_mark[1]
        entry = {"step": step, "loss": loss, "lr": lr, "samples": samples, "micro_batches": micro_batches,
                 "global_micro_batches": global_micro_batches, "wire_bytes": self._bytes,
                 "time_s": now - self._clock, "grad_norm": grad_norm, "skipped": skipped,
                 "bad_ranks": bad_ranks, "rounds": self._rounds, "min_micro_batches": min_micro_batches,
                 **more, "wire_bytes_intra": intra, "wire_bytes_inter": inter}
        self._history.append(entry)
        self._link_mark = (c.intra, c.inter)
        self._clock = now
        self._rounds = self._bytes = 0
        return entry


def done_message(step: int, max_steps: int, stop_at: int) -> str:
    """Why a loop takes no more batches (what ``feed`` after ``done`` says)."""
    if step >= max_steps:
        return (f"the engine is at step {step}, its max_steps: nothing more to train (load it with "
                f"a new horizon to continue: Engine.load(directory, model, max_steps=...))")
    if step >= stop_at:
        return f"this loop's steps are done at step {step}: begin(steps) starts another piece"
    return (f"training stopped at step {step}: the data of some worker ran out; begin() and "
            f"feed() again on every rank to continue with more data")


def loop_end(step: int, max_steps: int, steps: int | None) -> int:
    """The step at which a loop started at ``step`` ends: ``steps`` more, at most ``max_steps``."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive integer or None, got {steps!r}")
    if step >= max_steps:
        raise RuntimeError(
            f"the engine is at step {step}, its max_steps is {max_steps}: nothing to "
            f"train. To continue a saved run, load it with a new horizon: "
            f"Engine.load(directory, model, loss_fn=..., max_steps={step + max_steps})")
    return max_steps if steps is None else min(max_steps, step + steps)
