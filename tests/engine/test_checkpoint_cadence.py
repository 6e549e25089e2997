"""checkpoint_every_s: a time-based checkpoint cadence that every rank agrees on without a
collective between saves (engine/checkpoint/periodic.py ``Cadence``): the first after the first step, then
every ~N seconds in steps measured on rank 0's clock, the same steps on every rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import mse_loss, tiny_model, worker_stream

STEPS, K = 24, 2


def _run(rank: int, world: int, root: str, strategy: str) -> list[int]:
    def slow_loss(model, batch):  # 25 ms a micro-batch: the cadence has something to measure
        time.sleep(0.025)
        return mse_loss(model, batch)

    extra = {"inner_steps": 3} if strategy == "diloco" else {}
    cfg = EngineConfig(strategy=strategy, micro_batches=K, max_steps=STEPS, align=8, lr=1e-2,
                       checkpoint_dir=f"{root}/{strategy}", checkpoint_every_s=0.5, **extra)
    engine = Engine(tiny_model(0), cfg, mse_loss if rank else slow_loss)
    engine.fit(worker_stream(rank, 2 * K * (STEPS + 1)))  # acco: two rounds a step
    engine.close()
    return sorted(int(p.name.split("-")[1]) for p in Path(f"{root}/{strategy}").glob("step-*") if p.is_dir())


@pytest.mark.parametrize("strategy", ["acco", "diloco"])
def test_time_based_checkpoints_land_on_the_same_steps_everywhere(tmp_path, strategy):
    saved = spawn(_run, 2, str(tmp_path), strategy)
    assert saved[0] == saved[1]  # every rank saved at the same steps (one shared directory here)
    steps = saved[0]
    assert steps[0] == 1  # the first right after the first step
    assert 3 <= len(steps) <= STEPS // 2, steps  # ~0.5 s apart at ~0.05-0.1 s a step: every few steps
    gaps = sorted(b - a for a, b in zip(steps, steps[1:]))
    assert gaps[len(gaps) // 2] >= 2, steps  # measured from the step time: not every step
    latest = (tmp_path / strategy / "latest").read_text().strip()
    assert latest == f"step-{steps[-1]:08d}"


def test_checkpoint_every_s_needs_a_directory_and_a_positive_number():
    with pytest.raises(ValueError, match="checkpoint_every_s is set but checkpoint_dir is not"):
        EngineConfig(checkpoint_every_s=60)
    with pytest.raises(ValueError, match="checkpoint_every_s must be None .by steps only. or a finite number > 0"):
        EngineConfig(checkpoint_every_s=float("inf"), checkpoint_dir="x")
