"""One of 3 workers is slow: in adaptive mode the fast ones accumulate more, and the committed
update equals the count-weighted float64 reference built from the counts each worker used."""

from __future__ import annotations

import time

import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import Reference, flat_params, mse_loss, rel_err, tiny_model, worker_stream

STEPS = 6
SLOW_RANK, SLOW_S = 2, 0.06


def slow_loss(rank):
    def loss_fn(model, batch):
        if rank == SLOW_RANK:
            time.sleep(SLOW_S)
        else:
            time.sleep(0.002)
        return mse_loss(model, batch)
    return loss_fn


def run_adaptive(rank: int, world: int, strategy: str):
    cfg = EngineConfig(strategy=strategy, lr=1e-2, micro_batches=1, accumulation="grow",
                       max_micro_batches=40, max_steps=STEPS, align=8)
    engine = Engine(tiny_model(0), cfg, slow_loss(rank))
    history = engine.fit(worker_stream(rank, 2000))
    engine.close()
    return {"params": flat_params(engine.model), "round_counts": engine.round_counts,
            "micro_batches": sum(h["micro_batches"] for h in history),
            "global": [h["global_micro_batches"] for h in history]}


def _both(rank, world):
    return {s: run_adaptive(rank, world, s) for s in ("acco", "dpu")}


def test_fast_workers_accumulate_more_and_weights_are_counts():
    results = spawn(_both, 3)
    for strategy in ("acco", "dpu"):
        per_rank = [r[strategy] for r in results]
        slow = per_rank[SLOW_RANK]["micro_batches"]
        fast = [per_rank[r]["micro_batches"] for r in range(3) if r != SLOW_RANK]
        assert min(fast) >= 2 * slow, (strategy, fast, slow)
        for r in range(1, 3):
            assert torch.equal(per_rank[r]["params"], per_rank[0]["params"])
        # replay the exact counts through the float64 reference
        counts = [per_rank[r]["round_counts"] for r in range(3)]
        assert len({len(c) for c in counts}) == 1  # every rank submitted the same rounds
        streams = [worker_stream(r, 2000) for r in range(3)]
        ref = Reference(tiny_model(0), streams, k=1, lr=1e-2, round_counts=counts,
                        weight_decay=0.0).run(strategy, STEPS)
        assert rel_err(per_rank[0]["params"], ref[-1]) < 1e-6
        # the reported global count is every worker's micro-batches of the step's rounds
        assert per_rank[0]["global"][-1] == sum(c[-1] for c in counts) + (
            sum(c[-2] for c in counts) if strategy == "acco" else 0)
