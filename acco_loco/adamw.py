"""AdamW on a flat shard, the rule of torch.optim.AdamW (same bias correction, decoupled weight
decay; Loshchilov & Hutter, arXiv 1711.05101), as a pure function of the state."""

from __future__ import annotations

import math

import torch

from .shard_state import ShardState


def init_state(master: torch.Tensor, spec) -> ShardState:
    return ShardState(master=master, exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master))


def propose(state: ShardState, grad: torch.Tensor, lr: float, spec) -> ShardState:
    beta1, beta2 = spec.betas
    step = state.step + 1
    exp_avg = state.exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = state.exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
    params = state.master.mul(1 - lr * spec.weight_decay)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(spec.eps)
    params.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    return ShardState(master=params, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step)


def propose_into(state: ShardState, grad: torch.Tensor, lr: float, spec, out: ShardState) -> None:
    """``propose`` written into ``out``'s tensors (same shapes), the same operations in the same
    order: the same bits, without allocating the new state."""
    beta1, beta2 = spec.betas
    step = state.step + 1
    torch.lerp(state.exp_avg, grad, 1 - beta1, out=out.exp_avg)
    torch.mul(state.exp_avg_sq, beta2, out=out.exp_avg_sq).addcmul_(grad, grad, value=1 - beta2)
    torch.mul(state.master, 1 - lr * spec.weight_decay, out=out.master)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    denom = out.exp_avg_sq.sqrt().div_(bias_correction2_sqrt).add_(spec.eps)
    out.master.addcdiv_(out.exp_avg, denom, value=-lr / bias_correction1)
