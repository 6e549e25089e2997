"""sparseloco with templar's options (topk_layout='tensor', sparse_clip='median',
sparse_error_scale='outer_lr'; docs/sparseloco.md) in a gloo group of 2 against the float64
reference of tests/engine/test_local_steps.py with each option written out; replicas bit-identical;
bytes per round equal to the tiled codec's formula; the configurations refused."""

from __future__ import annotations

import math

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from engine.strategies import sparseloco
from tests.acco_loco.test_tiled_topk import reference_tiles
from tests.engine.test_local_steps import OUTER, OWN, ROUNDS, LocalReference, padded, topk_2bit, train
from tests.tiny import flat_params, mse_loss, rel_err, tiny_model

SHAPES = [tuple(p.shape) for p in tiny_model(0).parameters()]
CHUNK = 16  # 4 x 4 tiles; k = 0.25 x 16 = 4, as the flat reference's 8 of 32
VARIANTS = {"tiles": {"topk_layout": "tensor"}, "clip": {"sparse_clip": "median"},
            "efscale": {"sparse_error_scale": "outer_lr"},
            "all": {"topk_layout": "tensor", "sparse_clip": "median", "sparse_error_scale": "outer_lr"}}


class OptionsReference(LocalReference):
    """The sparseloco outer step with the options, float64 and sequential."""

    def __init__(self, world: int, options: dict):
        super().__init__(world, "sparseloco")
        self.options = options

    def outer_step(self, deltas, shares):
        own, opt = OWN["sparseloco"], self.options
        scale = OUTER["outer_lr"] if opt.get("sparse_error_scale") == "outer_lr" else 1.0
        sent = []
        for w, d in enumerate(deltas):
            self.errors[w] = own["sparse_error_beta"] * self.errors[w] + scale * d
            if opt.get("topk_layout") == "tensor":
                s = reference_tiles(self.errors[w], SHAPES, 4, 4, own["topk_value_bits"])
            else:
                s = topk_2bit(self.errors[w], CHUNK, 4, own["topk_value_bits"])
            self.errors[w] = self.errors[w] - s
            sent.append(s)
        if opt.get("sparse_clip") == "median":  # per tensor (and the padding), lower median of the peers
            bounds, offset = [], 0
            for shape in SHAPES:
                bounds.append((offset, offset + math.prod(shape)))
                offset += math.prod(shape)
            bounds.append((offset, self.size))
            for a, b in bounds:
                norms = [s[a:b].norm().item() for s in sent]
                median = sorted(norms)[(len(norms) - 1) // 2]
                for s, n in zip(sent, norms):
                    s[a:b] *= min(1.0, median / (n + 1e-8))
        return self.sync - OUTER["outer_lr"] * sum(a * s for a, s in zip(shares, sent))


def _variants(rank: int, world: int) -> dict:
    return {name: train(rank, world, "sparseloco", {**kw, "topk_chunk": CHUNK}) for name, kw in
            {"flat": {}, **VARIANTS}.items()}


def test_options_match_the_float64_reference_and_replicas_agree():
    world = 2
    runs = spawn(_variants, world)
    finals = {}
    for name, kw in {"flat": {}, **VARIANTS}.items():
        want = OptionsReference(world, kw).run(ROUNDS)
        for t in range(ROUNDS):
            sync = runs[0][name]["sync"][t]
            assert torch.equal(runs[1][name]["sync"][t], sync), (name, t)  # replicas bit-identical
            assert rel_err(sync, want[t][1]) < 1e-6, (name, t)
        finals[name] = runs[0][name]["sync"][-1]
    for name in VARIANTS:  # each option changes the computation
        assert rel_err(finals[name], finals["flat"]) > 1e-4, name
    # the tiled payload: bytes per round are its formula's
    cfg = EngineConfig(strategy="sparseloco", align=8, topk_chunk=CHUNK, topk_density=0.25, topk_layout="tensor")
    want_bytes = sparseloco.round_bytes(cfg, padded(world), world, SHAPES)
    assert [h["wire_bytes"] for h in runs[0]["tiles"]["history"]][-1] == want_bytes
    assert want_bytes != sparseloco.round_bytes(EngineConfig(strategy="sparseloco", topk_chunk=CHUNK, topk_density=0.25),
                                                padded(world), world)


def test_refused_configurations():
    with pytest.raises(ValueError, match="topk_chunk=32 is not a square"):
        Engine(tiny_model(0), EngineConfig(strategy="sparseloco", topk_layout="tensor", topk_chunk=32), mse_loss)
    with pytest.raises(ValueError, match="unknown sparse_clip 'max'"):
        EngineConfig(strategy="sparseloco", sparse_clip="max")
    with pytest.raises(ValueError, match="does not read the 'sparseloco' section"):
        EngineConfig(strategy="diloco", sparse_error_scale="outer_lr")
    engine = Engine(tiny_model(0), EngineConfig(strategy="sparseloco", topk_layout="tensor", sparse_clip="median",
                                                inner_steps=2, max_steps=2, align=8), mse_loss)
    assert engine.strategy.codec.payload_bytes() > 0 and flat_params(engine.model).numel() > 0
    engine.close()
