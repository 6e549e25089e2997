"""A codec added from outside the package as one file plus one registration line
(tests/toy_codec.py), trained in a gloo group of 2 against a float64 reference."""

from __future__ import annotations

import copy

import pytest
import torch

import tests.toy_codec  # noqa: F401  (registers 'toy_bf16')
from acco_loco.registry import CODEC_BITS, GRAD_CODECS, WIRE_CODECS, make_codec, register_wire_codec
from engine import Engine, EngineConfig
from engine.local_group import spawn
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


def bf16_reference(world: int) -> list[torch.Tensor]:
    """zero1 + AdamW where each worker's mean gradient crosses the wire as bfloat16."""
    model = copy.deepcopy(tiny_model(0)).double()
    theta = flat_params(model).double().requires_grad_(True)
    opt = torch.optim.AdamW([theta], lr=LR, weight_decay=0.0)
    streams = [worker_stream(r, K * (STEPS + 1)) for r in range(world)]
    out = []
    for t in range(STEPS):
        sent = [mean_grad_f64(model, theta.detach(), s[t * K:(t + 1) * K]).float().bfloat16().double()
                for s in streams]
        theta.grad = sum(sent) / world  # equal counts: the count-weighted mean is the plain mean
        opt.step()
        out.append(theta.detach().clone())
    return out


def test_registration_is_one_line_in_one_table():
    assert WIRE_CODECS["toy_bf16"].bits == 16 and "toy_bf16" in GRAD_CODECS
    assert make_codec("toy_bf16").wire_bytes(10) == 20
    assert CODEC_BITS["int4"] == 4 and "toy_bf16" not in CODEC_BITS  # the built-ins, listed at import
    EngineConfig(codec="toy_bf16")  # the config's check reads the registry
    with pytest.raises(ValueError, match="already registered"):
        register_wire_codec("toy_bf16", 16, tests.toy_codec.Bf16Codec)
    with pytest.raises(ValueError, match="already registered"):
        register_wire_codec("other", 4, tests.toy_codec.Bf16Codec, feedback_suffix="4")  # ef4, loco4 taken


def test_toy_codec_trains_against_its_float64_reference():
    toy = spawn(train, 2, {"strategy": "zero1", "codec": "toy_bf16"})
    plain = spawn(train, 2, {"strategy": "zero1"})
    ref = bf16_reference(2)
    plain_ref = Reference(tiny_model(0), [worker_stream(r, K * (STEPS + 1)) for r in range(2)], K,
                          lr=LR, weight_decay=0.0).run("zero1", STEPS)
    for step in range(STEPS):
        assert torch.equal(toy[0]["snaps"][step], toy[1]["snaps"][step])
        assert rel_err(toy[0]["snaps"][step], ref[step]) < 1e-6, step
    assert rel_err(toy[0]["snaps"][-1], plain_ref[-1]) > 1e-6  # the codec really rounded
    # 2 bytes a value instead of 4 on the reduce-scatter, plus each row's 4-byte weight
    shard = -(-sum(p.numel() for p in tiny_model(0).parameters()) // 16) * 8  # align 8, world 2
    assert plain[0]["bytes"][-1] - toy[0]["bytes"][-1] == 4 * shard - (2 * shard + 4)
