"""An ordinary bug on the communication side is raised as itself, with its rank and round; only
a peer that is really gone becomes WorkerLostError. And fit() at max_steps says how to go on."""

from __future__ import annotations

import time

import pytest

from engine import Engine, EngineConfig, WorkerLostError
from engine.parallel.local_group import spawn_collect
from tests.tiny import mse_loss, tiny_model, worker_stream


def _broken_codec(engine: Engine, on_round: int = 0):
    """Make the gradient codec raise a TypeError from round ``on_round`` on."""
    real = engine.grads.reduce
    rounds = [0]

    def reduce(*args, **kwargs):
        rounds[0] += 1
        if rounds[0] > on_round:
            raise TypeError("codec bug: unsupported operand")
        return real(*args, **kwargs)
    engine.grads.reduce = reduce


def test_codec_bug_at_world_1_is_raised_as_itself():
    engine = Engine(tiny_model(), EngineConfig(codec="int4", align=8, group_size=8, max_steps=5), mse_loss)
    _broken_codec(engine, on_round=2)
    with pytest.raises(TypeError, match="codec bug") as info:
        engine.fit(worker_stream(0, 50))
    assert any("round 2 on rank 0" in note for note in getattr(info.value, "__notes__", [])), info.value
    assert not isinstance(info.value, WorkerLostError)


def buggy_worker(rank: int, world: int, buggy_ranks: tuple[int, ...]):
    cfg = EngineConfig(codec="loco4", align=8, group_size=8, max_steps=20, micro_batches=1,
                       accumulation="fixed", timeout_s=9.0, heartbeat_s=0.5)
    engine = Engine(tiny_model(), cfg, mse_loss)
    if rank in buggy_ranks:
        _broken_codec(engine, on_round=3)
    start = time.monotonic()
    try:
        engine.fit(worker_stream(rank, 100))
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "notes": getattr(exc, "__notes__", []),
                "elapsed": time.monotonic() - start}
    return {"type": None}


def test_codec_bug_on_every_rank_is_raised_as_itself():
    out = spawn_collect(buggy_worker, 2, (0, 1), timeout=60)
    for r in range(2):
        res = out[r]["out"]
        assert res["type"] == "TypeError", res
        assert any(f"round 3 on rank {r}" in n for n in res["notes"]), res
        assert res["elapsed"] < 5  # no heartbeat diagnosis for a plain bug


def test_codec_bug_on_one_rank_names_it_to_the_others():
    out = spawn_collect(buggy_worker, 3, (2,), timeout=60)
    assert out[2]["out"]["type"] == "TypeError"
    for r in (0, 1):
        res = out[r]["out"]
        assert res["type"] == "WorkerLostError", res
        assert "rank(s) [2] closed their engine (after an error of their own" in res["message"], res


def test_fit_at_max_steps_says_how_to_go_on(tmp_path):
    engine = Engine(tiny_model(), EngineConfig(max_steps=2, align=8), mse_loss)
    stream = worker_stream(0, 40)
    assert len(engine.fit(stream)) == 2
    with pytest.raises(RuntimeError, match=r"at step 2, its max_steps is 2.*max_steps="):
        engine.fit(stream)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        engine.fit(stream, steps=0)
    engine.close()
