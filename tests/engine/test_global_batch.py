"""The user's global batch: every step takes exactly global_micro_batches micro-batches, whatever
the strategy's rounds and the workers' speeds, and the update equals the count-weighted float64
reference of the micro-batches each worker actually ran."""

from __future__ import annotations

import time

import pytest
import torch

from acco_loco.batch import equal_shares, round_targets
from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import Reference, flat_params, mse_loss, rel_err, tiny_model, worker_stream

STEPS = 6
MICRO_BATCH = 4  # samples per micro-batch of worker_stream


def _fit(rank: int, cfg: EngineConfig, loss_fn=mse_loss) -> dict:
    engine = Engine(tiny_model(0), cfg, loss_fn)
    history = engine.fit(worker_stream(rank, 2000))
    _, meta = engine.state_dict()
    engine.close()
    return {"params": flat_params(engine.model), "round_counts": engine.round_counts,
            "global": [h["global_micro_batches"] for h in history],
            "samples": [h["samples"] for h in history], "speeds": meta["accumulation"].get("speeds", {}).get("seconds")}


def _equal(rank, world, strategy, total):
    cfg = EngineConfig(strategy=strategy, lr=1e-2, global_micro_batches=total, max_steps=STEPS, align=8)
    return _fit(rank, cfg)


def _check_against_reference(per_rank: list[dict], strategy: str, world: int) -> None:
    for r in range(1, world):
        assert torch.equal(per_rank[r]["params"], per_rank[0]["params"])
    counts = [p["round_counts"] for p in per_rank]
    ref = Reference(tiny_model(0), [worker_stream(r, 2000) for r in range(world)], k=1, lr=1e-2,
                    round_counts=counts, weight_decay=0.0).run(strategy, STEPS)
    assert rel_err(per_rank[0]["params"], ref[-1]) < 1e-6


@pytest.mark.parametrize("strategy, world, total", [("zero1", 3, 7), ("dpu", 2, 5), ("acco", 3, 7),
                                                    ("acco", 2, 4)])
def test_every_step_takes_the_global_batch(strategy, world, total):
    per_rank = spawn(_equal, world, strategy, total)
    rounds = 2 if strategy == "acco" else 1
    targets = round_targets(total, rounds)
    for rank, res in enumerate(per_rank):
        assert res["global"] == [total] * STEPS
        assert res["samples"] == [total * MICRO_BATCH] * STEPS  # the batch of every step, in samples
        for i, n in enumerate(res["round_counts"]):
            assert n == equal_shares(targets[i % rounds], world, i)[rank]
    _check_against_reference(per_rank, strategy, world)


def test_acco_and_zero1_take_the_same_samples_per_step():
    """The lesson of the last benchmark: at the same setting both run the user's batch."""
    acco, zero1 = spawn(_equal, 2, "acco", 8), spawn(_equal, 2, "zero1", 8)
    assert acco[0]["samples"] == zero1[0]["samples"] == [8 * MICRO_BATCH] * STEPS


SLOW_RANK = 2


def _speed(rank, world, strategy):
    def loss_fn(model, batch):
        time.sleep(0.03 if rank == SLOW_RANK else 0.003)
        return mse_loss(model, batch)

    cfg = EngineConfig(strategy=strategy, lr=1e-2, global_micro_batches=24, balance="speed",
                       max_steps=STEPS, align=8)
    return _fit(rank, cfg, loss_fn)


@pytest.mark.parametrize("strategy", ["acco", "zero1"])
def test_speed_balance_gives_fast_workers_more_at_the_same_global_batch(strategy):
    per_rank = spawn(_speed, 3, strategy)
    for res in per_rank:
        assert res["global"] == [24] * STEPS  # the batch never grows
        assert res["speeds"] == per_rank[0]["speeds"]  # every rank holds the same estimate
    late = [sum(p["round_counts"][-3:]) for p in per_rank]  # after the first measurements
    slow, fast = late[SLOW_RANK], [late[r] for r in range(3) if r != SLOW_RANK]
    assert min(fast) >= 3 * slow, late
    assert per_rank[0]["speeds"][SLOW_RANK] > 3 * max(per_rank[0]["speeds"][r] for r in range(3) if r != SLOW_RANK)
    _check_against_reference(per_rank, strategy, 3)


def _too_small(rank, world):
    try:
        Engine(tiny_model(0), EngineConfig(strategy="acco", global_micro_batches=3, align=8))
    except ValueError as exc:
        return str(exc)
    return None


def test_a_global_batch_below_one_micro_batch_per_worker_and_round_is_refused():
    message = spawn(_too_small, 2)[0]
    assert message is not None and message.startswith("global_micro_batches=3 is too small for 2 workers: "
                                                       "acco splits each step's batch over 2 rounds")
    assert "at least 4 are needed" in message
