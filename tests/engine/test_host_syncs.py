"""Host reads of device values per round, counted without a GPU: every read a round makes must go
through engine/runtime/host.py's ``to_host`` (on a GPU each one waits for the device), and a round makes
exactly two: the small all-reduce's counts and flags, and whether the gathered parameters are
finite. A stray ``.item()``, ``float(t)``, ``bool(t)`` or ``.cpu()`` anywhere in a round fails
this test. So does a tensor built from Python numbers (``torch.tensor(3.0, device=...)``: on a
GPU a copy from pageable host memory, which waits), outside the sites listed in KNOWN_H2D, and a
Python number written into an element of a tensor (``small[i] = 3.0``: on a GPU a blocking copy
each, where a dead peer would hang the comm thread outside its time-limited poll). engine/runtime/host.py
is where both are sanctioned: ``small_vector`` fills a host buffer and copies it once. Each
case runs with the fused CPU kernels on and off (off: the code path a GPU runs).

The local-step strategies' inner step on its accelerator path (engine/strategies/local_steps.py
``device_side``, forced here on CPU) reads the device once per inner step, and gives the same
parameters as the CPU path."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import acco_loco.codecs
import engine.runtime.host
import engine.strategies.inner_step
import engine.strategies.local_sgd
import engine.strategies.local_steps
import engine.strategies.sharded
from acco_loco import kernels
from engine import Engine, EngineConfig
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

# tensors built from host values: on a GPU, a synchronous copy from pageable memory
FROM_HOST = {torch.tensor, torch.as_tensor, torch.asarray}
# per-round tensors from Python numbers that another change removes (engine/parallel/collectives.py is
# owned by the two-level work: CompressedGrads.reduce's ``torch.tensor([float(count)])``, the
# round's count as a weight): listed with their number per round, not hidden; nothing else may
KNOWN_H2D: dict[str, int] = {}  # none left: the count weight is a kept device buffer filled in place

HOST_READS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


class HostTensor(torch.Tensor):
    """What to_host returned: reading it on the host costs nothing more."""


def _caller() -> str:
    """file:function of the project code that made the call."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(root) and "/tests/" not in path:
            return f"{os.path.relpath(path, root)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


SANCTIONED = "engine/runtime/host.py:"  # the one module that may move host values to the device


class CountHostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.from_host: list[str] = []  # where a tensor was built from Python numbers
        self.set_numbers: list[str] = []  # where a Python number was written into a tensor's element

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and args and not isinstance(args[0], HostTensor):
            self.reads.append(func.__name__)
        if func in FROM_HOST and args and not isinstance(args[0], torch.Tensor):
            site = _caller()
            if not site.startswith(SANCTIONED):
                self.from_host.append(site)
        if func is torch.Tensor.__setitem__ and not isinstance(args[0], HostTensor) \
                and not isinstance(args[2], torch.Tensor):
            site = _caller()
            if not site.startswith(SANCTIONED):
                self.set_numbers.append(site)
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=[True, False], ids=["kernels", "no-kernels"])
def fused(request):
    kernels.use(request.param)
    yield request.param
    kernels.use(True)


def counted_to_host(calls: list[int]):
    def to_host(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.cpu().as_subclass(HostTensor)
    return to_host


@pytest.mark.parametrize("kw", [
    dict(strategy="zero1"),
    dict(strategy="acco", codec="loco4", param_codec="int8"),
    dict(strategy="acco", codec="sign1", param_codec="int4"),
    dict(strategy="dpu", codec="ef8", param_codec="bfloat16"),
    dict(strategy="acco", codec="fp16"),
    dict(strategy="acco", codec="loco4", param_codec="int4", comm_chunks=3),  # pipelined pieces
    dict(strategy="zero1", comm_chunks=3),
], ids=lambda kw: "+".join(str(v) for v in kw.values()))
def test_a_round_reads_the_device_twice(kw, fused, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(engine.runtime.host, "to_host", counted_to_host(calls))
    monkeypatch.setattr(engine.strategies.sharded, "to_host", engine.runtime.host.to_host)
    monkeypatch.setattr(acco_loco.codecs, "_branch_free", lambda x: True)  # the accelerator's paths
    eng = Engine(tiny_model(0), EngineConfig(micro_batches=1, accumulation="fixed", max_steps=4, align=8,
                                             group_size=8, lr=1e-2, **kw), mse_loss)
    real, per_round = eng.strategy.run_round, []

    def run_round(ctx, req):
        calls.clear()
        with CountHostReads() as mode:
            result = real(ctx, req)
        per_round.append((list(mode.reads), len(calls), list(mode.from_host)))
        assert mode.set_numbers == [], mode.set_numbers
        return result
    eng.strategy.run_round = run_round
    history = eng.fit(worker_stream(0, 40))
    eng.close()
    assert len(history) == 4 and not any(h["skipped"] for h in history)
    assert per_round
    for reads, sanctioned, from_host in per_round:
        assert sanctioned == 2 and reads == ["cpu", "cpu"], (reads, sanctioned)
        # + the fused kernels' non-finite flag (CPU only, where a tensor from a number copies nothing)
        allowed = {**KNOWN_H2D, "engine/parallel/collectives.py:reduce": KNOWN_H2D.get("engine/parallel/collectives.py:reduce", 0)
                   + (1 if fused else 0)}
        assert all(from_host.count(site) <= allowed.get(site, 0) for site in from_host), from_host


def test_a_local_sgd_round_reads_the_device_once(monkeypatch):
    """local_sgd's round: its small all-reduce is its one (sanctioned) host read; the finiteness
    of the gradient travels in it as a device flag."""
    calls: list[int] = []
    monkeypatch.setattr(engine.runtime.host, "to_host", counted_to_host(calls))
    monkeypatch.setattr(engine.strategies.local_sgd, "to_host", engine.runtime.host.to_host)
    eng = Engine(tiny_model(0), EngineConfig(strategy="local_sgd", optimizer="sgd", momentum=0.0, micro_batches=1,
                                             accumulation="fixed", max_steps=4, align=8, lr=1e-2), mse_loss)
    real, per_round = eng.strategy.run_round, []

    def run_round(ctx, req):
        calls.clear()
        with CountHostReads() as mode:
            result = real(ctx, req)
        per_round.append((list(mode.reads), len(calls)))
        assert mode.set_numbers == [], mode.set_numbers
        return result
    eng.strategy.run_round = run_round
    history = eng.fit(worker_stream(0, 40))
    eng.close()
    assert len(history) == 4 and len(per_round) == 4
    assert all(reads == ["cpu"] and sanctioned == 1 for reads, sanctioned in per_round), per_round


def test_the_trap_sees_a_tensor_from_a_python_number():
    with CountHostReads() as mode:
        torch.tensor([3.0])
        torch.as_tensor(torch.ones(1))  # from a tensor: no host number
    assert len(mode.from_host) == 1


def test_the_trap_sees_a_number_written_into_an_element():
    small = torch.zeros(4)
    with CountHostReads() as mode:
        small[0] = 3.0  # on a GPU: a blocking copy from the host
        small[1] = torch.ones(())  # device to device: no host wait
        small[2:3].copy_(torch.ones(1))
    assert len(mode.set_numbers) == 1


def test_small_vector_copies_host_numbers_once_and_device_values_in_place():
    from engine.runtime.host import small_vector

    loss = torch.tensor(2.5, dtype=torch.float32)
    with CountHostReads() as mode:
        got = small_vector([3, 0.5, loss, True], torch.device("cpu"))
    assert mode.set_numbers == [] and mode.from_host == [] and mode.reads == []
    assert got.dtype == torch.float64 and got.tolist() == [3.0, 0.5, 2.5, 1.0]


def test_small_vector_on_a_gpu_copies_from_pinned_memory_without_waiting():
    """On (fake) CUDA: one host-to-device copy, from pinned memory, non-blocking (the device
    values' copies are device to device: a fake CUDA tensor cannot ``copy_`` on a CPU-only build,
    the CPU test above covers them)."""
    from engine.runtime.host import small_vector
    from tests.engine.fake_cuda import CUDA, fake_cuda

    with fake_cuda() as (_, shim):
        got = small_vector([1, 2.0, False], CUDA)
    assert got.device == CUDA and got.shape == (3,)
    assert shim.copies == [(CUDA, True, True)], shim.copies


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco"])
def test_an_outer_round_reads_the_device_through_to_host_only(strategy, monkeypatch):
    """The outer round (comm thread): its small all-reduce and the new theta_sync's finiteness
    are its host reads, both time-limited (``to_host``); no number is written into an element."""
    calls: list[int] = []
    monkeypatch.setattr(engine.runtime.host, "to_host", counted_to_host(calls))
    monkeypatch.setattr(engine.strategies.local_steps, "to_host", engine.runtime.host.to_host)
    eng = Engine(tiny_model(0), EngineConfig(strategy=strategy, **LOCAL, **OWN[strategy]), mse_loss)
    real, per_round = eng.strategy.run_round, []

    def run_round(ctx, req):
        calls.clear()
        with CountHostReads() as mode:
            result = real(ctx, req)
        per_round.append((list(mode.reads), len(calls), list(mode.set_numbers)))
        return result
    eng.strategy.run_round = run_round
    history = eng.fit(worker_stream(0, 40))
    eng.close()
    assert len(history) == 6 and per_round
    for reads, sanctioned, set_numbers in per_round:
        assert reads == ["cpu"] * sanctioned and sanctioned == 2 and set_numbers == [], (reads, sanctioned)


LOCAL = dict(micro_batches=2, accumulation="fixed", max_steps=6, align=8, lr=1e-2, weight_decay=0.1,
             inner_steps=3, outer_lr=0.7, max_grad_norm=0.05)
OWN = {"diloco": dict(outer_momentum=0.9), "sparseloco": dict(topk_chunk=32, topk_density=0.25)}


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco"])
def test_an_inner_step_reads_the_device_once(strategy, fused, monkeypatch):
    def run(device_path: bool):
        calls: list[int] = []
        monkeypatch.setattr(engine.runtime.host, "to_host", counted_to_host(calls))
        monkeypatch.setattr(engine.strategies.local_steps, "to_host", engine.runtime.host.to_host)
        monkeypatch.setattr(engine.strategies.inner_step, "to_host", engine.runtime.host.to_host)  # the device path's
        monkeypatch.setattr(engine.strategies.local_steps, "device_side", lambda t: device_path)
        eng = Engine(tiny_model(0), EngineConfig(strategy=strategy, **LOCAL, **OWN[strategy]), mse_loss)
        real, per_step = eng.loop.inner_step, []

        def inner_step():
            calls.clear()
            with CountHostReads() as mode:
                entry = real()
            per_step.append((list(mode.reads), len(calls), list(mode.from_host)))
            assert mode.set_numbers == [], mode.set_numbers
            return entry
        eng.loop.inner_step = inner_step
        history = eng.fit(worker_stream(0, 40))
        eng.close()
        assert len(history) == 6 and not any(h["skipped"] for h in history)
        return per_step, history, flat_params(eng.model)

    per_step, history, params = run(True)
    assert len(per_step) == 6
    for reads, sanctioned, from_host in per_step:
        assert sanctioned == 1 and reads == ["cpu"] and from_host == [], (reads, sanctioned, from_host)
    assert any(h["grad_norm"] > LOCAL["max_grad_norm"] for h in history)  # clipping happened
    _, cpu_history, cpu_params = run(False)
    assert torch.equal(params, cpu_params)  # the same bits as the CPU path
    assert [(h["loss"], h["grad_norm"]) for h in history] == [(h["loss"], h["grad_norm"]) for h in cpu_history]


def test_local_steps_match_the_reference_with_the_kernels_off(monkeypatch):
    """tests/engine/test_local_steps.py's reference check (gloo, world 2, diloco and sparseloco,
    with and without overlap) on the torch path a GPU runs: the spawned workers inherit the switch."""
    from tests.engine import test_local_steps

    monkeypatch.setenv("ACCO_LOCO_KERNELS", "0")
    test_local_steps.test_one_and_three_rounds_match_the_reference(2)
