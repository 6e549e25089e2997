"""One global stream dealt out by the engine (engine/batch/dealing.py): step t trains on global
micro-batches [t G, (t + 1) G) whatever the shares, so equal and speed shares train on the same
samples, checked against the float64 reference of the micro-batches each worker was dealt."""

from __future__ import annotations

import time

import pytest
import torch

from acco_loco.batch import round_targets
from engine import Engine, EngineConfig, GlobalBatches
from engine.batch.dealing import dealt_index, round_offset
from engine.parallel.local_group import spawn
from tests.tiny import Reference, flat_params, mse_loss, rel_err, tiny_model, worker_stream

STEPS = 6
TOTAL = 15  # global micro-batches per step: uneven over 2 rounds (7 + 8) and 3 workers
SLOW_RANK = 1


def global_stream(n: int = 400) -> list:
    return worker_stream(7, n)  # one stream for everybody: rank 7's is just some fixed data


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_every_step_deals_its_own_block_of_the_stream_once(rounds):
    """Any shares, any round count: the indices of step t are exactly [t G, (t + 1) G)."""
    gen = torch.Generator().manual_seed(rounds)
    for step in range(4):
        dealt = []
        for within, total in enumerate(round_targets(TOTAL, rounds)):
            cuts = sorted(torch.randint(0, total + 1, (2,), generator=gen).tolist())
            shares = [cuts[0], cuts[1] - cuts[0], total - cuts[1]]
            r = step * rounds + within
            assert round_offset(r, TOTAL, rounds) == step * TOTAL + sum(round_targets(TOTAL, rounds)[:within])
            for rank, share in enumerate(shares):
                dealt += [dealt_index(r, p, rank, shares, TOTAL, rounds) for p in range(share)]
        assert dealt == list(range(step * TOTAL, (step + 1) * TOTAL))


def _fit(rank, world, strategy, balance):
    def loss_fn(model, batch):  # rank SLOW_RANK is 10x slower: speed shares move work off it
        time.sleep(0.02 if (balance == "speed" and rank == SLOW_RANK) else 0.002)
        return mse_loss(model, batch)

    cfg = EngineConfig(strategy=strategy, lr=1e-2, global_micro_batches=TOTAL, balance=balance,
                       max_steps=STEPS, align=8)
    engine = Engine(tiny_model(0), cfg, loss_fn)
    history = engine.fit(GlobalBatches(global_stream()))
    engine.close()
    return {"params": flat_params(engine.model), "round_counts": engine.round_counts,
            "samples": [h["samples"] for h in history]}


def _dealt_streams(per_rank: list[dict], rounds: int) -> list[list]:
    """What each worker was dealt, rebuilt from the shares every rank ran (its round counts)."""
    data, world = global_stream(), len(per_rank)
    streams = [[] for _ in range(world)]
    for r in range(len(per_rank[0]["round_counts"])):
        shares = [p["round_counts"][r] for p in per_rank]
        for w in range(world):
            streams[w] += [data[dealt_index(r, i, w, shares, TOTAL, rounds)] for i in range(shares[w])]
    return streams


@pytest.mark.parametrize("strategy", ["zero1", "acco"])
def test_speed_shares_train_on_the_same_samples_as_equal_shares(strategy):
    rounds = 2 if strategy == "acco" else 1
    equal, speed = spawn(_fit, 3, strategy, "equal"), spawn(_fit, 3, strategy, "speed")
    slow_late = sum(speed[SLOW_RANK]["round_counts"][-3:])
    fast_late = min(sum(speed[r]["round_counts"][-3:]) for r in range(3) if r != SLOW_RANK)
    assert fast_late >= 2 * slow_late  # the shares did move
    assert speed[0]["samples"] == equal[0]["samples"] == [TOTAL * 4] * STEPS
    for run in (equal, speed):
        counts = [p["round_counts"] for p in run]
        ref = Reference(tiny_model(0), _dealt_streams(run, rounds), k=1, lr=1e-2, round_counts=counts,
                        weight_decay=0.0).run(strategy, STEPS)
        assert rel_err(run[0]["params"], ref[-1]) < 1e-6
    # same samples in the same steps: only the float32 summation order differs
    assert rel_err(speed[0]["params"], equal[0]["params"]) < 1e-5


def _resume(rank, world, root):
    cfg = EngineConfig(strategy="acco", lr=1e-2, global_micro_batches=TOTAL, max_steps=STEPS, align=8)
    data = GlobalBatches(global_stream())
    straight = Engine(tiny_model(0), cfg, mse_loss)
    straight.fit(data)
    straight.close()
    first = Engine(tiny_model(0), cfg, mse_loss)
    first.fit(data, steps=STEPS // 2)
    first.save(root)
    first.close()
    model = tiny_model(5)
    resumed = Engine.load(root, model, cfg, mse_loss)
    resumed.fit(data)  # the same stream again: the engine knows where it is
    resumed.close()
    return {"straight": flat_params(straight.model), "resumed": flat_params(model)}


def test_a_resumed_run_is_dealt_where_it_stopped(tmp_path):
    for res in spawn(_resume, 2, str(tmp_path / "ckpt")):
        assert torch.equal(res["straight"], res["resumed"])


def _short_data(rank, world):
    cfg = EngineConfig(strategy="zero1", lr=1e-2, global_micro_batches=4, max_steps=STEPS, align=8)
    engine = Engine(tiny_model(0), cfg, mse_loss)
    history = engine.fit(GlobalBatches(global_stream(10)))  # 2.5 steps of data
    engine.close()
    return [h["global_micro_batches"] for h in history]


def test_a_global_stream_that_ends_stops_every_rank_at_the_same_step():
    """The last step takes what is left (micro-batches 8 and 9, both dealt to rank 0), as with
    per-worker streams, and says so in its history."""
    assert spawn(_short_data, 2) == [[4, 4, 2], [4, 4, 2]]


def _refusals(rank, world):
    out = []
    for cfg in (EngineConfig(strategy="zero1", micro_batches=2, max_steps=2, align=8),
                EngineConfig(strategy="diloco", global_micro_batches=2, max_steps=2, align=8)):
        engine = Engine(tiny_model(0), cfg, mse_loss)
        try:
            engine.fit(GlobalBatches(global_stream(20)))
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
        engine.close()
    return out


def test_global_batches_without_a_global_batch_or_with_local_steps_are_refused():
    no_global, local = spawn(_refusals, 1)[0]
    assert no_global is not None and "set global_micro_batches" in no_global
    assert local is not None and "takes local steps" in local and "its own micro-batches" in local
    with pytest.raises(TypeError, match="callable index -> micro-batch or an indexable"):
        GlobalBatches(42)
