"""recipes/finetune.py's data under the engine: one dealt stream under a global batch (so speed
shares do not change which samples make a step), each worker's own stream otherwise."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig, GlobalBatches
from engine.parallel.local_group import spawn
from lm.data import TokenBatches
from recipes.finetune import engine_data
from tests.tiny import mse_loss, tiny_model

TOKENS = torch.arange(5000) % 97


def _data_of(rank, world):
    stream = TokenBatches(TOKENS, 16, 2, rank=rank, world_size=world, seed=4)
    whole = TokenBatches(TOKENS, 16, 2, rank=0, world_size=1, seed=4)
    out = {}
    for name, cfg in {"global": EngineConfig(strategy="acco", global_micro_batches=4, max_steps=2, align=8),
                      "own": EngineConfig(strategy="zero1", micro_batches=2, max_steps=2, align=8),
                      "local": EngineConfig(strategy="diloco", global_micro_batches=2, max_steps=2, align=8)
                      }.items():
        engine = Engine(tiny_model(0), cfg, mse_loss)
        data = engine_data(engine, stream)
        if isinstance(data, GlobalBatches):
            out[name] = all(torch.equal(data.fetch(i)["input_ids"], whole.batch(i)["input_ids"]) for i in range(6))
        else:
            out[name] = torch.equal(next(data)["input_ids"], stream.batch(0)["input_ids"]) and "own"
        engine.close()
    return out


def test_a_global_batch_deals_the_whole_stream_and_otherwise_each_worker_reads_its_own():
    for res in spawn(_data_of, 2):
        assert res == {"global": True, "own": "own", "local": "own"}
