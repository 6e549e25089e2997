"""engine/runtime/clock.py: micro-batch times from perf_counter on CPU and from CUDA events on a GPU,
reported only once the GPU passed a span's end event (never blocking), in order, on the
perf_counter axis through the anchor. The CUDA events are mocked here (no GPU)."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from engine.runtime import clock


class Ev:
    """A recorded CUDA event: done or not, at ``ms`` after the anchor."""

    def __init__(self, ms: float, done: bool = True):
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done


class Anchor:
    def elapsed_time(self, ev: Ev) -> float:
        return ev.ms


def device_clock() -> clock.DeviceClock:
    c = clock.DeviceClock.__new__(clock.DeviceClock)
    c._anchor, c._anchor_t, c._pending = Anchor(), 100.0, deque()
    return c


def test_host_clock_reports_at_once():
    got = []
    c = clock.make_clock(torch.device("cpu"))
    assert isinstance(c, clock.HostClock)
    start = c.start()
    c.stop(start, lambda a, b: got.append((a, b)))
    assert len(got) == 1 and got[0][0] == start and got[0][1] >= start


def test_device_clock_reports_finished_spans_in_order_on_the_host_axis():
    c, got = device_clock(), []
    first_end, second_end = Ev(30.0, done=False), Ev(70.0, done=False)
    c._pending.append((Ev(10.0), first_end, lambda a, b: got.append(("first", a, b))))
    c._pending.append((Ev(40.0), second_end, lambda a, b: got.append(("second", a, b))))
    c.poll()
    assert got == []  # the GPU has not reached either end: nothing yet, and nothing waited
    second_end.done = True
    c.poll()
    assert got == []  # in order: the first span is still running
    first_end.done = True
    c.poll()
    assert got == [("first", 100.01, 100.03), ("second", 100.04, 100.07)]
    assert not c._pending


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device gets the event clock")
def test_a_fake_cuda_device_gets_the_host_clock():
    """No CUDA runtime (the fake-CUDA tests): perf_counter, not events that cannot be recorded."""
    assert isinstance(clock.make_clock(torch.device("cuda", 0)), clock.HostClock)
