"""1-bit Adam keeps the frozen denominator d in v_T's place (engine/strategies/onebit_adam.py): its
compressed-stage checkpoint holds ``onebit.denominator``; one written before that holds
``onebit.variance`` (v_T), which loading turns into d with the freeze's own operations, bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from acco_loco import onebit
from acco_loco.optim import OptimizerSpec
from acco_loco.shard_state import ShardState
from engine.strategies.onebit_adam import OnebitAdam

NUMEL, FROZEN_STEP = 256, 7


def _ctx():
    """What load_state_dict reads of a flat one-rank fp32 run (the parameters are the master)."""
    spec = OptimizerSpec(betas=(0.9, 0.99), eps=1e-8)
    return SimpleNamespace(gather_buf=torch.zeros(NUMEL), spec=spec, cfg=SimpleNamespace(param_codec="auto"),
                           flat=SimpleNamespace(shard_size=NUMEL), grads=None, dims=None,
                           comm=SimpleNamespace(rank=0), shard_state=ShardState(torch.zeros(1), torch.zeros(1)))


def _saved(second_moment_key: str, second_moment: torch.Tensor) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"onebit.momentum": torch.randn(NUMEL, generator=gen), second_moment_key: second_moment,
            "onebit.mask": second_moment == 0, "onebit.worker_error": torch.zeros(NUMEL),
            "onebit.server_error": torch.zeros(NUMEL)}


def _load(tensors):
    strategy, ctx = OnebitAdam(SimpleNamespace(group_size=128, scale_dtype="float32")), _ctx()
    meta = {"onebit": {"phase": "compressed", "norms": [], "frozen_step": FROZEN_STEP}, "opt_step": FROZEN_STEP + 2}
    strategy.load_state_dict(ctx, tensors, meta)
    return strategy, ctx


def test_an_old_checkpoints_variance_becomes_the_freezes_denominator():
    v = torch.rand(NUMEL, generator=torch.Generator().manual_seed(1)).pow(3)
    v[:5] = 0.0  # never had a gradient
    strategy, ctx = _load(_saved("onebit.variance", v.clone()))
    want = onebit.frozen_denominator(v.clone(), FROZEN_STEP, ctx.spec)
    assert torch.equal(strategy.state.denominator, want)
    assert torch.equal(ctx.shard_state.exp_avg_sq, want)  # the engine's shard state views it
    assert ctx.shard_state.step == FROZEN_STEP + 2
    saved, _ = strategy.state_dict(ctx)
    assert "onebit.variance" not in saved and torch.equal(saved["onebit.denominator"], want)

    # a checkpoint with the denominator loads it as it is
    again, _ = _load(saved)
    assert torch.equal(again.state.denominator, want)
