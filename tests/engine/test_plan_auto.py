"""strategy="auto" (engine/auto.py): resolved at start from the planner and a probe of the
process group, to a strategy that keeps AdamW's loss per sample, the same on every rank."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, worker_stream


def _wide():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 700), torch.nn.Tanh(), torch.nn.Linear(700, 3))


def _train_auto(rank, world, extra):
    cfg = EngineConfig(strategy="auto", lr=1e-3, micro_batches=2, accumulation="fixed", max_steps=16, **extra)
    held_out = worker_stream(7, 8, seed=0)
    model = _wide()
    with torch.no_grad():
        before = sum(mse_loss(model, b).item() for b in held_out)
    engine = Engine(model, cfg, mse_loss)
    hist = engine.fit(iter(worker_stream(rank, 200)))
    engine.close()
    with torch.no_grad():
        after = sum(mse_loss(engine.model, b).item() for b in held_out)
    return {"cfg": (engine.cfg.strategy, engine.cfg.codec, engine.cfg.param_codec), "asked": cfg.strategy,
            "decision": vars(engine.auto_choice), "loss": [h["loss"] for h in hist], "held_out": (before, after),
            "params": flat_params(engine.model), "bytes": [h["wire_bytes"] for h in hist]}


def test_auto_resolves_to_one_concrete_strategy_and_trains_world2():
    r0, r1 = spawn(_train_auto, 2, {})
    strategy, codec, param_codec = r0["cfg"]
    assert strategy in ("zero1", "dpu", "acco")  # never a local-step method, never 1-bit Adam
    assert r0["asked"] == "auto"  # the caller's config is left as given
    assert r0["cfg"] == r1["cfg"]  # both ranks chose the same
    assert torch.equal(r0["params"], r1["params"])  # and trained as one replica
    before, after = r0["held_out"]
    assert after < 0.8 * before, r0["held_out"]  # it learned: held-out loss on batches no worker saw
    d = r0["decision"]
    assert d["strategy"] == strategy and d["predicted_step_s"] > 0 and d["inter_Bps"] > 0
    assert d["why"].startswith("strategy=auto -> ") and "predicted" in d["why"]
    assert all(b > 0 for b in r0["bytes"])


def test_auto_keeps_a_codec_the_caller_set_world2():
    r0, _ = spawn(_train_auto, 2, {"codec": "loco4", "param_codec": "int4"})
    assert r0["cfg"][1:] == ("loco4", "int4")
    assert r0["cfg"][0] in ("zero1", "dpu", "acco")


def test_auto_at_world1_is_zero1():
    engine = Engine(_wide(), EngineConfig(strategy="auto", max_steps=2), mse_loss)
    try:
        assert engine.cfg.strategy == "zero1"
        assert engine.auto_choice.strategy == "zero1" and "world size 1" in engine.auto_choice.why
        engine.fit(iter(worker_stream(0, 10)))
    finally:
        engine.close()
