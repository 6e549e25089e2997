"""The communication side: one background thread that runs rounds in submission order.

CPU (gloo): the thread runs the round's collectives and optimizer step while the caller keeps
computing. CUDA (NCCL): the thread enqueues the round on a dedicated comm stream; the caller
records an event on its compute stream at submission that the comm stream waits on, and the
comm stream records a ``done`` event that the compute stream waits on at install. The compute
loop never synchronises with the GPU after a micro-batch; ``done()`` only queries the event. The
comm thread reads device values on the host twice per round (engine/runtime/host.py: the small
all-reduce's counts and flags, and whether the gathered parameters are finite), which waits for
the comm stream only. A tensor made on one stream and read on the other is either persistent
(the flat buffers, the gathered parameters) or kept alive with ``record_stream``.

One thread for every collective means ranks can never disagree on the order of collectives.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import host

log = logging.getLogger("acco_loco")
COMM_PRIORITY = -1  # CUDA stream priority: lower is higher; 0 is the default streams'


class RoundHandle:
    def __init__(self, index: int):
        self.index = index
        self._finished = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.done_event: torch.cuda.Event | None = None

    def done(self) -> bool:
        """True once the round finished (or failed); never blocks."""
        if not self._finished.is_set():
            return False
        if self.error is None and self.done_event is not None:
            return self.done_event.query()
        return True

    def wait(self, timeout_s: float | None) -> Any:
        """Block until the round's CPU work ended; order the compute stream after its GPU work."""
        if not self._finished.wait(timeout_s):
            raise TimeoutError(f"round {self.index} did not finish within {timeout_s} s")
        if self.error is not None:
            raise self.error
        if self.done_event is not None:
            torch.cuda.current_stream().wait_event(self.done_event)
        return self.result


def _name_os_thread(name: bytes) -> None:
    """Give the calling thread its name in the OS too (top -H, /proc/*/task/*/stat), so that a
    profile shows the comm side's CPU apart from the training loop's. Linux only; best effort."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class CommWorker:
    def __init__(self, device: torch.device, timeout_s: float | None = None):
        self.device = device
        if timeout_s is not None:
            host.wait_limit_s = timeout_s  # the comm thread's device reads give up after it
        # high priority: the scheduler runs the comm stream's short kernels (encode, decode, the
        # collectives) as soon as they are ready, between the compute stream's long ones
        self.stream = torch.cuda.Stream(device=device, priority=COMM_PRIORITY) if device.type == "cuda" else None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="acco-loco-comm", daemon=True)
        self._thread.start()

    def submit(self, index: int, fn: Callable[[], Any]) -> RoundHandle:
        handle = RoundHandle(index)
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._queue.put((fn, ready, handle))
        return handle

    def _loop(self) -> None:
        _name_os_thread(b"acco-loco-comm")
        if self.stream is not None:
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, ready, handle = item
            try:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(ready)
                        handle.result = fn()
                        done = torch.cuda.Event()
                        done.record(self.stream)
                        handle.done_event = done
                else:
                    handle.result = fn()
            except BaseException as exc:  # handed to the caller, raised there
                handle.error = exc
            finally:
                handle._finished.set()

    def adopt(self, tensors) -> None:
        """Tensors made on the compute stream (a checkpoint's loaded state) that the comm side
        keeps, uses on its stream and may drop there while its kernels still read them:
        ``record_stream`` tells the caching allocator not to hand their memory to the compute
        stream before the comm stream's work queued at that moment is done. No-op on CPU."""
        if self.stream is None:
            return
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(self.stream)

    def abort(self) -> bool:
        """After a failed round under NCCL: abort the communicators, which ends the collective
        kernels spinning on a lost peer, so the comm thread's waits return; True if it aborted.
        (gloo needs none: its collectives time out on their own and raise on the comm thread.)"""
        if self.stream is None or not (dist.is_available() and dist.is_initialized()):
            return False
        if "nccl" not in str(dist.get_backend()):
            return False
        try:
            dist.distributed_c10d._abort_process_group()
            return True
        except Exception as exc:  # an experimental API: a failed abort must not hide the real error
            log.warning("acco_loco: aborting the NCCL communicators failed (%s)", exc)
            return False

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread; returns False if it is stuck in a collective (it is a daemon)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
