"""SGD with momentum on a flat shard, the rule of torch.optim.SGD (no dampening; the momentum
buffer starts as the first gradient; weight decay added to the gradient), as a pure function."""

from __future__ import annotations

import torch

from .shard_state import ShardState


def init_state(master: torch.Tensor, spec) -> ShardState:
    return ShardState(master=master, exp_avg=torch.zeros_like(master))


def propose(state: ShardState, grad: torch.Tensor, lr: float, spec) -> ShardState:
    d_p = grad.add(state.master, alpha=spec.weight_decay) if spec.weight_decay else grad
    buf = state.exp_avg
    if spec.momentum:
        buf = d_p.clone() if state.step == 0 else state.exp_avg.mul(spec.momentum).add_(d_p)
        d_p = d_p.add(buf, alpha=spec.momentum) if spec.nesterov else buf
    params = state.master.add(d_p, alpha=-lr)
    return ShardState(master=params, exp_avg=buf, exp_avg_sq=None, step=state.step + 1)
