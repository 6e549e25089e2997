"""A non-finite gradient or update skips the whole optimizer step on every rank and leaves no
trace: master, optimizer moments, Adam's counter and the error-feedback state are exactly as
before the step, and the warning names the rank. Real gloo groups of 2."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from engine import Engine, EngineConfig, NonFiniteGradientError
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

STEPS = 4


def nan_on(rank_to_poison: int, rank: int, batch_index: int):
    """mse_loss, made NaN in this worker's ``batch_index``-th micro-batch (1-based) on one rank."""
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        loss = mse_loss(model, batch)
        return loss * float("nan") if rank == rank_to_poison and calls[0] == batch_index else loss
    return loss_fn


def state_snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    out = {f"opt.{k}": v.clone() for k, v in engine.shard_state.tensors().items()}
    if engine.grads.feedback is not None:
        out.update({f"fb.{k}": v.clone() for k, v in engine.grads.feedback.state_dict().items()})
    out["params"] = flat_params(engine.model)
    return out


def poisoned_run(rank: int, world: int, strategy: str, codec: str, batch_index: int, after_skip: str = "rollback"):
    """Step one at a time; record everything the step may have changed, and the warnings."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("acco_loco").addHandler(Keep())
    cfg = EngineConfig(strategy=strategy, codec=codec, micro_batches=2, accumulation="fixed",
                       max_steps=STEPS, lr=1e-2, align=8, group_size=8, nan_policy="skip",
                       error_after_skip=after_skip)
    engine = Engine(tiny_model(0), cfg, nan_on(1, rank, batch_index))
    it = iter(worker_stream(rank, 100))
    snaps, history = [state_snapshot(engine)], []
    for _ in range(STEPS):
        history += engine.fit(it, steps=1)
        snaps.append(state_snapshot(engine))
    opt_steps = engine.shard_state.step
    marked = engine.grads.feedback.marked if engine.grads.feedback is not None else None
    engine.close()
    return {"snaps": snaps, "history": history, "opt_steps": opt_steps, "warnings": records, "marked": marked}


# rank 1's 5th micro-batch is the estimate half of step 2 under acco (rounds of 2 micro-batches,
# two rounds a step); its 7th the commit half. Under zero1/dpu the 3rd is in step 2.
CASES = [("acco", codec, 5) for codec in ("none", "int4", "ef4", "loco4", "sign1")] + [
    ("acco", "loco4", 7), ("acco", "none", 7), ("zero1", "loco4", 3), ("dpu", "ef8", 3)]


@pytest.mark.parametrize("strategy, codec, batch_index", CASES)
def test_nan_skips_the_whole_step_everywhere(strategy, codec, batch_index):
    results = spawn(poisoned_run, 2, strategy, codec, batch_index)
    for rank, res in enumerate(results):
        skipped = [h["step"] for h in res["history"] if h["skipped"]]
        assert skipped == [2], (rank, skipped)
        assert res["history"][1]["bad_ranks"] == [1]
        before, after = res["snaps"][1], res["snaps"][2]  # around step 2
        for key in before:
            assert torch.equal(before[key], after[key]), (rank, key)  # nothing of step 2 remains
        assert res["opt_steps"] == STEPS - 1  # Adam's counter skipped it too
        # the other steps did move the parameters
        assert not torch.equal(res["snaps"][2]["params"], res["snaps"][3]["params"])
        assert torch.isfinite(res["snaps"][-1]["params"]).all()
        assert any("step 2 skipped" in w and "rank(s) [1]" in w for w in res["warnings"]), res["warnings"]
    for a, b in zip(results[0]["snaps"], results[1]["snaps"]):
        assert torch.equal(a["params"], b["params"])  # replicas stay identical


@pytest.mark.parametrize("strategy, batch_index", [("acco", 5), ("acco", 7), ("zero1", 3)])
def test_reset_after_skip_zeroes_the_error_and_keeps_no_copy(strategy, batch_index):
    """error_after_skip='reset' (auto on a GPU): the skipped step leaves the optimizer as it was
    and the error at zero on every rank (the periodic reset's state), and no copy of the error
    was ever taken."""
    results = spawn(poisoned_run, 2, strategy, "loco4", batch_index, "reset")
    for rank, res in enumerate(results):
        assert [h["step"] for h in res["history"] if h["skipped"]] == [2], rank
        assert res["marked"] is False
        before, after = res["snaps"][1], res["snaps"][2]
        assert any(k.startswith("fb.") and not torch.equal(v, after[k]) for k, v in before.items())
        for key in before:
            if key.startswith("fb."):
                continue
            assert torch.equal(before[key], after[key]), (rank, key)
        assert (after["fb.e_codes"] == 128).all() and (after["fb.e_scales"] == 0).all()  # q = 0: e = 0
        assert torch.isfinite(res["snaps"][-1]["params"]).all()
        assert not torch.equal(res["snaps"][2]["params"], res["snaps"][3]["params"])
    for a, b in zip(results[0]["snaps"], results[1]["snaps"]):
        assert torch.equal(a["params"], b["params"])


def overflowing_run(rank: int, world: int, param_codec: str, policy: str):
    """SGD with a finite but huge lr and large gradients: the update overflows fp32 on every shard."""
    cfg = EngineConfig(strategy="acco", optimizer="sgd", momentum=0.0, lr=1e38, micro_batches=1,
                       accumulation="fixed", max_steps=3, align=8, group_size=8, param_codec=param_codec,
                       nan_policy=policy)
    engine = Engine(tiny_model(0), cfg, lambda m, b: 1e3 * mse_loss(m, b))  # gradients > 1
    before = (flat_params(engine.model), engine.shard_state.master.clone())
    try:
        history = engine.fit(worker_stream(rank, 50))
    except NonFiniteGradientError as exc:
        return {"error": str(exc)}
    finally:
        engine.close()
    # a skipped step gathers the unchanged master; a bfloat16 wire rounds it on the way
    expected = before[0].to(torch.bfloat16).float() if param_codec == "bfloat16" else before[0]
    return {"history": history, "params_kept": torch.equal(expected, flat_params(engine.model)),
            "master_kept": torch.equal(before[1], engine.shard_state.master),
            "opt_steps": engine.shard_state.step}


@pytest.mark.parametrize("param_codec", ["auto", "bfloat16", "int8"])
def test_nonfinite_update_is_never_installed(param_codec):
    for res in spawn(overflowing_run, 2, param_codec, "skip"):
        assert [h["skipped"] for h in res["history"]] == [True] * 3
        assert res["history"][0]["bad_ranks"] == [0, 1]
        assert res["params_kept"] and res["master_kept"] and res["opt_steps"] == 0


def test_nonfinite_update_stops_with_a_message():
    for res in spawn(overflowing_run, 2, "int8", "stop"):
        assert "non-finite parameters after the update" in res["error"]
        assert "rank(s) [0, 1]" in res["error"] and "nothing was installed" in res["error"]


def test_nonfinite_update_world_1():
    res = overflowing_run(0, 1, "auto", "skip")
    assert all(h["skipped"] for h in res["history"]) and res["master_kept"] and res["params_kept"]
    assert math.isnan(res["history"][0]["grad_norm"])


def test_save_between_a_bad_estimate_and_its_commit_resumes_exactly(tmp_path):
    """Saved after a NaN estimate half: the resumed commit is still skipped and rolls the error
    state back to the step's start, exactly as an uninterrupted run does."""
    cfg = dict(strategy="acco", codec="loco4", micro_batches=1, accumulation="fixed", max_steps=3,
               lr=1e-2, align=8, group_size=8)
    stream = worker_stream(0, 8)

    def run(pieces):
        engine, history, at = None, [], 0
        for i, n in enumerate(pieces):
            if engine is None:
                engine = Engine(tiny_model(0), EngineConfig(**cfg), nan_on(0, 0, 3))
            else:
                engine.save(str(tmp_path / "ck"))
                engine.close()
                engine = Engine.load(str(tmp_path / "ck"), tiny_model(5), loss_fn=nan_on(0, 0, 3 - at))
            history += engine.fit(stream[at:at + n])
            at += n
        snap = state_snapshot(engine)
        engine.close()
        return history, snap

    straight, end = run([6])
    resumed, end_resumed = run([3, 3])  # the 3rd micro-batch is step 2's estimate half
    assert [h["skipped"] for h in straight] == [False, True, False]
    assert [h["skipped"] for h in resumed] == [False, True, False]
    for key in end:
        assert torch.equal(end[key], end_resumed[key]), key
