"""Muon on a flat shard (Jordan et al., "Muon: An optimizer for hidden layers in neural
networks", 2024; torch.optim.Muon): for each whole 2-D matrix the shard holds, the momentum
buffer ``m = beta m + (1 - beta) g`` (Nesterov: the update ``g + beta (m - g)``), orthogonalized
by torch's Newton-Schulz iteration, applied with torch's shape-adjusted learning rate and
decoupled weight decay; every other value (embeddings, the head, 1-D parameters, the padding)
takes AdamW's step, as Muon is used in practice. The Newton-Schulz iteration and the
learning-rate adjustment are torch's own (``torch.optim._muon``, torch >= 2.9), not rewritten.

A matrix is stepped whole, so the sharded optimizer gives each owner whole matrices
(acco_loco/matrix_layout.py). Under model_sharding='node' a shard holds rows of matrices (MatrixRows):
the momentum and the step stay on the rows, and only Newton-Schulz runs on the whole matrix, on
one rank of the node (engine/parallel/node_matrices.py). The state is the shard's: ``exp_avg`` holds Muon's momentum buffer
at a matrix's values and AdamW's first moment elsewhere; ``exp_avg_sq`` AdamW's second moment
(unused, and left at 0, at a matrix's values)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import adamw
from .shard_state import ShardState

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults
NS_EPS = 1e-7
# torch's Newton-Schulz casts its input to this first (tests/engine/test_muon_node_sharded.py checks it)
NS_INPUT_DTYPE = torch.bfloat16


def init_state(master: torch.Tensor, spec) -> ShardState:
    return adamw.init_state(master, spec)


class MatrixRows(NamedTuple):
    """Some rows of a hidden matrix in a shard when the matrix is spread over a node's ranks
    (model_sharding='node': FSDP2 cuts it by rows): ``rows`` x ``cols`` values at ``start``, of a
    ``whole_rows`` x ``cols`` matrix. ``source.orthogonal(start)`` gives this round's orthogonalized
    update of these rows, Newton-Schulz of the whole matrix on its owner
    (engine/parallel/node_matrices.py); the momentum and the step stay on the rows."""

    start: int
    rows: int
    cols: int
    whole_rows: int
    source: Any


def spans(matrices, a: int, b: int) -> list[tuple[int, int]]:
    """The AdamW spans of ``[a, b)``: what the matrices (``(start, rows, cols)`` or MatrixRows,
    sorted) leave."""
    out, at = [], a
    for m in matrices:
        start, end = m[0], m[0] + m[1] * m[2]
        if end <= at or start >= b:
            continue
        if start > at:
            out.append((at, start))
        at = max(at, end)
    if at < b:
        out.append((at, b))
    return out


def momentum_update(exp_avg: torch.Tensor, g: torch.Tensor, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(the new momentum buffer, the update Newton-Schulz orthogonalizes) of a matrix or of some
    of its rows: torch.optim.Muon's elementwise operations, so rows give the whole's bits."""
    buf = torch.lerp(exp_avg.view(g.shape), g, 1 - spec.muon_momentum)
    return buf, (g.lerp(buf, spec.muon_momentum) if spec.muon_nesterov else buf)


def orthogonalize(update: torch.Tensor, spec) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz iteration of a whole matrix (it works in bfloat16:
    NS_INPUT_DTYPE, so an update sent in bfloat16 gives the same bits)."""
    from torch.optim._muon import _zeropower_via_newtonschulz  # torch >= 2.9

    return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, spec.muon_ns_steps, NS_EPS)


def apply_update(state: ShardState, out: ShardState, sl: slice, buf: torch.Tensor, ortho: torch.Tensor,
                 lr: float, spec, shape: tuple[int, int]) -> None:
    """Values ``sl`` of the step into ``out``: the momentum ``buf``, the master decayed and moved
    by the orthogonalized ``ortho`` at the lr torch adjusts for the whole matrix's ``shape``."""
    from torch.optim._muon import _adjust_lr  # torch >= 2.9

    adjusted = _adjust_lr(lr, spec.muon_adjust_lr, torch.Size(shape))
    out.exp_avg[sl].copy_(buf.reshape(-1))
    if out.exp_avg_sq is not state.exp_avg_sq:
        out.exp_avg_sq[sl].copy_(state.exp_avg_sq[sl])
    torch.mul(state.master[sl], 1 - lr * spec.weight_decay, out=out.master[sl]).add_(ortho.reshape(-1), alpha=-adjusted)


def step_matrix(state: ShardState, g: torch.Tensor, lr: float, spec, out: ShardState, start: int, rows: int,
                cols: int) -> None:
    """Muon's step of the matrix at ``[start, start + rows * cols)`` of the shard, its gradient
    ``g`` ([rows, cols], fp32), from ``state`` into ``out`` (torch.optim.Muon's operations, in
    its order)."""
    sl = slice(start, start + rows * cols)
    buf, update = momentum_update(state.exp_avg[sl], g, spec)
    apply_update(state, out, sl, buf, orthogonalize(update, spec), lr, spec, (rows, cols))


def step_rows(state: ShardState, g: torch.Tensor, lr: float, spec, out: ShardState, m: MatrixRows) -> None:
    """Muon's step of rows ``m`` of a matrix spread over a node's ranks, with the update its
    owner orthogonalized from the whole matrix (``m.source``)."""
    sl = slice(m.start, m.start + m.rows * m.cols)
    buf, _ = momentum_update(state.exp_avg[sl], g, spec)
    apply_update(state, out, sl, buf, m.source.orthogonal(m.start), lr, spec, (m.whole_rows, m.cols))


def propose_range(state: ShardState, grad_of, lr: float, spec, out: ShardState, a: int, b: int,
                  matrices) -> None:
    """Values ``[a, b)`` of the step into ``out``: AdamW on the spans no matrix covers, and every
    matrix that starts in ``[a, b)`` whole (it may reach past ``b``: a later range leaves it), or
    its rows (MatrixRows) with the update its owner orthogonalized.
    ``grad_of(lo, hi)``: the fp32 gradient of values ``[lo, hi)``."""
    for lo, hi in spans(matrices, a, b):
        part = ShardState(state.master[lo:hi], state.exp_avg[lo:hi], state.exp_avg_sq[lo:hi], state.step)
        target = ShardState(out.master[lo:hi], out.exp_avg[lo:hi], out.exp_avg_sq[lo:hi])
        adamw.propose_into(part, grad_of(lo, hi), lr, spec, target)
    for m in matrices:
        start, rows, cols = m[0], m[1], m[2]
        if not a <= start < b or not rows:
            continue
        g = grad_of(start, start + rows * cols).view(rows, cols)
        if isinstance(m, MatrixRows):
            step_rows(state, g, lr, spec, out, m)
        else:
            step_matrix(state, g, lr, spec, out, start, rows, cols)


def propose(state: ShardState, grad: torch.Tensor, lr: float, spec) -> ShardState:
    out = ShardState(torch.empty_like(state.master), torch.empty_like(state.exp_avg),
                     torch.empty_like(state.exp_avg_sq), step=state.step + 1)
    propose_range(state, lambda lo, hi: grad[lo:hi], lr, spec, out, 0, state.master.numel(), state.matrices)
    return out
