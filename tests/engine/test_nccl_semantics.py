"""What a lost peer does under NCCL, on CPU with mocks (no GPU here; docs/gpu.md):
an NCCL collective on a dead peer never returns an error to the host (its kernel spins), so the
comm thread's device reads are time-limited polls (engine/runtime/host.py ``wait_until``), the engine
aborts the communicators after naming the peer (streams.CommWorker.abort), which wakes the comm
thread, and NCCL's own watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, a later process-group timeout)
is only the backstop."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

import engine.parallel.comm as comm
import engine.runtime.host as host
from engine.runtime.streams import CommWorker


class StuckWork:
    """An NCCL work on a lost peer: never completes, until the communicator is aborted."""

    def __init__(self):
        self.aborted = threading.Event()
        self.polls = 0

    def is_completed(self) -> bool:
        self.polls += 1
        if self.aborted.is_set():
            raise RuntimeError("NCCL communicator was aborted")
        return False


def test_a_read_behind_a_stuck_collective_times_out():
    work = StuckWork()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 0.3 s: a collective is stuck"):
        host.wait_until(work.is_completed, 0.3, "a device read")
    took = time.monotonic() - t0
    assert 0.3 <= took < 1.0 and work.polls > 10  # it polled, never blocked


def test_a_read_returns_once_the_device_is_done():
    left = iter([False] * 5 + [True])
    t0 = time.monotonic()
    host.wait_until(lambda: next(left), 5.0, "a device read")
    assert time.monotonic() - t0 < 0.5


def test_abort_wakes_the_comm_thread_and_the_round_fails(monkeypatch):
    """The compute side's wait times out (the peer is lost), the engine aborts the communicator:
    the comm thread, polling the stuck collective, wakes with the abort's error and the worker
    closes; nothing is left blocked."""
    work, started = StuckWork(), threading.Event()
    worker = CommWorker(torch.device("cpu"), timeout_s=60.0)

    def round_on_lost_peer():
        started.set()
        host.wait_until(work.is_completed, host.wait_limit_s, "round 0's device read")
    handle = worker.submit(0, round_on_lost_peer)
    assert started.wait(5)
    with pytest.raises(TimeoutError):
        handle.wait(0.2)  # Engine._wait: then the watchdog names the peer
    # as on a CUDA device under an NCCL group
    aborted = []
    monkeypatch.setattr(worker, "stream", object())
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm.dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(comm.dist.distributed_c10d, "_abort_process_group",
                        lambda *a: (aborted.append(1), work.aborted.set()))
    assert worker.abort() and aborted == [1]
    with pytest.raises(RuntimeError, match="aborted"):
        handle.wait(5.0)  # the comm thread woke and handed the error over
    assert worker.close(timeout_s=5.0)


def test_without_an_abort_the_comm_thread_gives_up_at_its_limit():
    work = StuckWork()
    worker = CommWorker(torch.device("cpu"), timeout_s=0.3)
    handle = worker.submit(0, lambda: host.wait_until(work.is_completed, host.wait_limit_s, "round 0's read"))
    with pytest.raises(TimeoutError, match="within 0.3 s"):
        handle.wait(5.0)
    assert worker.close(timeout_s=5.0)
    host.wait_limit_s = 1800.0


def test_gloo_needs_no_abort():
    worker = CommWorker(torch.device("cpu"))
    assert worker.abort() is False
    worker.close()


@pytest.mark.parametrize("device,backend", [("cuda", "nccl"), ("cpu", "gloo")])
def test_process_group_settings(device, backend, monkeypatch):
    seen = {}
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(comm.dist, "init_process_group", lambda b, **kw: seen.update(backend=b, **kw))
    monkeypatch.setattr(comm.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(comm.dist, "get_world_size", lambda: 2)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert comm.init_process_group(torch.device(device), 100.0) == (1, 2)
    assert seen["backend"] == backend
    if backend == "nccl":
        # the backstop comes after the engine's own timeout and diagnosis (<= 0.84 timeout_s)
        assert seen["timeout"] == timedelta(seconds=2 * 100 + 60)
        assert seen["device_id"] == torch.device(device)  # the group is bound to this rank's GPU
        import os
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a user's choice is kept
        comm.init_process_group(torch.device(device), 100.0)
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    else:
        assert seen["timeout"] == timedelta(seconds=100) and "device_id" not in seen


def test_the_recipe_hands_the_backstop_to_accelerate(monkeypatch, tmp_path):
    """accelerate makes the recipe's process group: under NCCL it gets the same backstop as the
    engine's own (not timeout_s, at which NCCL's watchdog would end the process while the engine
    is still naming the lost peer)."""
    import accelerate

    from recipes import finetune

    seen = {}

    class Recorder:
        def __init__(self, **kw):
            seen.update(kw)
    monkeypatch.setattr(accelerate, "Accelerator", Recorder)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    for cuda, want in ((True, 2 * 100 + 60), (False, 100)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        finetune.make_accelerator(finetune.FinetuneConfig(timeout_s=100.0), tmp_path)
        (handler,) = seen["kwargs_handlers"]
        assert handler.timeout == timedelta(seconds=want) and seen["cpu"] is not cuda
    import os
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.mark.parametrize("device,want", [("cuda", 2 * 30 + 60), ("cpu", 30)])
def test_every_engine_group_times_out_with_the_engine(device, want, monkeypatch):
    """Every group ParallelDims makes (the world's, each node's, each rail's) gets the default
    group's timeout for timeout_s, not torch's default for new groups (10 or 30 minutes)."""
    from engine.parallel import dims as dims_module
    from engine.parallel.topology import Layout

    made = []
    monkeypatch.setattr(dims_module.dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or tuple(ranks))
    monkeypatch.setattr(dims_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dims_module.dist, "get_backend", lambda group=None: "gloo")
    dims = dims_module.ParallelDims(Layout(2, 2, 0, 1), "two_level", 1, 4, torch.device(device), timeout_s=30.0)
    assert dims.comm("node").group == (0, 1) and dims.comm("rail").group == (1, 3)
    assert dims.comm("world").group == (0, 1, 2, 3)
    # every rank makes every node's and every rail's group, in one order
    assert [r for r, _ in made] == [[0, 1], [2, 3], [0, 2], [1, 3], [0, 1, 2, 3]]
    assert all(kw["timeout"] == timedelta(seconds=want) for _, kw in made)


def test_the_comm_stream_has_high_priority(monkeypatch):
    import engine.runtime.streams as streams

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: made.append(priority) or object())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    worker = streams.CommWorker(torch.device("cuda", 0))
    assert worker.close(timeout_s=5.0)
    assert made == [streams.COMM_PRIORITY] and streams.COMM_PRIORITY < 0


def test_the_engine_aborts_the_communicators_only_for_a_lost_peer():
    """A lost or stalled peer (WorkerLostError) ends the collectives; an error of this rank's own
    (a bug in a loss function) leaves the process group usable (the comm thread's reads are
    time-limited either way)."""
    from engine import Engine, EngineConfig
    from engine.runtime.watchdog import EXIT_ERROR, EXIT_PEER
    from tests.tiny import mse_loss, tiny_model

    for reason, want in ((EXIT_ERROR, []), (EXIT_PEER, [1])):
        eng = Engine(tiny_model(0), EngineConfig(max_steps=1, align=8), mse_loss)
        calls = []
        eng.worker.abort = lambda: calls.append(1)
        eng._abort(reason)
        eng.close()
        assert calls == want, reason


def test_the_device_clock_flush_never_hangs(monkeypatch):
    """Engine.close flushes the CUDA-event clock; a compute stream stuck behind a lost peer's
    collective must not hang it (mocked events: the end event never completes)."""
    from engine.runtime import clock

    class Never:
        def query(self):
            return False

    c = clock.DeviceClock.__new__(clock.DeviceClock)  # no CUDA here: only the pending spans matter
    from collections import deque
    c._pending, got = deque([(Never(), Never(), lambda a, b: got.append((a, b)))]), []
    t0 = time.monotonic()
    c.flush(timeout_s=0.2)
    assert time.monotonic() - t0 < 1.0 and got == [] and not c._pending
