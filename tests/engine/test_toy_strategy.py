"""A strategy of its own shape from outside the package: tests/toy_strategy.py's toy_sync_sgd,
with its own loop (the step on the compute side) and its own config section (tests/toy_section.py),
registered by one line each, trains in a gloo group of 2 against a float64 reference of SGD on
the mean gradient of both workers' micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch

import engine.strategies as registry
from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mean_grad_f64, mse_loss, rel_err, tiny_model, worker_stream

K, STEPS, STEP_SIZE = 2, 6, 0.05


def register() -> None:
    """The two registry lines (in each spawned worker too)."""
    registry.SECTIONS["toy"] = "tests.toy_section:ToyConfig"
    registry.STRATEGIES["toy_sync_sgd"] = "tests.toy_strategy:ToySyncSGD"


@pytest.fixture
def toy():
    register()
    try:
        yield
    finally:
        del registry.SECTIONS["toy"], registry.STRATEGIES["toy_sync_sgd"]


def train(rank: int, world: int) -> dict:
    register()
    cfg = EngineConfig(strategy="toy_sync_sgd", toy_factor=STEP_SIZE, micro_batches=K, accumulation="fixed",
                       max_steps=STEPS, align=128)  # the planner's padding (engine/strategies/spec.py ALIGN)
    engine = Engine(tiny_model(0), cfg, mse_loss)
    history = engine.fit(worker_stream(rank, K * (STEPS + 1)))
    loop = type(engine.loop).__name__
    engine.close()
    return {"params": flat_params(engine.model), "history": history, "loop": loop}


def reference(world: int) -> torch.Tensor:
    model = copy.deepcopy(tiny_model(0)).double()
    theta = flat_params(model).double()
    streams = [worker_stream(r, K * (STEPS + 1)) for r in range(world)]
    for t in range(STEPS):
        grads = [mean_grad_f64(model, theta, s[t * K:(t + 1) * K]) for s in streams]
        theta = theta - STEP_SIZE * sum(grads) / world
    return theta


def test_toy_strategy_with_its_own_loop_and_section_matches_float64(toy):
    runs = spawn(train, 2)
    ref = reference(2)
    assert all(r["loop"] == "ToyLoop" for r in runs)  # the engine drove the toy's own loop
    assert torch.equal(runs[0]["params"], runs[1]["params"])  # replicas bit-identical
    assert rel_err(runs[0]["params"].double(), ref) < 1e-5
    start = flat_params(tiny_model(0)).double()
    assert rel_err(start, ref) > 1e-3  # it moved: the check above could fail
    h = runs[0]["history"]
    assert [e["step"] for e in h] == list(range(1, STEPS + 1)) and all(e["lr"] == STEP_SIZE for e in h)
    assert all(e["global_micro_batches"] == 2 * K for e in h)
    assert h[-1]["loss"] < h[0]["loss"]
    # the planner prices it from its spec alone (tests/toy_strategy.py ``spec``): what it predicts
    # a rank sends per step is what the engine counted
    from engine.parallel.topology import Layout
    from engine.planner.modes import Mode
    from engine.planner.wire import WireSettings, step_bytes

    want = step_bytes(start.numel(), Layout(2), Mode("toy_sync_sgd"), WireSettings()).rank
    assert [e["wire_bytes"] for e in h] == [want] * STEPS


def test_toy_section_rules_apply_to_the_toy_strategy(toy):
    with pytest.raises(ValueError, match="toy_factor"):
        EngineConfig(strategy="toy_sync_sgd", toy_factor=2.0)
    with pytest.raises(ValueError, match="toy_sync_sgd.*codec='none'"):
        Engine(tiny_model(0), EngineConfig(strategy="toy_sync_sgd", codec="loco4", align=8), mse_loss)
