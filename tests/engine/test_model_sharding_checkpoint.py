"""Checkpoints of model_sharding='node' runs (engine/parallel/sharding.py, engine/checkpoint/writer.py): a
bit-exact resume at the same layout, a re-cut at another number of nodes (each rail's chunks, as
a flat run's shards), and another number of ranks per node refused on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.engine.test_model_sharding import grouped_model, whole_params
from tests.tiny import mse_loss, worker_stream


def _cfg(steps: int, **kw) -> EngineConfig:
    return EngineConfig(**{**dict(strategy="acco", codec="loco4", param_codec="int8", reset_period=3, lr=3e-3,
                                  micro_batches=1, accumulation="fixed", max_steps=steps, model_sharding="node"),
                           **kw})


def _resume(rank: int, world: int, directory: str):
    stream = worker_stream(rank, 100)
    straight = Engine(grouped_model(), _cfg(8), mse_loss)
    straight.fit(iter(stream))
    want = whole_params(straight.model)
    straight.close()
    first = Engine(grouped_model(), _cfg(4), mse_loss)
    first.fit(iter(stream))
    first.save(directory)
    first.close()
    model = grouped_model(seed=7)
    resumed = Engine.load(directory, model, _cfg(8), mse_loss)
    resumed.fit(itertools.islice(stream, resumed.consumed, None))
    got = whole_params(model)
    resumed.close()
    import os

    os.environ.update(LOCAL_WORLD_SIZE="4", LOCAL_RANK=str(rank), GROUP_RANK="0")  # relaunched as 1 node of 4
    try:  # the same world, but the local shards are cut otherwise
        Engine.load(directory, grouped_model(), _cfg(8), mse_loss)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return torch.equal(got, want), refused


def _resized(rank: int, world: int, directory: str):
    model = grouped_model(seed=3)
    engine = Engine.load(directory, model, _cfg(8), mse_loss)
    loaded = whole_params(model), engine.shard_state.master.clone(), engine.flat.numel
    history = engine.fit(iter(worker_stream(rank, 20)))
    engine.close()
    return loaded, [h["loss"] for h in history]


def test_sharded_checkpoint_resumes_bit_exact_and_refuses_other_ranks_per_node(tmp_path):
    runs = spawn(_resume, 4, str(tmp_path / "ckpt"), env={"LOCAL_WORLD_SIZE": "2"})
    assert all(exact for exact, *_ in runs)
    for *_, refused in runs:
        assert refused is not None and "resume with 2 ranks per node" in refused, refused


def _resume_one_buffer(rank: int, world: int, directory: str):
    """zero1 (no overlap): the round gathers into the gradient buffer, which the checkpoint saves
    as the pending gradient (engine/parallel/sharding.py)."""
    cfg = dict(strategy="zero1", micro_batches=2)
    stream = worker_stream(rank, 100)
    straight = Engine(grouped_model(), _cfg(6, **cfg), mse_loss)
    straight.fit(iter(stream))
    want = whole_params(straight.model)
    straight.close()
    first = Engine(grouped_model(), _cfg(3, **cfg), mse_loss)
    assert len(first.flat.grads) == 1 and first.ctx.gather_buf is first.flat.grads[0]
    first.fit(iter(stream))
    first.save(directory)
    first.close()
    model = grouped_model(seed=7)
    resumed = Engine.load(directory, model, _cfg(6, **cfg), mse_loss)
    resumed.fit(itertools.islice(stream, resumed.consumed, None))
    got = whole_params(model)
    resumed.close()
    return torch.equal(got, want)


def test_sharded_zero1_with_one_gradient_buffer_resumes_bit_exact(tmp_path):
    assert all(spawn(_resume_one_buffer, 4, str(tmp_path / "ckpt"), env={"LOCAL_WORLD_SIZE": "2"}))


def _save(rank: int, world: int, directory: str):
    engine = Engine(grouped_model(), _cfg(4), mse_loss)
    engine.fit(iter(worker_stream(rank, 100)))
    engine.save(directory)
    saved = whole_params(engine.model), engine.shard_state.master.clone()
    engine.close()
    return saved


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_checkpoint_is_recut_for_another_number_of_nodes(tmp_path):
    directory = str(tmp_path / "ckpt")
    runs = spawn(_save, 4, directory, env={"LOCAL_WORLD_SIZE": "2"})
    # 2 nodes x 2 -> 1 node x 2: rail l's two chunks (nodes 0 and 1) become one rank's whole buffer
    resized = spawn(_resized, 2, directory, env={"LOCAL_WORLD_SIZE": "2"})
    saved = runs[0][0]
    for local in range(2):
        (params, master, numel), losses = resized[local]
        assert torch.equal(params, saved)  # the model file, installed whole and sharded again
        old = torch.cat([runs[m * 2 + local][1] for m in range(2)])[:numel]
        assert torch.equal(master[:numel], old)  # the master re-cut bit for bit
        assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert resized[0][1] == resized[1][1]  # both ranks of the node report the same steps
