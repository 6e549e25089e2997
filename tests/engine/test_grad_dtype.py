"""grad_dtype (engine/core/dtypes.py, engine/core/flat.py): a bf16 model's gradient accumulated over
micro-batches in fp32 (the default) against a float64 reference that adds each micro-batch's bf16
gradient, at world 1 and 2, zero1 and acco; the compute-dtype setting measurably further from it;
fp32 models unchanged; the refusal under node sharding; a bit-exact resume."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core.dtypes import resolve_grad_dtype
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, rel_err, tiny_model, worker_stream

K, LR = 8, 1.0  # micro-batches per round; SGD without momentum: step 1 moves the master by lr x the mean gradient


def _cfg(strategy: str, grad_dtype: str, steps: int = 1, **kw) -> EngineConfig:
    base = dict(strategy=strategy, optimizer="sgd", momentum=0.0, weight_decay=0.0, lr=LR, micro_batches=K,
                accumulation="fixed", max_steps=steps, align=8, grad_dtype=grad_dtype)
    return EngineConfig(**{**base, **kw})


def _first_step_gradient(rank: int, world: int, strategy: str, grad_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's fp32 master shard before, after the first committed step)."""
    model = tiny_model(0, torch.bfloat16)
    engine = Engine(model, _cfg(strategy, grad_dtype), mse_loss)
    before = engine.shard_state.master.detach().clone()
    engine.fit(iter(worker_stream(rank, 4 * K, dtype=torch.bfloat16)))
    engine.close()
    assert engine.step == 1
    return before, engine.shard_state.master.detach().clone()


def _runs(rank: int, world: int, strategy: str) -> dict:
    return {g: _first_step_gradient(rank, world, strategy, g) for g in ("float32", "compute")}


def _reference(world: int, strategy: str) -> torch.Tensor:
    """Float64 mean of the first step's micro-batch gradients, each computed in bf16 at theta_0
    (ACCO's first step adds its estimate round's K and its commit round's K, both at theta_0)."""
    model = tiny_model(0, torch.bfloat16)
    per_rank = K * (2 if strategy == "acco" else 1)
    total, count = None, 0
    for rank in range(world):
        for batch in worker_stream(rank, per_rank, dtype=torch.bfloat16):
            m = copy.deepcopy(model)
            mse_loss(m, batch).backward()
            g = torch.cat([p.grad.reshape(-1).double() for p in m.parameters()])
            total = g if total is None else total + g
            count += 1
    return total / count


def _gradients(results: list[dict], numel: int) -> dict[str, torch.Tensor]:
    out = {}
    for g in ("float32", "compute"):
        before = torch.cat([r[g][0] for r in results])[:numel].double()
        after = torch.cat([r[g][1] for r in results])[:numel].double()
        out[g] = (before - after) / LR
    return out


def _check(results: list[dict], world: int, strategy: str) -> None:
    want = _reference(world, strategy)
    got = _gradients(results, want.numel())
    fp32_err, bf16_err = rel_err(got["float32"], want), rel_err(got["compute"], want)
    assert fp32_err < 2e-6, (strategy, world, fp32_err)
    assert bf16_err > 1e-4 and bf16_err > 50 * fp32_err, (strategy, world, fp32_err, bf16_err)


@pytest.mark.parametrize("strategy", ["zero1", "acco"])
def test_world1_accumulates_bf16_gradients_in_fp32(strategy):
    _check([_runs(0, 1, strategy)], 1, strategy)


def _step_bytes(codec: str, grad_dtype: str) -> tuple[int, int]:
    """(one zero1 step's bytes sent by this rank, the trainable values) of a bf16 model (the planner's align)."""
    model = tiny_model(0, torch.bfloat16)
    engine = Engine(model, _cfg("zero1", grad_dtype, codec=codec, optimizer="adamw", lr=1e-2, align=128), mse_loss)
    engine.fit(iter(worker_stream(engine.rank, 2 * K, dtype=torch.bfloat16)))
    engine.close()
    return engine.history[-1]["wire_bytes"], engine.flat.numel


def _both(rank: int, world: int) -> dict:
    out = {s: _runs(rank, world, s) for s in ("zero1", "acco")}
    out["bytes"] = {(c, g): _step_bytes(c, g) for c in ("none", "loco4") for g in ("auto", "float32", "compute")}
    return out


def test_world2_zero1_and_acco_accumulate_in_fp32():
    from engine.planner.modes import Mode
    from engine.planner.wire import Layout, WireSettings, step_bytes

    results = spawn(_both, 2)
    for strategy in ("zero1", "acco"):
        _check([r[strategy] for r in results], 2, strategy)
    # the engine's counters and the planner's formula: fp32 on the wire uncompressed, a codec's
    # bytes unchanged (it encodes from the buffer, whatever its dtype)
    for (codec, g), (sent, numel) in results[0]["bytes"].items():
        ws = WireSettings(compute_bytes=2, grad_dtype=g)
        assert sent == step_bytes(numel, Layout(2, 1), Mode("zero1", codec), ws).rank, (codec, g)
    got = {key: sent for key, (sent, _) in results[0]["bytes"].items()}
    assert got["loco4", "auto"] == got["loco4", "float32"] == got["loco4", "compute"]
    # auto keeps an uncompressed gradient in bf16 (DDP's bytes); float32 sends it in fp32
    assert got["none", "auto"] == got["none", "compute"] < got["none", "float32"]


def test_buffers_and_hooks_follow_the_setting():
    engine = Engine(tiny_model(0, torch.bfloat16), _cfg("acco", "auto", codec="loco4"), mse_loss)
    flat = engine.flat
    assert flat.hooked and all(g.dtype == torch.float32 for g in flat.grads)
    assert all(p.grad is None for p in engine.model.parameters())
    batch = worker_stream(0, 1, dtype=torch.bfloat16)[0]
    engine.feed(batch)  # one micro-batch: its gradient is in the buffer, no .grad is left behind
    assert all(p.grad is None for p in engine.model.parameters()) and flat.grads[flat.active].abs().sum() > 0
    engine.model[0].weight.grad = torch.ones_like(engine.model[0].weight)
    with pytest.raises(RuntimeError, match="is set, but with grad_dtype"):
        flat.check_grads_attached()
    engine.model[0].weight.grad = None
    engine.close()
    for setting, codec in (("compute", "loco4"), ("auto", "none")):  # auto: an uncompressed gradient stays bf16
        compute = Engine(tiny_model(0, torch.bfloat16), _cfg("acco", setting, codec=codec), mse_loss)
        assert not compute.flat.hooked and all(g.dtype == torch.bfloat16 for g in compute.flat.grads), setting
        compute.close()
    local = Engine(tiny_model(0, torch.bfloat16), _cfg("diloco", "auto"), mse_loss)  # no gradient on the wire
    assert local.flat.hooked and all(g.dtype == torch.float32 for g in local.flat.grads)
    local.close()


def test_fp32_models_are_unchanged_by_the_setting():
    """fp32 parameters: every grad_dtype gives the same bits, the same buffers and no hooks."""
    from engine.runtime.memory_accounting import held_bytes

    runs = {}
    for g in ("auto", "float32", "compute"):
        model = tiny_model(0)
        engine = Engine(model, _cfg("acco", g, steps=3, codec="loco4", optimizer="adamw", lr=1e-2), mse_loss)
        history = engine.fit(iter(worker_stream(0, 8 * K)))
        engine.close()
        assert not engine.flat.hooked and all(b.dtype == torch.float32 for b in engine.flat.grads)
        runs[g] = (flat_params(model), [h["loss"] for h in history], held_bytes(engine.model, engine.ctx, engine.strategy))
    for g in ("auto", "float32"):
        assert torch.equal(runs[g][0], runs["compute"][0]) and runs[g][1] == runs["compute"][1]
        assert runs[g][2] == runs["compute"][2]  # not one byte more held


def test_resolution_and_the_refusal_under_node_sharding():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert resolve_grad_dtype("auto", bf16, node_sharded=False) == fp32
    assert resolve_grad_dtype("auto", bf16, node_sharded=False, uncompressed=True) == bf16
    assert resolve_grad_dtype("float32", bf16, node_sharded=False, uncompressed=True) == fp32
    assert resolve_grad_dtype("compute", bf16, node_sharded=False) == bf16
    assert resolve_grad_dtype("auto", bf16, node_sharded=True) == bf16
    assert resolve_grad_dtype("float32", fp32, node_sharded=True) == fp32
    with pytest.raises(ValueError, match="use grad_dtype='auto' or 'compute'"):
        resolve_grad_dtype("float32", bf16, node_sharded=True)
    with pytest.raises(ValueError, match="use grad_dtype='auto' or 'compute'"):  # known at config time
        EngineConfig(model_sharding="node", compute_dtype="bfloat16", grad_dtype="float32")
    with pytest.raises(ValueError, match="unknown grad_dtype"):
        EngineConfig(grad_dtype="bfloat16")
    EngineConfig(model_sharding="node", compute_dtype="bfloat16", grad_dtype="compute")


def test_engine_refuses_fp32_gradients_of_bf16_shards():
    """compute_dtype auto: the model's bf16 is known only when the engine is built."""
    cfg = EngineConfig(micro_batches=1, accumulation="fixed", max_steps=1, align=8, model_sharding="node",
                       grad_dtype="float32")
    with pytest.raises(ValueError, match="use grad_dtype='auto' or 'compute'"):
        Engine(tiny_model(0, torch.bfloat16), cfg, mse_loss)


@pytest.mark.parametrize("strategy", ["zero1", "acco"])
def test_resume_with_fp32_accumulation_is_bit_exact(strategy, tmp_path):
    """Saved after 4 steps (zero1: and one micro-batch of the next round, so that the fp32
    pending gradient travels in the checkpoint): the resumed run is the straight run's bits."""
    def cfg(steps):
        return EngineConfig(strategy=strategy, lr=1e-2, micro_batches=3, accumulation="fixed", max_steps=steps,
                            align=8, grad_dtype="float32")

    stream = worker_stream(0, 100, dtype=torch.bfloat16)
    straight = Engine(tiny_model(0, torch.bfloat16), cfg(8), mse_loss)
    h_straight = straight.fit(stream)
    straight.close()
    mid_round = strategy == "zero1"  # no round in flight between micro-batches (acco's overlap has one)
    first = Engine(tiny_model(0, torch.bfloat16), cfg(8 if mid_round else 4), mse_loss)
    h_first = first.fit(stream, steps=4)
    if mid_round:
        first.feed(stream[first.consumed])
    first.save(str(tmp_path / "ckpt"))
    first.close()
    model = tiny_model(123, torch.bfloat16)
    resumed = Engine.load(str(tmp_path / "ckpt"), model, cfg(8), mse_loss)
    flat = resumed.flat
    assert resumed.step == 4 and flat.hooked and flat.grads[flat.active].dtype == torch.float32
    if mid_round:
        assert resumed.state.pending_count == 1 and flat.grads[flat.active].abs().sum() > 0
    h_second = resumed.fit(itertools.islice(stream, resumed.consumed, None))
    resumed.close()
    assert torch.equal(flat_params(straight.model), flat_params(model))
    assert torch.equal(straight.shard_state.master, resumed.shard_state.master)
    assert [h["loss"] for h in h_straight] == [h["loss"] for h in h_first + h_second]
