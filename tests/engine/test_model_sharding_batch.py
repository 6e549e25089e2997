"""The global batch under model_sharding='node': a node's ranks run in lockstep (FSDP2's
collectives in every forward and backward), so a round's micro-batches are dealt to nodes in
units of one per rank (engine/batch/accumulation.py), by the node's slowest rank under speed shares; and
accumulation 'grow', which lets each rank end its round alone, is refused."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.batch.accumulation import Accumulation
from engine.parallel.local_group import spawn
from engine.strategies import strategy_class
from tests.engine.test_model_sharding import sharded_tiny, whole_params
from tests.tiny import mse_loss, rel_err, worker_stream

STEPS = 4
TOTAL = 12  # acco: 6 micro-batches per round, 3 units of 2 over 2 nodes, so nodes get 2 and 1 in turn


def _accumulation(total: int, lockstep: int, world: int = 4, balance: str = "equal") -> Accumulation:
    cfg = EngineConfig(strategy="acco", global_micro_batches=total, balance=balance)
    return Accumulation(cfg, strategy_class("acco").plan, 0, world, paced=False, lockstep=lockstep)


def test_a_nodes_ranks_get_the_same_share_every_round():
    acc = _accumulation(TOTAL, lockstep=2)
    for r in range(4):
        shares = acc.shares(r)
        assert sum(shares) == TOTAL // 2 and shares[0] == shares[1] and shares[2] == shares[3]
    assert acc.shares(0) == [2, 2, 1, 1] and acc.shares(1) == [1, 1, 2, 2]  # the remainder rotates by node
    assert _accumulation(TOTAL, lockstep=1).shares(1) == [1, 2, 2, 1]  # per rank, as without sharding


def test_speed_shares_go_by_the_nodes_slowest_rank():
    acc = _accumulation(16, lockstep=2, balance="speed")
    acc.on_round([0.1, 0.3, 0.1, 0.1], 0.0)  # node 0's second rank is 3x slower: the node is
    shares = acc.shares(2)
    assert shares == [1, 1, 3, 3], shares


def test_a_round_that_does_not_split_into_whole_units_is_refused():
    with pytest.raises(ValueError, match="must be a multiple of 2; use a multiple of 4"):
        _accumulation(10, lockstep=2)  # acco's rounds take 5 and 5
    with pytest.raises(ValueError, match="use accumulation='fixed'"):
        EngineConfig(strategy="acco", model_sharding="node", accumulation="grow")


def _global(rank: int, world: int):
    from engine import GlobalBatches

    out = {}
    source = GlobalBatches(worker_stream(7, TOTAL * (STEPS + 1)))
    for sharding in ("node", "none"):
        cfg = EngineConfig(strategy="acco", lr=1e-2, global_micro_batches=TOTAL, max_steps=STEPS, align=8,
                           topology="two_level", model_sharding=sharding)
        engine = Engine(sharded_tiny(), cfg, mse_loss)
        history = engine.fit(source)
        out[sharding] = {"params": whole_params(engine.model), "counts": engine.round_counts,
                         "samples": [h["samples"] for h in history]}
        engine.close()
    return out


def test_the_global_batch_under_node_sharding_is_the_unsharded_runs():
    """2 nodes x 2 ranks, acco, 12 global micro-batches a step: the sharded run deals 2 and 1 per
    rank by node, the unsharded run 2, 2, 1, 1 by rank; every round sums the same micro-batches,
    so the parameters agree within float32 summation order."""
    runs = spawn(_global, 4, env={"LOCAL_WORLD_SIZE": "2"})
    for run in runs:
        assert run["node"]["samples"] == run["none"]["samples"] == [TOTAL * 4] * STEPS
        assert torch.equal(run["node"]["params"], runs[0]["node"]["params"])
        assert rel_err(run["node"]["params"], run["none"]["params"]) < 1e-6
    assert runs[0]["node"]["counts"] == runs[1]["node"]["counts"]  # node 0's ranks in lockstep
    assert runs[0]["node"]["counts"] != runs[2]["node"]["counts"]
