"""Clocks for the compute side's micro-batch times (the pacer's ``balance="speed"`` shares, the
per-round compute seconds and the timeline).

On CPU the work is done when the Python call returns, so ``time.perf_counter`` around it is its
time (``HostClock``). On CUDA the call returns once the kernels are queued: perf_counter would
measure launch time. ``DeviceClock`` records a CUDA event before and after the micro-batch on
the compute stream and reads their times later, once the GPU reached them (``Event.query``
never blocks): the engine gets each time a little after the micro-batch ran, without a host
sync. Times are placed on the perf_counter axis through one anchor event synchronised when the
clock is made (so the timeline mixes host and device times on one axis).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

Done = Callable[[float, float], None]  # called with (start, end) in perf_counter seconds


class HostClock:
    """perf_counter around the work: the time of synchronous (CPU) work. ``stop`` calls back at once."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, start: float, done: Done) -> None:
        done(start, time.perf_counter())

    def poll(self) -> None:
        pass

    def flush(self, timeout_s: float = 5.0) -> None:
        pass


class DeviceClock:
    """CUDA events on the current stream; ``done`` is called by a later ``stop``/``poll`` once the
    GPU has passed the end event, or by ``flush`` (which waits, time-limited: call it off the hot
    loop)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record(torch.cuda.current_stream(device))
        self._anchor.synchronize()  # once, at construction
        self._anchor_t = time.perf_counter()
        self._pending: deque = deque()

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start(self):
        return self._event()

    def stop(self, start, done: Done) -> None:
        self._pending.append((start, self._event(), done))
        self.poll()

    def _seconds(self, ev) -> float:
        return self._anchor_t + self._anchor.elapsed_time(ev) / 1e3

    def poll(self) -> None:
        """Report every finished span, in order (a stream runs its events in order)."""
        while self._pending and self._pending[0][1].query():
            start, end, done = self._pending.popleft()
            done(self._seconds(start), self._seconds(end))

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (at most ``timeout_s``: a stream stuck behind a lost peer must not hang a close)
        for the last span, report what finished, drop the rest."""
        from .host import wait_until

        if self._pending:
            try:
                wait_until(self._pending[-1][1].query, timeout_s, "the last micro-batch's end event")
            except TimeoutError:
                pass
        self.poll()
        self._pending.clear()


def make_clock(device: torch.device):
    """DeviceClock on a real CUDA device, HostClock otherwise."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return DeviceClock(device)
    return HostClock()
