"""A sharded round gathers the new parameters into the gradient buffer it has just reduced
(RoundContext.gather_target) instead of a buffer of their own: the same bits as the run that keeps
one (``gathers_into_gradients`` off, the layout before the change: ``gather_buf`` a copy of the
parameters), for acco and dpu with and without loco4 + int4/int8 parameter deltas, flat at world 2,
two-level and node-sharded at 2 x 2, through a NaN-skipped step, a checkpoint resumed mid-run and
poisoned freed buffers; the rank's accounting then holds no gathered buffer, as the planner says."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.engine.test_model_sharding import grouped_model, whole_params
from tests.tiny import worker_stream

MODES = {
    "acco": {"strategy": "acco", "comm_chunks": 2, "weight_decay": 0.1},
    "dpu": {"strategy": "dpu"},
    "acco+loco4+int4": {"strategy": "acco", "codec": "loco4", "param_codec": "int4"},
    "dpu+loco4+int8": {"strategy": "dpu", "codec": "loco4", "param_codec": "int8", "comm_chunks": 2},
    # bf16 parameters gathered into the first half of an fp32 gradient buffer (flat and two-level;
    # node-sharded gradients are bf16 themselves)
    "acco+loco4+int4 bf16": {"strategy": "acco", "codec": "loco4", "param_codec": "int4", "compute_dtype": "bfloat16"},
    "dpu+loco4 bf16": {"strategy": "dpu", "codec": "loco4", "compute_dtype": "bfloat16"},
}
LAYOUTS = {  # name: (world, settings, environment)
    "flat 2": (2, {}, {}),
    "two-level 2x2": (4, {"topology": "two_level"}, {"LOCAL_WORLD_SIZE": "2"}),
    "node-sharded 2x2": (4, {"model_sharding": "node"}, {"LOCAL_WORLD_SIZE": "2"}),
}
FIRST, STEPS = 3, 6  # saved after FIRST steps, resumed to STEPS


def _cfg(mode: str, layout: dict, steps: int) -> EngineConfig:
    return EngineConfig(lr=1e-2, micro_batches=2, accumulation="fixed", max_steps=steps, nan_policy="skip",
                        poison_freed_buffers=True, **MODES[mode], **layout)


def _nan_on(rank: int, batch_index: int):
    """The mean squared error in fp32 whatever the parameters' dtype, NaN in rank 1's
    ``batch_index``-th micro-batch (1-based)."""
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        dtype = next(model.parameters()).dtype
        loss = torch.nn.functional.mse_loss(model(batch[0].to(dtype)).float(), batch[1])
        return loss * float("nan") if rank == 1 and calls[0] == batch_index else loss
    return loss_fn


def _state(engine: Engine) -> dict[str, torch.Tensor]:
    out = {f"opt.{k}": v.detach().clone() for k, v in engine.shard_state.tensors().items()}
    feedback = engine.grads.feedback
    if feedback is not None:
        out.update({f"fb.{k}": v.detach().clone() for k, v in feedback.state_dict().items()})
    out["params"] = whole_params(engine.model)
    return out


def _run(rank: int, mode: str, layout: dict, root: str) -> dict:
    """FIRST steps (rank 1's 5th micro-batch NaN: a skipped step), a save, a resume into a model
    built otherwise, the rest; the losses, the state after each half and what the rank holds."""
    from engine.runtime.memory_accounting import held_bytes

    stream = worker_stream(rank, 200)
    first = Engine(grouped_model(), _cfg(mode, layout, FIRST), _nan_on(rank, 5))
    history = first.fit(iter(stream))
    mid = _state(first)
    first.save(root)
    first.close()
    model = grouped_model(seed=7)  # other values: everything must come from the checkpoint
    resumed = Engine.load(root, model, _cfg(mode, layout, STEPS), _nan_on(rank, 5))
    history += resumed.fit(itertools.islice(stream, resumed.consumed, None))
    out = {"losses": [h["loss"] for h in history], "skipped": [h["skipped"] for h in history],
           "mid": mid, "end": _state(resumed), "separate": resumed.ctx.gather_buf is not None,
           "held": held_bytes(resumed.model, resumed.ctx, resumed.strategy)}
    resumed.close()
    return out


def _both(rank: int, world: int, layout: dict, root: str, modes: list[str]) -> dict:
    from engine.strategies.sharded import ShardedStrategy

    out = {}
    for mode in modes:
        for into_grads in (True, False):
            ShardedStrategy.gathers_into_gradients = into_grads  # False: a gathered buffer of its own
            try:
                out[mode, into_grads] = _run(rank, mode, layout, f"{root}/{mode}-{into_grads}")
            finally:
                ShardedStrategy.gathers_into_gradients = True
    return out


def _same(a, b, where) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")


def _check(layout: str, root: str, modes: list[str]) -> None:
    world, settings, env = LAYOUTS[layout]
    runs = spawn(_both, world, settings, root, modes, timeout=900, env=env)
    for rank, run in enumerate(runs):
        for mode in modes:
            new, old = run[mode, True], run[mode, False]
            where = f"{layout} {mode} rank {rank}"
            assert not new["separate"] and old["separate"], where
            assert any(new["skipped"]) and not all(new["skipped"]), (where, new["skipped"])
            assert new["skipped"] == old["skipped"], where
            assert all(math.isfinite(x) for x, s in zip(new["losses"], new["skipped"]) if not s), where
            _same(torch.tensor(new["losses"]), torch.tensor(old["losses"]), where)
            for half in ("mid", "end"):
                assert new[half].keys() == old[half].keys(), where
                for key in new[half]:
                    _same(new[half][key], old[half][key], f"{where} {half} {key}")
            # the bytes the alias saves: the gathered buffer, e per local value; nothing else moves
            assert new["held"]["gathered"] == 0 and old["held"]["gathered"] > 0, where
            saved = {k: old["held"][k] - new["held"][k] for k in old["held"]}
            assert saved == {**{k: 0 for k in saved}, "gathered": old["held"]["gathered"]}, (where, saved)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gathering_into_the_reduced_gradient_buffer_gives_the_same_bits(layout, tmp_path):
    _check(layout, str(tmp_path), list(MODES))


def test_the_delta_gather_onto_the_reduced_buffer_gives_the_same_bits_flat_2(tmp_path):
    """The fast set's representative: the mode whose gather adds onto the buffer (int4 deltas)."""
    _check("flat 2", str(tmp_path), ["acco+loco4+int4"])
