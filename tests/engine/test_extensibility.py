"""A codec and a strategy added as one file plus one registry line each, trained in a gloo group
of 2 against a float64 reference: the fp16 wire codec (acco_loco/fp16_codec.py, a line in
acco_loco/registry.py), a toy bf16 codec from outside the package (tests/toy_codec.py) and
local SGD (engine/strategies/local_sgd.py, a line in engine/strategies/__init__.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import tests.toy_codec  # noqa: F401  (registers 'toy_bf16', in the spawned workers too)
from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import Reference, flat_params, mean_grad_f64, mse_loss, rel_err, tiny_model, worker_stream

K, STEPS, LR = 2, 10, 1e-2


def train(rank: int, world: int, kw: dict):
    cfg = EngineConfig(micro_batches=K, accumulation="fixed", max_steps=STEPS, lr=LR, align=8, **kw)
    engine = Engine(tiny_model(0), cfg, mse_loss)
    it = iter(worker_stream(rank, K * (STEPS + 1)))
    snaps, history = [], []
    for _ in range(STEPS):
        history += engine.fit(it, steps=1)
        snaps.append(flat_params(engine.model))
    engine.close()
    return {"snaps": snaps, "bytes": [h["wire_bytes"] for h in history]}


def cast_reference(world: int, wire_dtype: torch.dtype) -> list[torch.Tensor]:
    """zero1 + AdamW where each worker's mean gradient crosses the wire cast to ``wire_dtype``."""
    model = copy.deepcopy(tiny_model(0)).double()
    theta = flat_params(model).double().requires_grad_(True)
    opt = torch.optim.AdamW([theta], lr=LR, weight_decay=0.0)
    streams = [worker_stream(r, K * (STEPS + 1)) for r in range(world)]
    out = []
    for t in range(STEPS):
        sent = [mean_grad_f64(model, theta.detach(), s[t * K:(t + 1) * K]).float().to(wire_dtype).double()
                for s in streams]
        theta.grad = sum(sent) / world  # equal counts: the count-weighted mean is the plain mean
        opt.step()
        out.append(theta.detach().clone())
    return out


def local_sgd_reference(world: int, period: int) -> list[torch.Tensor]:
    """Each worker's own SGD steps, parameters averaged every ``period`` steps."""
    model = copy.deepcopy(tiny_model(0)).double()
    thetas = [flat_params(model).double() for _ in range(world)]
    streams = [worker_stream(r, K * (STEPS + 1)) for r in range(world)]
    out = []
    for t in range(STEPS):
        thetas = [th - LR * mean_grad_f64(model, th, s[t * K:(t + 1) * K]) for th, s in zip(thetas, streams)]
        if (t + 1) % period == 0:
            avg = sum(thetas) / world
            thetas = [avg.clone() for _ in range(world)]
        out.append(thetas)
    return out


# the built-in fp16 codec, and a toy bf16 codec registered from outside the package (one file
# plus one registration line: tests/toy_codec.py, imported here)
@pytest.mark.parametrize("codec,wire_dtype", [("fp16", torch.float16), ("toy_bf16", torch.bfloat16)])
def test_cast_codec_matches_its_reference_and_halves_the_reduce_scatter(codec, wire_dtype):
    fp16 = spawn(train, 2, {"strategy": "zero1", "codec": codec})
    plain = spawn(train, 2, {"strategy": "zero1"})
    ref = cast_reference(2, wire_dtype)
    plain_ref = Reference(tiny_model(0), [worker_stream(r, K * (STEPS + 1)) for r in range(2)], K,
                          lr=LR, weight_decay=0.0).run("zero1", STEPS)
    for step in range(STEPS):
        assert torch.equal(fp16[0]["snaps"][step], fp16[1]["snaps"][step])
        assert rel_err(fp16[0]["snaps"][step], ref[step]) < 1e-6, step
    assert rel_err(fp16[0]["snaps"][-1], plain_ref[-1]) > 1e-6  # the codec really rounded
    # per step: reduce-scatter + small all-reduce + fp32 all-gather. fp16 sends each shard's
    # values in 2 bytes instead of 4, plus its 4-byte weight (no padding to codec groups)
    shard = -(-sum(p.numel() for p in tiny_model(0).parameters()) // 16) * 8  # align 8, world 2
    assert plain[0]["bytes"][-1] - fp16[0]["bytes"][-1] == 4 * shard - (2 * shard + 4)


@pytest.mark.parametrize("world", [2])
def test_local_sgd_matches_its_reference(world):
    from engine.strategies.local_sgd import LocalSGD

    runs = spawn(train, world, {"strategy": "local_sgd", "optimizer": "sgd", "momentum": 0.0})
    ref = local_sgd_reference(world, LocalSGD.period)
    for step in range(STEPS):
        for rank in range(world):
            assert rel_err(runs[rank]["snaps"][step], ref[step][rank]) < 1e-6, (step, rank)
        averaged = (step + 1) % LocalSGD.period == 0
        assert torch.equal(runs[0]["snaps"][step], runs[1]["snaps"][step]) == averaged, step
    # only an averaging step moves the parameters: an all-reduce of the padded buffer in fp32
    padded = -(-sum(p.numel() for p in tiny_model(0).parameters()) // 16) * 16
    assert runs[0]["bytes"][LocalSGD.period - 1] - runs[0]["bytes"][0] == 2 * (world - 1) * 4 * padded // world


def test_local_sgd_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="local_sgd.*optimizer='sgd'"):
        Engine(tiny_model(0), EngineConfig(strategy="local_sgd"), mse_loss)
