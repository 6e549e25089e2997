"""The user's collectives beside the engine's: the default process group is the user's (and a
Trainer's), the engine's rounds run on groups of its own (engine/parallel/dims.py). A user loop
that all-reduces a metric on the default group after every feed, with an ACCO or dpu round in
flight on the comm thread, must neither hang nor change the trajectory: each run is compared
with the same run without the user's collectives, bit for bit, and the ranks with each other."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

STEPS = 4


def _run(rank, world, strategy, codec, with_user_collectives):
    cfg = EngineConfig(strategy=strategy, codec=codec, lr=1e-2, micro_batches=2, max_steps=STEPS, align=8,
                       timeout_s=60)
    engine = Engine(tiny_model(), cfg, mse_loss)
    metrics, inflight_seen = [], 0
    for batch in worker_stream(rank, 4 * STEPS):
        engine.feed(batch)
        inflight_seen += engine.loop.inflight is not None
        if with_user_collectives:  # a logger's metric: on the default group, every micro-batch
            metric = torch.tensor([float(engine.consumed)])
            dist.all_reduce(metric)
            metrics.append(float(metric))
        if engine.done:
            break
    else:
        engine.finish()
    engine.close()
    return {"params": flat_params(engine.model), "losses": [h["loss"] for h in engine.history],
            "metrics": metrics, "inflight_seen": inflight_seen}


@pytest.mark.parametrize("strategy,codec", [("acco", "loco4"), ("dpu", "none"), ("zero1", "none")])
def test_a_user_all_reduce_after_every_feed_neither_hangs_nor_changes_the_run(strategy, codec):
    with_user = spawn(_run, 2, strategy, codec, True, timeout=240)
    without = spawn(_run, 2, strategy, codec, False, timeout=240)
    for r in range(2):
        assert torch.equal(with_user[r]["params"], without[r]["params"])
        assert with_user[r]["losses"] == without[r]["losses"] and len(without[r]["losses"]) == STEPS
    assert torch.equal(with_user[0]["params"], with_user[1]["params"])  # replicas bit-identical
    assert with_user[0]["metrics"] == with_user[1]["metrics"] and with_user[0]["metrics"]
    if strategy != "zero1":  # the user's all-reduce ran with a round in flight on the comm thread
        assert with_user[0]["inflight_seen"] > 0
