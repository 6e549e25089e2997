"""LoCo inside the engine: compressed reduce-scatter against a dequantize-and-sum reference in
gloo groups of 2 and 4, bit-identical replicas with delta parameter all-gathers, the wire budget
of docs/design/zero1.md from history, and error state surviving a resume."""

from __future__ import annotations

import itertools

import pytest
import torch

from acco_loco.registry import GradCodecSpec, make_codec, parse_grad_codec
from benchmarks.modes import engine_modes
from engine import Engine, EngineConfig
from engine.parallel.collectives import CompressedGrads
from engine.parallel.comm import Comm
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, worker_stream

NUMEL, GROUP = 4 * 1024, 128


def _full(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(NUMEL, generator=g) * (1 + rank)


def compressed_rs(rank: int, world: int, bits: int):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    comm = Comm(rank, world)
    grads = CompressedGrads(GradCodecSpec("none", f"int{bits}"), NUMEL, world, GROUP, "float32", 0.8, 1024, "fp32",
                            torch.device("cpu"), stochastic=False, seed=0)
    out = grads.reduce(comm, _full(rank), count=rank + 1).sum
    return out, comm.bytes_sent


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_reduce_scatter_equals_dequantized_sum(world):
    bits = 4
    results = spawn(compressed_rs, world, bits)
    codec = make_codec("int4", group_size=GROUP)
    shard = NUMEL // world
    want = torch.zeros(NUMEL)
    for w in range(world):  # every worker's payload, dequantized, weighted by its count
        payload, scales = codec.encode(_full(w) / (w + 1))
        want += (w + 1) * codec.decode(payload, scales)
    for r, (got, sent) in enumerate(results):
        torch.testing.assert_close(got, want[r * shard:(r + 1) * shard], rtol=0, atol=1e-5)
        # payload + fp32 scales + one fp32 count per row, to each of the other workers
        assert sent == (world - 1) * (shard * bits // 8 + shard // GROUP * 4 + 4)
    # and it is a real approximation of the exact sum, not something else
    exact = sum(_full(w) for w in range(world))
    assert (want - exact).norm() / exact.norm() < 0.2


def wide_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 3))


# from the one mode table (benchmarks/modes.py): name -> EngineConfig keyword arguments
MODES = engine_modes(("zero1", "acco+loco4", "acco+loco4+int4params", "acco+int4", "dpu+ef8+bf16"))


def train_modes(rank: int, world: int, steps: int = 8):
    out = {}
    for name, kw in MODES.items():
        model = wide_model()
        cfg = EngineConfig(lr=5e-4, micro_batches=2, accumulation="fixed", max_steps=steps, **kw)
        engine = Engine(model, cfg, mse_loss)
        it = iter(worker_stream(rank, 400))
        snaps, history = [], []
        for t in range(steps):
            history += engine.fit(it, steps=1)
            snaps.append(flat_params(model))
        engine.close()
        out[name] = {"snaps": snaps, "bytes": [h["wire_bytes"] for h in history],
                     "loss": [h["loss"] for h in history]}
    return out


def test_world2_codecs_identical_replicas_and_wire_budget():
    results = spawn(train_modes, 2)
    for name in MODES:
        for step, mine in enumerate(results[0][name]["snaps"]):
            assert torch.equal(results[1][name]["snaps"][step], mine), (name, step)
    base = results[0]["zero1"]["bytes"][-1]
    ratio = {name: results[0][name]["bytes"][-1] / base for name in MODES}
    assert ratio["acco+loco4"] <= 0.42, ratio
    assert ratio["acco+loco4+int4params"] <= 0.28, ratio
    assert ratio["dpu+ef8+bf16"] < 0.5 * 1.1, ratio  # 1 byte + 2 bytes against 4 + 4
    # every mode learned something on this easy task
    for name in MODES:
        losses = results[0][name]["loss"]
        assert losses[-1] < losses[0], (name, losses)


def test_error_state_resumes_bit_exact(tmp_path):
    def cfg(steps):
        return EngineConfig(strategy="acco", codec="loco4", param_codec="int8", lr=3e-3, micro_batches=2,
                            accumulation="fixed", max_steps=steps, reset_period=7)

    stream = worker_stream(0, 400)
    straight = Engine(wide_model(), cfg(20), mse_loss)
    straight.fit(stream)
    straight.close()
    first = Engine(wide_model(), cfg(10), mse_loss)
    first.fit(stream)
    assert float(first.grads.feedback.error().abs().sum()) > 0
    first.save(str(tmp_path / "c"))
    first.close()
    model = wide_model(seed=5)
    resumed = Engine.load(str(tmp_path / "c"), model, cfg(20), mse_loss)
    resumed.fit(itertools.islice(stream, resumed.consumed, None))
    resumed.close()
    assert torch.equal(flat_params(model), flat_params(straight.model))
    with pytest.raises(ValueError, match="codec='loco4' there, 'none' here"):
        Engine.load(str(tmp_path / "c"), wide_model(), EngineConfig(strategy="acco", param_codec="int8"), mse_loss)


@pytest.mark.parametrize("name", ["loco3", "int1", "sign4", "zip", "LOCO4"])
def test_unknown_codec_names(name):
    with pytest.raises(ValueError, match="unknown codec"):
        parse_grad_codec(name)
    with pytest.raises(ValueError, match="unknown codec"):
        EngineConfig(codec=name)
