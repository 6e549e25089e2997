"""The fused CPU kernels (acco_loco/kernels.py) against the torch code they replace, bit for bit,
and their clean fallback."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from acco_loco import kernels
from acco_loco.optim import OptimizerSpec, init_state, propose_slice, propose_step
from acco_loco.shard_state import ShardState


def test_kernels_agree_with_torch():
    import shutil

    if not (shutil.which("ninja") or shutil.which(os.path.join(os.path.dirname(sys.executable), "ninja"))) \
            or not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no ninja or C++ compiler here: the torch path only")
    # with the tools there, the kernels must build and pass their own check (a silent fallback
    # to the torch path would hide a kernel that disagrees); on a CUDA node they are built on request
    kernels.use(True)
    assert kernels.available()
    from acco_loco.kernel_check import self_check

    assert self_check(kernels) == []


def test_off_means_the_torch_path():
    try:
        kernels.use(False)
        assert not kernels.available()
    finally:
        kernels.use(True)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("fused", [True, False])
def test_propose_slice_pieces_equal_the_whole_step(name, fused):
    """Stepping the shard piece by piece (the pipelined round) gives propose_step's bits."""
    gen = torch.Generator().manual_seed(0)
    n = 1000
    spec = OptimizerSpec(name=name, weight_decay=0.01)
    state = init_state(torch.randn(n, generator=gen), spec)
    state.step = 3
    state.exp_avg.copy_(0.1 * torch.randn(n, generator=gen))
    if state.exp_avg_sq is not None:
        state.exp_avg_sq.copy_(0.01 * torch.rand(n, generator=gen))
    grad_sum = torch.randn(n, generator=gen)
    count, coef = 3, 0.4
    want = propose_step(state, grad_sum / count * coef, 1e-2, spec)
    try:
        kernels.use(fused)
        out = state.spare()
        scratch = torch.empty(n)
        for a, b in [(0, 64), (64, 96), (96, 1000)]:
            propose_slice(state, grad_sum, count, coef, 1e-2, spec, out, a, b, scratch)
    finally:
        kernels.use(True)
    assert out.step == want.step
    for key, t in want.tensors().items():
        assert torch.equal(getattr(out, key), t), key


def test_spare_buffers_are_recycled_not_shared():
    state = ShardState(torch.zeros(8), torch.zeros(8), torch.zeros(8))
    proposal = state.spare()
    proposal.master.fill_(1.0)
    old_master = state.master
    state.install(proposal, recycle=True)
    assert state.master is proposal.master and state.step == 1
    nxt = state.spare()
    assert nxt.master is old_master  # the old state's tensors, reused
    assert all(a is not b for a, b in zip(nxt.tensors().values(), state.tensors().values()))
