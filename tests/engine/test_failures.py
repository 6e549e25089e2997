"""A worker dies or stalls: the others stop with an error naming it, within the timeout."""

from __future__ import annotations

import os
import signal
import time

import pytest

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn, spawn_collect
from tests.tiny import mse_loss, tiny_model, worker_stream

TIMEOUT_S = 8.0


def _cfg(root, **kw):
    return EngineConfig(strategy="acco", lr=1e-2, micro_batches=2, accumulation="fixed", max_steps=1000,
                        align=8, timeout_s=TIMEOUT_S, heartbeat_s=0.5, checkpoint_dir=root,
                        checkpoint_every=3, **kw)


def doomed_worker(rank: int, world: int, root: str, victim: int, mode: str):
    count = [0]

    def loss_fn(model, batch):
        count[0] += 1
        time.sleep(0.01)
        if rank == victim and count[0] == 40:  # mid-round: a round is in flight while acco computes
            with open(f"{root}.failed_at", "w") as f:
                f.write(repr(time.time()))
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                time.sleep(2 * TIMEOUT_S)  # stalled, alive; fails on its own afterwards
        return mse_loss(model, batch)

    engine = Engine(tiny_model(0), _cfg(root), loss_fn)
    try:
        engine.fit(worker_stream(rank, 5000))
    except Exception as exc:
        raise RuntimeError(f"detected_at={time.time()!r} after step {engine.step}: {exc}") from exc
    return "finished"


def load_last(rank: int, world: int, root: str):
    engine = Engine.load(root, tiny_model(7), None, mse_loss)
    step = engine.step
    engine.fit(worker_stream(rank, 100), steps=2)  # and it trains on
    engine.close()
    return step


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_lost_worker_is_named_and_checkpoint_survives(mode, tmp_path):
    root = str(tmp_path / "run")
    victim = 2
    start = time.monotonic()
    out = spawn_collect(doomed_worker, 3, root, victim, mode, timeout=8 * TIMEOUT_S)
    survivors = [r for r in range(3) if r != victim]
    for r in survivors:
        assert out[r]["exitcode"] not in (0, None), out[r]
        assert out[r]["status"] == "error"
        assert f"rank(s) [{victim}]" in out[r]["out"], out[r]["out"]
        assert ("lost" if mode == "kill" else "stalled") in out[r]["out"]
        # named within the configured timeout of the failure (plus the diagnosis)
        detected = float(out[r]["out"].split("detected_at=")[1].split()[0])
        failed = float(open(f"{root}.failed_at").read())
        assert 0 < detected - failed < TIMEOUT_S + 3, detected - failed
    assert time.monotonic() - start < 7 * TIMEOUT_S
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "run").iterdir())
    steps = spawn(load_last, 3, root)
    assert steps[0] >= 3 and steps[0] % 3 == 0 and len(set(steps)) == 1
