"""Host reads of device values per round, counted without a GPU: every read a round makes must go
through engine/host.py's ``to_host`` (on a GPU each one waits for the device), and a round makes
exactly two: the small all-reduce's counts and flags, and whether the gathered parameters are
finite. A stray ``.item()``, ``float(t)``, ``bool(t)`` or ``.cpu()`` anywhere in a round fails
this test."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import acco_loco.codecs
import engine.host
import engine.strategies.sharded
from engine import Engine, EngineConfig
from tests.tiny import mse_loss, tiny_model, worker_stream

HOST_READS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


class HostTensor(torch.Tensor):
    """What to_host returned: reading it on the host costs nothing more."""


class CountHostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and args and not isinstance(args[0], HostTensor):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


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
def test_a_round_reads_the_device_twice(kw, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(engine.host, "to_host", counted_to_host(calls))
    monkeypatch.setattr(engine.strategies.sharded, "to_host", engine.host.to_host)
    monkeypatch.setattr(acco_loco.codecs, "_branch_free", lambda x: True)  # the accelerator's paths
    eng = Engine(tiny_model(0), EngineConfig(micro_batches=1, accumulation="fixed", max_steps=4, align=8,
                                             group_size=8, lr=1e-2, **kw), mse_loss)
    real, per_round = eng.strategy.run_round, []

    def run_round(ctx, req):
        calls.clear()
        with CountHostReads() as mode:
            result = real(ctx, req)
        per_round.append((list(mode.reads), len(calls)))
        return result
    eng.strategy.run_round = run_round
    history = eng.fit(worker_stream(0, 40))
    eng.close()
    assert len(history) == 4 and not any(h["skipped"] for h in history)
    assert per_round
    for reads, sanctioned in per_round:
        assert sanctioned == 2 and reads == ["cpu", "cpu"], (reads, sanctioned)
