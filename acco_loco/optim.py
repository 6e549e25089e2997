"""Shard optimizers: functional steps on one flat fp32 shard, by config name.

Every function here is pure tensor math: no process groups, no threads. The engine calls them on
the shard a worker owns. A step is a *proposal* in new tensors; ``commit=False`` (ACCO's estimate
step) never installs it, so no snapshot/restore copy is needed.

An optimizer is a module with ``init_state(master, spec) -> ShardState`` and
``propose(state, grad, lr, spec) -> ShardState`` (acco_loco/adamw.py, acco_loco/sgd.py) plus a
line in OPTIMIZERS (acco_loco/optimizers.py, with OptimizerSpec). AdamW and SGD follow torch.optim.AdamW / torch.optim.SGD exactly, so a
single worker matches them bit for bit up to float rounding order.
"""

from __future__ import annotations

import torch

from .optimizers import OPTIMIZERS, OptimizerSpec, finite_number  # noqa: F401  (re-exported)
from .shard_state import ShardState


def init_state(master: torch.Tensor, spec: OptimizerSpec, matrices=()) -> ShardState:
    """A fresh state around an fp32 copy of ``master``; ``matrices``: the (start, rows, cols) of
    the matrices in it that an optimizer steps whole (Muon's; the layout keeps each in one shard)."""
    state = OPTIMIZERS[spec.name].init_state(master.detach().to(torch.float32).clone(), spec)
    state.matrices = tuple(sorted(matrices))
    return state


def propose_step(state: ShardState, grad: torch.Tensor, lr: float, spec: OptimizerSpec) -> ShardState:
    """The state one optimizer step gives, in new tensors; ``state`` is left untouched.

    The engine installs the proposal (``ShardState.install``) only once every rank's new
    parameters are known to be finite, so a step that would overflow leaves no trace.
    """
    if grad.shape != state.master.shape:
        raise ValueError(f"gradient shard has shape {tuple(grad.shape)}, master has {tuple(state.master.shape)}")
    return OPTIMIZERS[spec.name].propose(state, grad.to(torch.float32), lr, spec)


def propose_slice(state: ShardState, grad_sum: torch.Tensor, count: int, coef: float, lr: float,
                  spec: OptimizerSpec, out: ShardState, a: int, b: int, scratch: torch.Tensor | None = None,
                  fused: bool | None = None) -> None:
    """Values ``[a, b)`` of ``propose_step(state, grad, lr, spec)`` for ``grad = grad_sum / count``
    scaled by ``coef`` when below 1 (clipping), written into ``out``'s tensors: the same bits as
    the whole step (AdamW and SGD are elementwise; Muon steps each matrix whole with the piece it
    starts in, and the pieces after it leave its values), so a round can step the shard piece by
    piece and send each piece as soon as it is done. ``a`` and ``b`` are shard indices: ``out``
    may hold the whole shard (a spare), only values [a, b) (a piece-sized scratch,
    ``ShardState.start`` a; not for Muon, whose matrices reach past a piece), or be ``state``
    itself (the step recomputed in place: the same operations on the same values, so the same
    bits; the fused kernel reads each value before it writes it). Reads ``state.step + 1`` for
    the step's count. ``scratch``: fp32, at least ``b - a`` long (the fused kernel's square
    roots). ``fused``: what ``can_fuse`` said for these tensors (asked here when None)."""
    module = OPTIMIZERS[spec.name]
    if hasattr(module, "propose_range"):  # whole matrices (Muon): each stepped with the range it starts in
        if out.start != 0 or out.master.numel() != state.master.numel():
            raise ValueError(f"optimizer {spec.name!r} steps whole matrices that may reach past a piece: "
                             "propose into a whole-shard state (step_copy='whole')")

        def grad_of(lo: int, hi: int) -> torch.Tensor:
            grad = grad_sum[lo:hi] / count
            return (grad.mul_(coef) if coef < 1.0 else grad).to(torch.float32)

        module.propose_range(state, grad_of, lr, spec, out, a, b, state.matrices)
        return
    sl = slice(a, b)
    part, target = state.part(a, b), out.part(a, b)
    if fused is None:
        fused = can_fuse(spec, grad_sum, state, out)
    if fused and scratch is not None:
        from . import kernels

        kernels.adamw(grad_sum[sl], count, coef, part.exp_avg, part.exp_avg_sq, part.master,
                      target.exp_avg, target.exp_avg_sq, target.master, lr, state.step + 1, spec, scratch[:b - a])
        return
    grad = grad_sum[sl] / count
    if coef < 1.0:
        grad.mul_(coef)
    grad = grad.to(torch.float32)
    if hasattr(module, "propose_into"):
        module.propose_into(part, grad, lr, spec, target)
        return
    new = module.propose(part, grad, lr, spec)
    for name, t in new.tensors().items():
        getattr(target, name).copy_(t)


def can_fuse(spec: OptimizerSpec, grad_sum: torch.Tensor, *states: ShardState) -> bool:
    """Whether propose_slice steps these with the fused CPU kernel (acco_loco/kernel_policy.py)."""
    from . import kernel_policy  # the kernels load only when a step asks

    return kernel_policy.optimizer(spec, grad_sum, *states)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """Factor that scales a gradient of norm ``total_norm`` down to ``max_norm`` (torch's rule)."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
