"""Functional optimizer steps on one flat fp32 shard.

Every function here is pure tensor math: no process groups, no threads. The engine calls them on
the shard a worker owns. ``commit=False`` computes the parameters an update *would* give without
touching the optimizer state; that is ACCO's estimate step, which needs no snapshot/restore copy.

The AdamW and SGD rules follow torch.optim.AdamW / torch.optim.SGD exactly (same bias
correction, same decoupled weight decay), so a single worker matches them bit for bit up to
float rounding order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class OptimizerSpec:
    """Hyper-parameters of the shard optimizer (the learning rate comes per step)."""

    name: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    nesterov: bool = False  # sgd only

    def __post_init__(self) -> None:
        # NaN fails every comparison, so each range check asks for finite numbers first
        if not isinstance(self.name, str) or self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}: choose one of {OPTIMIZERS}")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(finite_number(b) and 0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got {self.betas!r}")
        if not (finite_number(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be a finite number > 0, got {self.eps!r}")
        if not (finite_number(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if not (finite_number(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum must be a finite number in [0, 1), got {self.momentum!r}")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov must be True or False, got {self.nesterov!r}")


def finite_number(value) -> bool:
    """An int or float (not a bool) that is finite as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


@dataclass
class ShardState:
    """Optimizer state of one shard: the fp32 master and the moments.

    ``step`` counts applied updates (skipped non-finite steps do not count), which is what
    Adam's bias correction needs.
    """

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor | None = None
    step: int = 0

    @classmethod
    def create(cls, master: torch.Tensor, spec: OptimizerSpec) -> "ShardState":
        master = master.detach().to(torch.float32).clone()
        exp_avg = torch.zeros_like(master)
        exp_avg_sq = torch.zeros_like(master) if spec.name == "adamw" else None
        return cls(master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)

    def install(self, proposal: "ShardState") -> None:
        """Take a proposed step's tensors as this state (no copy)."""
        self.master, self.exp_avg, self.exp_avg_sq, self.step = (
            proposal.master, proposal.exp_avg, proposal.exp_avg_sq, proposal.step)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"master": self.master, "exp_avg": self.exp_avg}
        if self.exp_avg_sq is not None:
            out["exp_avg_sq"] = self.exp_avg_sq
        return out


def propose_step(state: ShardState, grad: torch.Tensor, lr: float, spec: OptimizerSpec) -> ShardState:
    """The state one optimizer step gives, in new tensors; ``state`` is left untouched.

    The engine installs the proposal (``ShardState.install``) only once every rank's new
    parameters are known to be finite, so a step that would overflow leaves no trace.
    """
    if grad.shape != state.master.shape:
        raise ValueError(f"gradient shard has shape {tuple(grad.shape)}, master has {tuple(state.master.shape)}")
    grad = grad.to(torch.float32)
    if spec.name == "adamw":
        return _adamw(state, grad, lr, spec)
    return _sgd(state, grad, lr, spec)


def optimizer_step(
    state: ShardState, grad: torch.Tensor, lr: float, spec: OptimizerSpec, commit: bool
) -> torch.Tensor:
    """One optimizer step on a shard; returns the new fp32 parameters.

    commit=True installs the new state into ``state`` (master, moments, step) and returns
    ``state.master``. commit=False leaves ``state`` untouched (ACCO's estimate step).
    """
    proposal = propose_step(state, grad, lr, spec)
    if not commit:
        return proposal.master
    state.install(proposal)
    return state.master


def _adamw(state: ShardState, grad: torch.Tensor, lr: float, spec: OptimizerSpec) -> ShardState:
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


def _sgd(state: ShardState, grad: torch.Tensor, lr: float, spec: OptimizerSpec) -> ShardState:
    d_p = grad.add(state.master, alpha=spec.weight_decay) if spec.weight_decay else grad
    buf = state.exp_avg
    if spec.momentum:
        # torch.optim.SGD seeds the buffer with the first gradient (no dampening here)
        buf = d_p.clone() if state.step == 0 else state.exp_avg.mul(spec.momentum).add_(d_p)
        d_p = d_p.add(buf, alpha=spec.momentum) if spec.nesterov else buf
    params = state.master.add(d_p, alpha=-lr)
    return ShardState(master=params, exp_avg=buf, exp_avg_sq=None, step=state.step + 1)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """Factor that scales a gradient of norm ``total_norm`` down to ``max_norm`` (torch's rule)."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
