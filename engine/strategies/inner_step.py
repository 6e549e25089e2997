"""The inner optimizer step of a local-step strategy: written over its state in pieces
(engine/strategies/local_steps.py; docs/local_steps.md, "Checkpoints and non-finite values"): no
second copy of the full-size inner state, one piece-sized scratch kept between steps; and the
step on an accelerator with one host read."""

from __future__ import annotations

import math

import torch

from acco_loco.optim import propose_slice, propose_step
from acco_loco.shard_state import ShardState

from ..core.rounds import squared_norm_f64
from ..runtime.host import to_host
from ..runtime.offload import HostOptimizer
from .local_totals import InnerStep

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
        still copying to the host: engine/runtime/offload.py); where it returns a tensor, that is
        piece k's fp32 values (a host slot), and ``grad_sum`` is only where they came from."""
        n = state.master.numel()  # the step runs where the state is (with offload, on the host)
        if self.scratch is None or self.scratch.device != state.master.device:
            self.scratch = torch.empty(min(n, PIECE), dtype=torch.float32, device=state.master.device)
        for k, a in enumerate(range(0, n, PIECE)):
            b = min(n, a + PIECE)
            piece = ready(k) if ready is not None else None
            if piece is None and (fused or grad_sum.dtype == torch.float32):
                propose_slice(state, grad_sum, count, coef, lr, spec, state, a, b, self.scratch, fused)
                continue
            # a piece of its own (a host slot), or a low-precision gradient (a sharded bf16 model's):
            # each piece in fp32 before it is divided; AdamW is elementwise, so the same bits
            view = ShardState(*(t[a:b] if t is not None and t.numel() == n else t
                                for t in (state.master, state.exp_avg, state.exp_avg_sq)), state.step)
            if piece is None:
                piece, fused_piece = grad_sum[a:b].to(torch.float32), False
            else:
                fused_piece = fused
            propose_slice(view, piece, count, coef, lr, spec, view, 0, b - a, self.scratch, fused_piece)
        state.step += 1
        return math.isfinite(float(torch.dot(state.master, state.master))) or bool(torch.isfinite(state.master).all())


def offloaded(state: ShardState, device: torch.device, step: PieceStep, whole_gradient: bool = True) -> HostOptimizer:
    """optimizer_offload='cpu' (engine/runtime/offload.py): ``state`` rebound to host memory, and
    ``step`` given a piece-sized host scratch. ``whole_gradient`` False: the gradient comes to the
    host in piece slots only (``HostOptimizer.gradient_pieces``; the norm is taken elsewhere)."""
    offload = HostOptimizer(state, device, whole_gradient)
    step.scratch = offload.host_piece_scratch(min(state.master.numel(), PIECE))
    return offload


def inner_step_on_device(strategy, ctx, grad_sum: torch.Tensor, count: int, loss_sum: float | torch.Tensor,
                         step_index: int, lr: float) -> InnerStep:
    """A local-step strategy's inner step on an accelerator (``LocalStepStrategy.inner_step``): the
    same decisions and values as the CPU path, with one host read instead of three (the CPU path
    reads the loss, the norm and the new parameters' finiteness one at a time; each is a sync on a
    GPU). The norm, the clipping
    coefficient and the proposal are computed on the device first; then the loss, the norm
    and whether the proposal is finite come to the host together, and decide."""
    cfg, state = ctx.cfg, ctx.shard_state
    g = grad_sum.to(torch.float32)
    sq = torch.dot(g, g)
    # the fp32 squares may overflow for finite values (rare): then the float64 sum, as on CPU
    sq = torch.where(torch.isfinite(sq), sq.to(torch.float64), squared_norm_f64(g))
    norm = sq.sqrt() / count
    grad = g / count
    if cfg.max_grad_norm is not None and cfg.max_grad_norm > 0:  # clip_coefficient, on the device
        coef = torch.clamp(cfg.max_grad_norm / (norm + 1e-6), max=1.0)
        grad.mul_(torch.where(coef < 1.0, coef, 1.0).to(torch.float32))
    proposal = propose_step(state, grad, lr, ctx.spec)
    if not torch.is_tensor(loss_sum):
        loss_sum = torch.tensor(float(loss_sum), dtype=torch.float64)  # a caller's number: no device copy
    read = to_host(torch.stack([loss_sum.to(norm.device, torch.float64), norm,
                                torch.isfinite(proposal.master).all().to(torch.float64)]))
    loss_sum, norm_h, finite = float(read[0]), float(read[1]), bool(read[2])
    strategy.period.loss_sum += loss_sum
    if not math.isfinite(norm_h):
        return strategy._skip_inner(ctx, step_index, lr, loss_sum / count, "non-finite gradient")
    if not finite:
        return strategy._skip_inner(ctx, step_index, lr, loss_sum / count, "non-finite parameters after the update")
    state.install(proposal)
    strategy.install(ctx, state.master)
    return InnerStep(lr, norm_h, loss_sum / count, False)
