"""optimizer_offload='cpu' for the local-step strategies (issue 41): diloco's and sparseloco's inner
AdamW master and moments, and local_sgd's replica parameters, in host memory, each inner step run
there on the gradient's host copy and the new parameters copied back in pieces
(engine/runtime/offload.py, engine/strategies/inner_step.py). On this CPU-only machine host and
device are the same memory, but the offloaded run keeps separate host tensors and makes every copy,
so what is checked is the path a GPU runs: in real gloo groups, the same bits as the run without
offload at world 2 flat, 2 x 2 two-level (a node one replica) and 2 x 2 node-sharded (with the
outer state on the CPU too: against the run with it on the device, diloco's exchange then
in pieces), the engine's accounting showing the inner state as host bytes and
none of it on the device; a mid-period resume bit for bit, and checkpoints that load either way."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from engine import Engine
from engine.parallel.local_group import spawn
from tests.engine.test_local_steps_sharded import (
    ROUNDS,
    H,
    _sgd_config,
    chunked_model,
    config,
)
from tests.engine.test_model_sharding import sharded_tiny, whole_params
from tests.tiny import mse_loss, worker_stream

LAYOUTS = {  # name: (world, ranks per node, settings)
    "flat-2": (2, 1, {"topology": "flat", "model_sharding": "none"}),
    "two-level-2x2": (4, 2, {"topology": "two_level", "model_sharding": "none"}),
    "node-sharded-2x2": (4, 2, {"topology": "two_level", "model_sharding": "node"}),
}


def _run(rank: int, strategy: str, settings: dict, offload: str) -> dict:
    from engine.runtime.memory_accounting import held_bytes, host_held_bytes

    if strategy == "local_sgd":
        cfg = replace(_sgd_config(settings["model_sharding"], 1), optimizer_offload=offload)
        engine, steps = Engine(sharded_tiny(), cfg, mse_loss), 8
    else:
        sharding, rest = settings["model_sharding"], {k: v for k, v in settings.items() if k != "model_sharding"}
        if sharding == "node" and offload == "cpu":  # against the outer state on the device: diloco's exchange
            rest["outer_state_device"] = "cpu"  # in pieces of 16 columns (Diloco.wire_piece) against the whole one
        engine, steps = Engine(chunked_model(), config(strategy, sharding, 1, optimizer_offload=offload, **rest),
                               mse_loss), ROUNDS * H
    it, snaps, losses = iter(worker_stream(rank, steps + 1)), [], []
    for _ in range(steps):
        losses += [h["loss"] for h in engine.fit(it, steps=1)]
        snaps.append(whole_params(engine.model))
    state = engine.ctx.gather_buf if strategy == "local_sgd" else engine.shard_state.master
    out = {"snaps": snaps, "loss": losses, "held": held_bytes(engine.model, engine.ctx, engine.strategy),
           "host": host_held_bytes(engine.strategy), "state_values": state.numel()}
    engine.close()
    return out


def _pairs(rank: int, world: int, layout: str) -> dict:
    from engine.strategies.diloco import DiLoCo

    DiLoCo.wire_piece = 32  # several pieces on this model (2 ranks on the rail: 16 columns each)
    settings = LAYOUTS[layout][2]
    return {(s, o): _run(rank, s, settings, o) for s in ("diloco", "sparseloco", "local_sgd") for o in ("none", "cpu")}


def _check(layout: str) -> None:
    world, g, _ = LAYOUTS[layout]
    runs = spawn(_pairs, world, layout, env={"LOCAL_WORLD_SIZE": str(g)}, timeout=600)
    for r, run in enumerate(runs):
        for strategy in ("diloco", "sparseloco", "local_sgd"):
            got, want = run[strategy, "cpu"], run[strategy, "none"]
            for t, (a, b) in enumerate(zip(got["snaps"], want["snaps"])):
                assert torch.equal(a, b), (layout, strategy, r, t)
            assert got["loss"] == want["loss"], (layout, strategy, r)
            n = got["state_values"]
            if strategy == "local_sgd":  # its state: the replica's fp32 parameters
                assert got["host"] >= 4 * n and got["held"]["gathered"] == 0, (layout, r, got)
                assert want["host"] == 0 and want["held"]["gathered"] == 4 * n, (layout, r, want)
            else:  # AdamW's fp32 master and two moments, and the gradient's host copy
                assert 16 * n <= got["host"] <= 16 * n + 4 * (1 << 20), (layout, strategy, r, got["host"])
                assert got["held"]["optimizer"] == 0, (layout, strategy, r, got["held"])
                assert want["host"] == 0 and want["held"]["optimizer"] >= 12 * n, (layout, strategy, r)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_local_offload_matches_the_run_without_it(layout):
    _check(layout)


def _resume(rank: int, world: int, root: str) -> dict:
    """diloco node-sharded at 2 x 2, the outer state on the CPU: a run of 2 rounds + 1 step straight,
    and stopped mid-period (H + 1 steps), saved, resumed with and without offload."""
    out = {}
    data = worker_stream(rank, H * (ROUNDS + 2))

    def cfg(offload: str):
        return config("diloco", "node", 1, optimizer_offload=offload, outer_state_device="cpu")

    straight = Engine(chunked_model(), cfg("cpu"), mse_loss)
    straight.fit(iter(data))
    want = whole_params(straight.model)
    straight.close()
    for saved, loaded in (("cpu", "cpu"), ("cpu", "none"), ("none", "cpu")):
        first = Engine(chunked_model(), cfg(saved), mse_loss)
        first.fit(iter(data), steps=H + 1)
        path = f"{root}/{saved}-{loaded}"
        first.save(path)
        first.close()
        model = chunked_model(seed=7)
        resumed = Engine.load(path, model, cfg(loaded), mse_loss)
        resumed.fit(itertools.islice(iter(data), resumed.consumed, None))
        out[saved, loaded] = torch.equal(whole_params(model), want)
        resumed.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_offload_resumes_bit_exact_and_loads_either_way(tmp_path):
    runs = spawn(_resume, 4, str(tmp_path), env={"LOCAL_WORLD_SIZE": "2"}, timeout=500)
    for r, run in enumerate(runs):
        for key, equal in run.items():
            assert equal, (r, key)


def test_the_planner_moves_the_inner_state_to_the_host():
    """engine/planner: a node-sharded local-step row with the inner state on the CPU keeps none of its
    12 V on the device (V = P/G values a rank), holds it (12 V) and the gradient's host copy (two
    piece slots) in host memory, and pays the host step and the copies each inner step; the row exists in the candidates."""
    from engine.parallel.topology import Layout
    from engine.planner.hardware import gpu
    from engine.planner import memory
    from engine.planner.memory import memory_per_gpu
    from engine.planner.modes import Mode, candidates
    from engine.planner.shape import PRESETS
    from engine.planner.timeline import Batch, offload_inner_s, step_time
    from engine.planner.wire import WireSettings

    shape, layout, ws = PRESETS["8b"], Layout(2, 8), WireSettings(compute_bytes=2)
    v = shape.trainable / 8
    hw, batch = gpu(1.0), Batch(1024, 1)
    names = {m.name for m in candidates()}
    for strategy in ("diloco", "sparseloco"):
        kept = Mode(strategy, exchange="two-level", sharding="node", outer_state="cpu")
        moved = replace(kept, offload="cpu")
        assert moved.name in names, moved.name
        a, b = memory_per_gpu(kept, shape, layout, ws), memory_per_gpu(moved, shape, layout, ws)
        scratch = 4 * min(v, memory.INNER_PIECE)  # the inner step's piece scratch, with the state
        assert a.optimizer == pytest.approx(12 * v + scratch) and b.optimizer == 0.0
        grad_copy = memory.inner_gradient_host_bytes(v)  # the node's gradient in two piece slots on the host
        assert b.host - a.host == pytest.approx(12 * v + grad_copy + scratch)
        assert a.total - b.total == pytest.approx(12 * v + scratch)
        slower = step_time(moved, shape, layout, hw, batch).step_s - step_time(kept, shape, layout, hw, batch).step_s
        assert 0 < slower <= offload_inner_s(v * 1.001), (strategy, slower)
    flat = memory_per_gpu(Mode("diloco", offload="cpu"), shape, Layout(2, 1), ws)
    assert flat.optimizer == 0.0 and flat.host == pytest.approx(16 * shape.trainable + 4 * memory.INNER_PIECE)
