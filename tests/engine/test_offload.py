"""optimizer_offload='cpu' (engine/runtime/offload.py): the sharded optimizer's master and moments in
host memory, the step on the CPU, the gradient's pieces copied to the host and the new values back.
On this CPU-only machine host and device are the same memory, but the offloaded run keeps separate
host tensors and makes every copy, so what is checked here is the path a GPU runs: the same bits as
the run without offload (zero1, dpu, acco; with loco4 + int4 deltas; flat at world 1 and 2,
two-level and node-sharded at 2 x 2), a checkpoint that resumes bit for bit and loads with or
without offload, the memory accounting's host bytes, and the refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

STEPS = 5
MODES = {
    "zero1": dict(strategy="zero1", weight_decay=0.1),
    "dpu": dict(strategy="dpu"),
    "acco": dict(strategy="acco", comm_chunks=3),
    "acco+loco4+int4": dict(strategy="acco", codec="loco4", param_codec="int4", align=8),
    "zero1+loco4+int4": dict(strategy="zero1", codec="loco4", param_codec="int4", align=8),
    "acco piece": dict(strategy="acco", step_copy="piece", comm_chunks=3, max_grad_norm=0.5),
}


def _params(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1)
                      for p in model.parameters() if p.requires_grad])


def _model(sharded: bool):
    if not sharded:
        return tiny_model(0)
    from tests.engine.test_model_sharding import grouped_model

    return grouped_model()


def _run(rank: int, names, offload: str, **layout) -> dict:
    out = {}
    for name in names:
        model = _model(layout.get("model_sharding") == "node")
        cfg = EngineConfig(lr=1e-2, micro_batches=1, accumulation="fixed", max_steps=STEPS,
                           optimizer_offload=offload, **{**MODES[name], **layout})
        engine = Engine(model, cfg, mse_loss)
        stream = iter(worker_stream(rank, 3 * (STEPS + 1)))
        snaps = []
        for _ in range(STEPS):
            engine.fit(stream, steps=1)
            snaps.append(_params(model))
        off = engine.strategy.offload
        out[name] = {"snaps": snaps, "loss": [h["loss"] for h in engine.history],
                     "offloaded": off is not None, "pieces": engine.comm.chunks,
                     "host_bytes": 0 if off is None else off.bytes_to_host,
                     "device_bytes": 0 if off is None else off.bytes_to_device,
                     "separate": off is None or all(
                         t.untyped_storage().data_ptr() != engine.ctx.gather_buf.untyped_storage().data_ptr()
                         for t in off.host_tensors())}
        engine.close()
    return out


def _both(rank: int, world: int, names, layout: dict) -> dict:
    return {off: _run(rank, names, off, **layout) for off in ("none", "cpu")}


def _check(runs: list[dict], names) -> None:
    for r, run in enumerate(runs):
        for name in names:
            plain, off = run["none"][name], run["cpu"][name]
            assert off["offloaded"] and not plain["offloaded"] and off["separate"], name
            assert off["host_bytes"] > 0 and off["device_bytes"] > 0, name  # the copies ran
            for step in range(STEPS):
                assert torch.equal(off["snaps"][step], plain["snaps"][step]), (name, r, step)
            assert off["loss"] == plain["loss"], (name, r)


def test_offload_matches_the_run_without_it_at_world_1():
    runs = [_both(0, 1, tuple(MODES), {})]
    _check(runs, tuple(MODES))


def test_offload_matches_the_run_without_it_at_world_2():
    names = ("zero1", "dpu", "acco", "acco+loco4+int4", "acco piece")
    _check(spawn(_both, 2, names, {}), names)


def test_offload_matches_the_run_without_it_two_level_2x2():
    names = ("zero1", "dpu", "acco+loco4+int4")
    _check(spawn(_both, 4, names, {"topology": "two_level"}, env={"LOCAL_WORLD_SIZE": "2"}), names)


def test_offload_matches_the_run_without_it_node_sharded_2x2():
    names = ("zero1", "dpu", "acco", "zero1+loco4+int4", "acco+loco4+int4")
    _check(spawn(_both, 4, names, {"model_sharding": "node"}, env={"LOCAL_WORLD_SIZE": "2"}), names)


def _cfg(steps: int, offload: str) -> EngineConfig:
    return EngineConfig(strategy="acco", codec="loco4", param_codec="int4", align=8, lr=1e-2, micro_batches=1,
                        accumulation="fixed", max_steps=steps, optimizer_offload=offload, reset_period=3)


def _resume(rank: int, world: int, directory: str) -> dict:
    """Straight 8 steps without offload; 4 steps saved with (and without) offload, resumed for 4
    more under each setting: every continuation is the straight run's, bit for bit."""
    stream = worker_stream(rank, 60)
    straight = Engine(tiny_model(0), _cfg(8, "none"), mse_loss)
    straight.fit(iter(stream))
    want = flat_params(straight.model)
    straight.close()
    out = {}
    for saved in ("cpu", "none"):
        first = Engine(tiny_model(0), _cfg(4, saved), mse_loss)
        first.fit(iter(stream))
        where = f"{directory}/{saved}"
        first.save(where)
        first.close()
        for loaded in ("cpu", "none"):
            model = tiny_model(seed=7)
            resumed = Engine.load(where, model, _cfg(8, loaded), mse_loss)
            assert (resumed.strategy.offload is not None) == (loaded == "cpu")
            resumed.fit(itertools.islice(stream, resumed.consumed, None))
            out[(saved, loaded)] = torch.equal(flat_params(model), want)
            resumed.close()
    return out


def test_offload_checkpoint_resumes_bit_exact_and_loads_either_way(tmp_path):
    for run in spawn(_resume, 2, str(tmp_path / "ckpt")):
        assert all(run.values()), run


def test_offload_memory_is_host_memory():
    """The accounting's device categories leave the offloaded state out (its device part is the
    staging slots, a piece long each); host_held_bytes counts it: master, moments, the spare,
    the host gradient (and the fused kernel's scratch where it runs)."""
    from engine.runtime.memory_accounting import held_bytes, host_held_bytes

    got = {}
    for offload in ("none", "cpu"):
        cfg = EngineConfig(strategy="zero1", lr=1e-2, micro_batches=1, accumulation="fixed", max_steps=2,
                           optimizer_offload=offload, step_copy="whole")
        engine = Engine(tiny_model(0), cfg, mse_loss)
        engine.fit(iter(worker_stream(0, 4)))
        got[offload] = held_bytes(engine.model, engine.ctx, engine.strategy), host_held_bytes(engine.strategy)
        shard = engine.shard_state.master.numel()
        staging = sum(t.numel() for t in engine.strategy.offload.device_tensors()) if offload == "cpu" else 0
        engine.close()
    (plain, plain_host), (off, off_host) = got["none"], got["cpu"]
    assert plain_host == 0 and plain["optimizer"] == 24 * shard  # master, moments and the spare
    assert off["optimizer"] == 4 * staging and staging <= 3 * shard
    assert 28 * shard <= off_host <= 32 * shard  # + the host gradient (+ the kernel's scratch)
    for k in plain:  # nothing else moved
        if k not in ("optimizer", "comm"):
            assert off[k] == plain[k], k
    assert off["comm"] <= plain["comm"]  # the kernel's scratch, if any, went to the host


@pytest.mark.parametrize("kw,match", [
    (dict(strategy="onebit_adam"), "its compressed stage keeps whole-buffer state"),
    (dict(strategy="diloco"), "use zero1, dpu or acco with it, or optimizer_offload='none'"),
    (dict(strategy="local_sgd"), "use zero1, dpu or acco with it, or optimizer_offload='none'"),
    (dict(strategy="zero1", optimizer="muon"), "Muon's whole matrices on the CPU is not built"),
])
def test_offload_refusals_say_what_to_use(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(optimizer_offload="cpu", **kw)
    with pytest.raises(ValueError, match="optimizer_offload"):
        EngineConfig(optimizer_offload="gpu")
