"""The backend's own reduce-scatter (what Comm uses under NCCL, forced here on gloo, which has one
too): the same fp32 sums as the all-to-all path up to summation order, for fp32 and bf16
gradients, flat and inside a node of the two-level exchange, with the bytes a ring sends."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.comm import Comm
from engine.parallel.local_group import spawn


def _both(rank: int, world: int, dtype: torch.dtype):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    comm = Comm(rank, world)
    assert not comm.native_reduce_scatter  # gloo: the all-to-all path by default
    g = torch.Generator().manual_seed(rank)
    full = (torch.randn(world * 96, generator=g) * (rank + 1)).to(dtype)
    by_rows = comm.reduce_scatter_sum(full).clone()
    before = comm.bytes_sent
    comm.native_reduce_scatter = True
    native = comm.reduce_scatter_sum(full).clone()
    return by_rows, native, comm.bytes_sent - before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_reduce_scatter_equals_the_all_to_all_sum(dtype):
    world = 3
    results = spawn(_both, world, dtype)
    exact = sum((torch.randn(world * 96, generator=torch.Generator().manual_seed(r)) * (r + 1)).to(dtype).double()
                for r in range(world))
    for r, (by_rows, native, sent) in enumerate(results):
        assert by_rows.dtype == native.dtype == torch.float32
        torch.testing.assert_close(native.double(), exact[r * 96:(r + 1) * 96], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(native, by_rows, rtol=1e-6, atol=1e-6)
        assert sent == (world - 1) * 96 * 4  # a ring's (N-1)/N of the fp32 buffer


def _engine(rank: int, world: int, native: bool):
    import engine.parallel.comm
    from engine import Engine, EngineConfig
    from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

    engine.parallel.comm.Comm.native_reduce_scatter = property(lambda self: native and self.world_size > 1,
                                                      lambda self, value: None)
    model = tiny_model(0)
    cfg = EngineConfig(strategy="zero1", lr=1e-2, micro_batches=2, accumulation="fixed", max_steps=4, align=8,
                       topology="two_level")
    e = Engine(model, cfg, mse_loss)
    e.fit(iter(worker_stream(rank, 40)))
    e.close()
    return flat_params(model)


def test_two_level_with_the_native_reduce_scatter_matches_the_all_to_all_path():
    env = {"LOCAL_WORLD_SIZE": "2"}
    native, by_rows = spawn(_engine, 4, True, env=env), spawn(_engine, 4, False, env=env)
    for r in range(4):
        assert torch.equal(native[r], native[0])
        torch.testing.assert_close(native[r], by_rows[r], rtol=1e-5, atol=1e-6)
