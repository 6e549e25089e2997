"""The only places a round reads device values on the host. On a GPU each read waits for the
device (a host sync), so a round keeps them to what its control flow truly needs: the small
all-reduce's counts and flags, and whether the gathered parameters are finite. Everything else
(finiteness flags, weights, norms) stays on the device. tests/engine/test_host_syncs.py counts them.
The other way too: ``t[i] = 3.0`` on a device tensor is a blocking copy from the host each time,
so the small all-reduce's vector is filled on the host and copied once (``small_vector``).

On a GPU a read is also where the comm thread would wait for ever behind a collective that never
ends (a dead peer under NCCL: the kernel spins on the device, nothing returns an error to the
host). So the read is time-limited: an asynchronous copy into pinned memory, then a poll of its
event until ``wait_limit_s`` (the engine's ``timeout_s``), then TimeoutError. The poll also
returns as soon as the communicator is aborted (streams.CommWorker.abort), which ends the kernel.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

wait_limit_s = 1800.0  # set by streams.CommWorker from EngineConfig.timeout_s
POLL_MAX_S = 50e-6  # the longest sleep between two polls of a device read


def wait_until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``done`` (never blocking) until it is True; TimeoutError after ``timeout_s``. Spins
    for 100 us first (a read normally waits for microseconds), then sleeps between polls, at most
    POLL_MAX_S (a round makes two such reads: a 1 ms nap would add up to 2 ms to each round)."""
    start = time.monotonic()
    pause = 0.0
    while not done():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g} s: a collective is stuck "
                               "(a peer lost or stalled?)")
        if waited > 1e-4:
            pause = min(POLL_MAX_S, max(1e-5, 2 * pause))
            time.sleep(pause)
        else:
            time.sleep(0)  # let the compute thread have the GIL while we spin


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Bring a small tensor to the host (one sync on a GPU, time-limited there)."""
    if t.device.type != "cuda":
        return t.cpu()
    return HostRead(t).wait()


class HostRead:
    """A read started now and waited for later: on a GPU the copy to pinned memory is queued
    behind the work queued so far, so work queued after it (a large collective) is not waited
    for. ``wait()`` is ``to_host``'s result (through ``to_host`` on CPU: the tests count it)."""

    def __init__(self, t: torch.Tensor):
        self.t, self.out, self.ready = t, None, None
        if t.device.type == "cuda":
            self.out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.out.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(t.device))

    def wait(self) -> torch.Tensor:
        if self.ready is None:
            return to_host(self.t)
        wait_until(self.ready.query, wait_limit_s, "a device read on the communication side")
        return self.out


def small_vector(numbers: list, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A small vector on ``device`` from ``numbers``: Python numbers, or 0-d/1-element tensors
    already on ``device`` (a loss sum, a norm, a finiteness flag). The numbers are filled on the
    host (pinned on a GPU) and copied once, non-blocking; the device values are copied in on the
    device. No host wait either way (``t[i] = x`` would wait once per element)."""
    on_device = {i: v for i, v in enumerate(numbers) if torch.is_tensor(v)}
    host = torch.tensor([0.0 if torch.is_tensor(v) else float(v) for v in numbers], dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    out = host.to(device, non_blocking=True)
    for i, v in on_device.items():
        out.narrow(0, i, 1).copy_(v.reshape(1))  # device to device
    return out


def host_flag(t: torch.Tensor) -> bool:
    """``bool(t)`` of a 0-d device tensor through ``to_host`` (time-limited on a GPU)."""
    return bool(to_host(t))


def nonfinite_rows(rows: torch.Tensor) -> list[int]:
    """Indices of the rows of a 2-D tensor that hold a NaN or an Inf: one host read when all
    are finite, one more to name the rows when some are not."""
    lo, hi = torch.aminmax(rows)
    if bool(to_host(torch.isfinite(torch.stack([lo, hi])).all())):
        return []
    finite = to_host(torch.isfinite(rows).all(dim=1))
    return [j for j in range(rows.shape[0]) if not bool(finite[j])]


def nonfinite_rows_parts(parts: list[torch.Tensor]) -> list[int]:
    """``nonfinite_rows`` of the 2-D tensors in ``parts`` side by side (the same rows, pieces of
    their columns, as a pipelined collective receives them): still one host read when all are
    finite, one more to name the rows when some are not."""
    parts = [p for p in parts if p.numel()]
    if len(parts) <= 1:
        return nonfinite_rows(parts[0]) if parts else []
    ends = torch.stack([v for p in parts for v in torch.aminmax(p)])
    if bool(to_host(torch.isfinite(ends).all())):
        return []
    finite = to_host(torch.stack([torch.isfinite(p).all(dim=1) for p in parts]).all(dim=0))
    return [j for j in range(parts[0].shape[0]) if not bool(finite[j])]


def false_rows(flags: torch.Tensor) -> list[int]:
    """Indices where a 1-D bool tensor (a per-row verdict kept on the device) is False: one host read."""
    got = to_host(flags)
    return [j for j in range(flags.numel()) if not bool(got[j])]


def nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """1.0 (a 0-d float64 tensor, on x's device) if x holds a NaN or an Inf, else 0.0; no host read."""
    lo, hi = torch.aminmax(x)
    return torch.isfinite(torch.stack([lo, hi])).all().logical_not().to(torch.float64)
