"""The user's own loop (Engine.feed per micro-batch, Engine.finish at the end of the data)
against Engine.fit, which is built on it: in a gloo group of 2, the same parameters bit for bit
and the same losses, for a sharded strategy (zero1), an overlapped one (acco) and a local-step
one (diloco); also when one worker's data runs out first. GlobalBatches dealing through fit is
covered by tests/engine/test_dealing.py and test_global_batch.py."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, GlobalBatches, StepResult
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

K, STEPS = 2, 7
MODES = {
    "zero1": {"strategy": "zero1"},
    "acco": {"strategy": "acco"},
    "diloco": {"strategy": "diloco", "inner_steps": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "outer_overlap": True},
}


def user_loop(engine: Engine, batches) -> list[StepResult]:
    """A loop the user keeps: their batches, their logging, the engine's feed/finish."""
    results = []
    for batch in batches:
        result = engine.feed(batch)
        if result is not None:
            results.append(result)
        if engine.done:
            break
    else:
        results += engine.finish()
    return results


def run(rank: int, world: int, kw: dict, batches_per_rank: list[int] | None) -> dict:
    """fit, then the user's loop; ``batches_per_rank`` None: one GlobalBatches stream dealt out."""
    out = {}
    for how in ("fit", "feed"):
        cfg = EngineConfig(**{"micro_batches": K, "accumulation": "fixed", "max_steps": STEPS, "lr": 1e-2,
                              "align": 8, **kw})
        engine = Engine(tiny_model(0), cfg, mse_loss)
        if batches_per_rank is None:
            data = GlobalBatches(worker_stream(0, 4 * K * (STEPS + 2)))
        else:
            data = worker_stream(rank, batches_per_rank[rank])
        if how == "fit":
            history = engine.fit(data)
            results = None
        else:
            results = user_loop(engine, engine.deal(data))
            history = list(engine.history)
        out[how] = {"params": flat_params(engine.model), "history": history, "results": results,
                    "consumed": engine.consumed, "done": engine.done}
        engine.close()
    return out


def _same_runs(res: dict) -> None:
    fit, feed = res["fit"], res["feed"]
    assert torch.equal(fit["params"], feed["params"])
    assert [h["loss"] for h in fit["history"]] == [h["loss"] for h in feed["history"]]
    assert [h["step"] for h in fit["history"]] == [h["step"] for h in feed["history"]]
    assert fit["consumed"] == feed["consumed"]
    # every committed step came back from feed/finish once, with its history entry's fields
    assert [r.as_dict() for r in feed["results"]] == feed["history"]
    assert feed["done"]


@pytest.mark.parametrize("mode", list(MODES))
def test_user_loop_matches_fit_bit_for_bit(mode):
    per_rank = [2 * K * (STEPS + 2)] * 2  # more data than max_steps needs (acco: two rounds a step)
    results = spawn(run, 2, MODES[mode], per_rank)
    for res in results:
        _same_runs(res)
        assert len(res["fit"]["history"]) == STEPS
    if mode != "diloco":  # sharded: every replica holds the same parameters
        assert torch.equal(results[0]["feed"]["params"], results[1]["feed"]["params"])


@pytest.mark.parametrize("mode", ["zero1", "acco"])
def test_user_loop_matches_fit_when_one_workers_data_runs_out(mode):
    per_rank = [K * (STEPS + 2), 3 * K + 1]  # rank 1 runs out during step 4
    results = spawn(run, 2, MODES[mode], per_rank)
    for res in results:
        _same_runs(res)
        assert len(res["fit"]["history"]) < STEPS  # both ranks stopped early, at the same step
    assert results[0]["fit"]["history"][-1]["step"] == results[1]["fit"]["history"][-1]["step"]


def test_user_loop_deals_a_global_stream_like_fit():
    # equal shares (speed shares follow measured times, so two runs may split a round differently)
    kw = {"strategy": "acco", "micro_batches": 1, "global_micro_batches": 6, "balance": "equal"}
    results = spawn(run, 2, kw, None)
    for res in results:
        _same_runs(res)
        assert len(res["fit"]["history"]) == STEPS
        assert all(h["global_micro_batches"] == 6 for h in res["feed"]["history"])
    assert [res["feed"]["consumed"] for res in results] == [res["fit"]["consumed"] for res in results]


def test_feed_after_the_horizon_says_what_to_do():
    engine = Engine(tiny_model(0), EngineConfig(strategy="zero1", micro_batches=1, accumulation="fixed", max_steps=2),
                    mse_loss)
    data = worker_stream(0, 4)
    assert engine.feed(data[0]) is not None and not engine.done
    second = engine.feed(data[1])
    assert second.step == 2 and second.micro_batches == 1 and engine.done
    assert engine.finish() == []  # nothing in flight, nothing pending
    with pytest.raises(RuntimeError, match="max_steps is 2: nothing to train"):
        engine.feed(data[2])
    engine.close()


def test_step_result_round_trips_a_history_entry():
    entry = {"step": 3, "loss": 0.5, "lr": 1e-3, "samples": 8, "micro_batches": 2, "global_micro_batches": 4,
             "wire_bytes": 100, "time_s": 0.1, "grad_norm": 1.0, "skipped": False, "bad_ranks": [], "rounds": 1,
             "min_micro_batches": 2, "outer": [{"round": 0}]}
    result = StepResult.from_entry(entry)
    assert result.loss == 0.5 and result.extra == {"outer": [{"round": 0}]}
    assert result.as_dict() == entry
