"""acco_loco/kernel_policy.py is the one place that says where the fused kernels run: what it
accepts and refuses, and that nothing runs them when they are not available."""

from __future__ import annotations

import pytest
import torch

from acco_loco import kernel_policy, kernels
from acco_loco.feedback import ErrorFeedback
from acco_loco.optim import OptimizerSpec, ShardState, can_fuse
from acco_loco.registry import make_codec

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the fused kernels are not built here")


def state(n: int = 256, dtype=torch.float32) -> ShardState:
    return ShardState(torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype))


@needs_kernels
def test_what_the_kernels_take():
    int4, sign1 = make_codec("int4", 128), make_codec("sign1", 128)
    fb = ErrorFeedback("loco", 256, group_size=128)
    assert kernel_policy.wire_codec(int4) and not kernel_policy.wire_codec(sign1)
    assert not kernel_policy.wire_codec(make_codec("int4", 128, torch.bfloat16))  # bf16 scales
    assert kernel_policy.reducer(int4, fb, None, "cpu")
    assert not kernel_policy.reducer(int4, fb, torch.Generator(), "cpu")  # stochastic rounding
    assert not kernel_policy.reducer(int4, ErrorFeedback("loco", 256, storage="fp32"), None, "cpu")
    assert not kernel_policy.reducer(int4, ErrorFeedback("loco", 256, group_size=64), None, "cpu")
    assert not kernel_policy.reducer(int4, fb, None, "meta")  # not the CPU
    g = torch.zeros(256)
    adamw, sgd = OptimizerSpec(name="adamw"), OptimizerSpec(name="sgd")
    assert kernel_policy.optimizer(adamw, g, state()) and can_fuse(adamw, g, state())
    assert not kernel_policy.optimizer(sgd, g, state())
    assert not kernel_policy.optimizer(adamw, g.to(torch.bfloat16), state())
    assert not kernel_policy.fits(torch.zeros(4, 4).t())  # not contiguous


def test_nothing_is_fused_when_the_kernels_are_not_available(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    int4 = make_codec("int4", 128)
    assert not kernel_policy.wire_codec(int4)
    assert not kernel_policy.reducer(int4, ErrorFeedback("loco", 256, group_size=128), None, "cpu")
    assert not kernel_policy.optimizer(OptimizerSpec(name="adamw"), torch.zeros(256), state())
