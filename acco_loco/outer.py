"""The outer step of the local-step strategies (diloco, sparseloco), as pure functions of flat
fp32 tensors; docs/local_steps.md states the whole round.

Every worker w holds the synchronised parameters ``theta_sync`` (the same on every replica) and
its own ``theta_w`` after H inner optimizer steps taken alone. One outer round:

    Delta_w   = theta_sync - theta_w                                   (the pseudo-gradient)
    diloco:     Delta = sum_w a_w Delta_w,  theta_sync = SGD(theta_sync, Delta; outer_lr, momentum, nesterov)
                (Douillard et al., DiLoCo, arXiv 2311.08105: outer Nesterov momentum, lr 0.7, momentum 0.9)
    sparseloco: e_w = beta e_w + Delta_w;  send C(e_w);  e_w = e_w - deQ(C(e_w))
                Delta = combine_w(deQ(C(e_w)));  theta_sync = theta_sync - outer_lr Delta
                (Sarfi et al., SparseLoCo, arXiv 2508.15706: the error feedback replaces the outer momentum)

with ``a_w = n_w / sum_v n_v`` the share of the round's samples worker w ran (1/R when all ran as
many). The outer SGD is acco_loco/sgd.py's rule (torch.optim.SGD: the momentum buffer starts as
the first pseudo-gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import sgd
from .optim import OptimizerSpec
from .shard_state import ShardState


def pseudo_gradient(theta_sync: Tensor, theta_local: Tensor) -> Tensor:
    """Delta = theta_sync - theta_local, in fp32: how far the worker moved, as a descent direction."""
    return theta_sync.to(torch.float32) - theta_local.to(torch.float32)


def sample_shares(samples: list[int] | list[float]) -> list[float]:
    """Each worker's share a_w = n_w / sum n of the round's samples (all 0 when nobody ran any)."""
    total = float(sum(samples))
    return [float(n) / total if total > 0 else 0.0 for n in samples]


def outer_sgd_spec(momentum: float, nesterov: bool) -> OptimizerSpec:
    """The outer optimizer as a shard-optimizer spec: SGD without weight decay."""
    return OptimizerSpec(name="sgd", momentum=momentum, nesterov=nesterov, weight_decay=0.0)


def outer_sgd_step(state: ShardState, delta: Tensor, lr: float, spec: OptimizerSpec) -> ShardState:
    """DiLoCo's outer step on ``state`` (master = theta_sync, exp_avg = the momentum buffer), as a
    proposal in new tensors; ``state`` is left untouched."""
    return sgd.propose(state, delta.to(torch.float32), lr, spec)


def accumulate_error(error: Tensor, delta: Tensor, beta: float, scale: float = 1.0) -> Tensor:
    """SparseLoCo's error feedback, in place: e = beta e + scale Delta (scale 1: the paper's; the
    outer lr: templar's, docs/sparseloco.md)."""
    return error.mul_(beta).add_(delta, alpha=scale)


def sparse_outer_step(theta_sync: Tensor, delta: Tensor, lr: float) -> Tensor:
    """theta_sync - lr Delta, as a new tensor (SparseLoCo has no outer momentum)."""
    return theta_sync.add(delta, alpha=-lr)


def merge_delayed(theta_local: Tensor, theta_sync_new: Tensor, submitted: Tensor) -> Tensor:
    """The overlapped variant's merge, in place: ``theta_local += theta_sync_new - submitted``,
    where ``submitted`` is what theta_local was when its round was sent. The worker keeps the
    progress it made while the round travelled and moves its start to the new sync point."""
    return theta_local.add_(theta_sync_new - submitted)
