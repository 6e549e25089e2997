"""Muon on a flat shard (Jordan et al., "Muon: An optimizer for hidden layers in neural
networks", 2024; torch.optim.Muon): for each whole 2-D matrix the shard holds, the momentum
buffer ``m = beta m + (1 - beta) g`` (Nesterov: the update ``g + beta (m - g)``), orthogonalized
by torch's Newton-Schulz iteration, applied with torch's shape-adjusted learning rate and
decoupled weight decay; every other value (embeddings, the head, 1-D parameters, the padding)
takes AdamW's step, as Muon is used in practice. The Newton-Schulz iteration and the
learning-rate adjustment are torch's own (``torch.optim._muon``, torch >= 2.9), not rewritten.

A matrix is stepped whole, so the sharded optimizer gives each owner whole matrices
(acco_loco/matrix_layout.py). The state is the shard's: ``exp_avg`` holds Muon's momentum buffer
at a matrix's values and AdamW's first moment elsewhere; ``exp_avg_sq`` AdamW's second moment
(unused, and left at 0, at a matrix's values)."""

from __future__ import annotations

import torch

from . import adamw
from .shard_state import ShardState

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults
NS_EPS = 1e-7


def init_state(master: torch.Tensor, spec) -> ShardState:
    return adamw.init_state(master, spec)


def spans(matrices, a: int, b: int) -> list[tuple[int, int]]:
    """The AdamW spans of ``[a, b)``: what the matrices (``(start, rows, cols)``, sorted) leave."""
    out, at = [], a
    for start, rows, cols in matrices:
        end = start + rows * cols
        if end <= at or start >= b:
            continue
        if start > at:
            out.append((at, start))
        at = max(at, end)
    if at < b:
        out.append((at, b))
    return out


def step_matrix(state: ShardState, g: torch.Tensor, lr: float, spec, out: ShardState, start: int, rows: int,
                cols: int) -> None:
    """Muon's step of the matrix at ``[start, start + rows * cols)`` of the shard, its gradient
    ``g`` ([rows, cols], fp32), from ``state`` into ``out`` (torch.optim.Muon's operations, in
    its order)."""
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # torch >= 2.9

    sl = slice(start, start + rows * cols)
    buf = torch.lerp(state.exp_avg[sl].view(rows, cols), g, 1 - spec.muon_momentum)
    update = g.lerp(buf, spec.muon_momentum) if spec.muon_nesterov else buf
    update = _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, spec.muon_ns_steps, NS_EPS)
    adjusted = _adjust_lr(lr, spec.muon_adjust_lr, torch.Size((rows, cols)))
    out.exp_avg[sl].copy_(buf.view(-1))
    if out.exp_avg_sq is not state.exp_avg_sq:
        out.exp_avg_sq[sl].copy_(state.exp_avg_sq[sl])
    torch.mul(state.master[sl], 1 - lr * spec.weight_decay, out=out.master[sl]).add_(update.reshape(-1), alpha=-adjusted)


def propose_range(state: ShardState, grad_of, lr: float, spec, out: ShardState, a: int, b: int,
                  matrices) -> None:
    """Values ``[a, b)`` of the step into ``out``: AdamW on the spans no matrix covers, and every
    matrix that starts in ``[a, b)`` whole (it may reach past ``b``: a later range leaves it).
    ``grad_of(lo, hi)``: the fp32 gradient of values ``[lo, hi)``."""
    for lo, hi in spans(matrices, a, b):
        part = ShardState(state.master[lo:hi], state.exp_avg[lo:hi], state.exp_avg_sq[lo:hi], state.step)
        target = ShardState(out.master[lo:hi], out.exp_avg[lo:hi], out.exp_avg_sq[lo:hi])
        adamw.propose_into(part, grad_of(lo, hi), lr, spec, target)
    for start, rows, cols in matrices:
        if a <= start < b:
            step_matrix(state, grad_of(start, start + rows * cols).view(rows, cols), lr, spec, out, start, rows, cols)


def propose(state: ShardState, grad: torch.Tensor, lr: float, spec) -> ShardState:
    out = ShardState(torch.empty_like(state.master), torch.empty_like(state.exp_avg),
                     torch.empty_like(state.exp_avg_sq), step=state.step + 1)
    propose_range(state, lambda lo, hi: grad[lo:hi], lr, spec, out, 0, state.master.numel(), state.matrices)
    return out
