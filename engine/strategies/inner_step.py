"""The inner optimizer step of a local-step strategy written over its state in pieces
(engine/strategies/local_steps.py; docs/local_steps.md, "Checkpoints and non-finite values"): no
second copy of the full-size inner state, one piece-sized scratch kept between steps."""

from __future__ import annotations

import math

import torch

from acco_loco.optim import propose_slice
from acco_loco.shard_state import ShardState

from ..runtime.offload import HostOptimizer, pieces_of  # noqa: F401 (pieces_of: local_steps.py's)

PIECE = 1 << 20  # values per piece


class PieceStep:
    """Steps ``state`` in place, a piece at a time, sharing one scratch (the fused kernel's
    square roots)."""

    def __init__(self) -> None:
        self.scratch: torch.Tensor | None = None  # optimizer_offload='cpu': the offload's host scratch

    def __call__(self, state: ShardState, grad_sum: torch.Tensor, count: int, coef: float, lr: float, spec,
                 fused: bool = True, ready=None) -> bool:
        """The step of ``grad_sum / count`` (scaled by ``coef`` below 1) written over ``state``.
        Skipping without a trace needs no copy either: a gradient whose fp32 squares are finite
        gives finite moments and a bounded AdamW update (|m_hat| / sqrt(v_hat) stays below a small
        constant), so the parameters stay finite unless they were already near the fp32 limit:
        returns False then (the caller refuses it). ``fused``: acco_loco.optim.can_fuse's verdict.
        ``ready(k)``: waits until piece k of ``grad_sum`` is there (an offloaded step's gradient,
        still copying to the host: engine/runtime/offload.py)."""
        n = grad_sum.numel()
        if self.scratch is None or self.scratch.device != grad_sum.device:
            self.scratch = torch.empty(min(n, PIECE), dtype=torch.float32, device=grad_sum.device)
        for k, a in enumerate(range(0, n, PIECE)):
            b = min(n, a + PIECE)
            if ready is not None:
                ready(k)
            if fused or grad_sum.dtype == torch.float32:
                propose_slice(state, grad_sum, count, coef, lr, spec, state, a, b, self.scratch, fused)
                continue
            # a low-precision gradient (a sharded bf16 model's): each piece in fp32 before it is divided
            view = ShardState(*(t[a:b] if t is not None and t.numel() == n else t
                                for t in (state.master, state.exp_avg, state.exp_avg_sq)), state.step)
            propose_slice(view, grad_sum[a:b].to(torch.float32), count, coef, lr, spec, view, 0, b - a,
                          self.scratch, False)
        state.step += 1
        return math.isfinite(float(torch.dot(state.master, state.master))) or bool(torch.isfinite(state.master).all())


def offloaded(state: ShardState, device: torch.device, step: PieceStep) -> HostOptimizer:
    """optimizer_offload='cpu' (engine/runtime/offload.py): ``state`` rebound to host memory, and
    ``step`` given a piece-sized host scratch."""
    offload = HostOptimizer(state, device)
    step.scratch = offload.host_piece_scratch(min(state.master.numel(), PIECE))
    return offload
