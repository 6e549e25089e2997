"""The floor on micro-batches per round that the engine derives from the comm side's CPU cost.

The rule itself (engine/batch/pacing.py) is checked on numbers; the engine is checked end to end in
real gloo groups whose comm side burns a known amount of CPU per round.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from engine import Engine, EngineConfig
from engine.batch.pacing import Pacer, min_micro_batches
from engine.parallel.comm import Comm
from engine.parallel.local_group import spawn
from engine.runtime.cpu_memory import keep_freed_memory
from tests.tiny import mse_loss, tiny_model, worker_stream


def test_rule_keeps_comm_cpu_under_the_overhead_fraction():
    # c = 0.1 s per round, t = 0.5 s per micro-batch, f = 0.15: ceil(0.1 / 0.075) = 2
    assert min_micro_batches(0.1, 0.5, 0.15, 1, None) == 2
    for c, t, f in [(0.1, 0.5, 0.15), (0.02, 0.01, 0.1), (0.3, 0.7, 0.05), (0.001, 1.0, 0.2)]:
        m = min_micro_batches(c, t, f, 1, None)
        assert c <= f * m * t * (1 + 1e-9) and (m == 1 or c > f * (m - 1) * t)
    assert min_micro_batches(0.02, 0.01, 0.1, 1, 6) == 6  # the cap wins
    assert min_micro_batches(0.001, 1.0, 0.2, 3, None) == 3  # never below micro_batches
    assert min_micro_batches(0.1, 0.5, 0.0, 1, None) == 1  # off
    assert min_micro_batches(0.0, 0.5, 0.15, 2, None) == 2  # nothing measured yet


def test_pacer_ignores_the_first_round_and_follows_medians():
    p = Pacer(0.1, 1, 8, window=4)
    for _ in range(4):
        p.on_micro_batch(0.1)
    assert p.on_round(5.0) == 1  # the warm-up round is not counted
    assert p.on_round(0.05) == 5  # ceil(0.05 / 0.01)
    for _ in range(4):
        p.on_round(0.02)
    assert p.current == 2


def test_keep_freed_memory_applies_on_glibc():
    assert keep_freed_memory() is True  # Linux CI; False would mean mallopt was refused


BURN_S = 0.03  # comm-side CPU per reduce-scatter


def _burn_cpu(seconds: float) -> None:
    a = torch.randn(96, 96)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        a = torch.tanh(a @ a)  # releases the GIL, uses this thread's CPU


def _rounds(rank: int, world: int, overhead: float) -> list[int]:
    real = getattr(Comm, "_fast_reduce_scatter_sum", Comm.reduce_scatter_sum)

    def costly_reduce_scatter(self, full, out=None):
        _burn_cpu(BURN_S)
        return real(self, full, out)

    Comm._fast_reduce_scatter_sum = real
    Comm.reduce_scatter_sum = costly_reduce_scatter

    def loss_fn(model, batch):
        time.sleep(0.01)  # 10 ms of "compute" that leaves the CPU to the comm side
        return mse_loss(model, batch)

    # the cap sits far above both the floor (~19) and the unpaced rounds (~3-4, more under load)
    cfg = EngineConfig(strategy="acco", lr=1e-2, accumulation="grow", micro_batches=1, max_micro_batches=32, max_steps=8,
                       align=8, max_round_overhead=overhead)
    engine = Engine(tiny_model(0), cfg, loss_fn)
    engine.fit(worker_stream(rank, 5000))
    engine.close()
    return {"counts": engine.round_counts, "comm_cpu": engine.comm_cpu_s,
            "floor": [h["min_micro_batches"] for h in engine.history]}


def _both(rank, world):
    return {f: _rounds(rank, world, f) for f in (0.0, 0.15)}


@pytest.mark.timeout(300)
def test_engine_raises_the_floor_when_rounds_cost_cpu():
    for per_rank in spawn(_both, 2):
        off, on = per_rank[0.0], per_rank[0.15]
        # measured: at least the burnt CPU per round (after the first)
        assert statistics.median(on["comm_cpu"][1:]) >= 0.8 * BURN_S
        # c / (f t) = 0.03 / (0.15 * ~0.0105) ~ 19 (c >= 0.024 and t <= 0.013 keep it >= 13); the
        # burn is thread CPU time, so a loaded machine stretches its wall time, not the floor
        assert on["floor"][-1] >= 13 and all(c >= 13 for c in on["counts"][3:-1])
        # without the floor a round ends as soon as the one in flight is done: ~3-4 micro-batches
        # on a quiet machine; the burn's wall time (and so the count) grows with the load, the
        # floor does not: 1 / f = 6.7x apart when quiet, still apart at 3x load
        assert all(f == 1 for f in off["floor"])
        assert statistics.median(off["counts"][2:]) * 1.5 <= statistics.median(on["counts"][3:-1])
