"""What one round does on the communication side: reduce, step the owned shard, gather.

Runs on the comm thread (CPU) or the comm stream (CUDA). The math it calls lives in
``acco_loco``; this file only moves tensors between workers and keeps per-round bookkeeping.

Where the strategies still to come plug in (none of zero1/dpu/acco changes):
- 1-bit Adam: after its warmup a round sends the worker's compressed momentum instead of the
  gradient. That is a different "what to send" (before the reduce) and "how to apply" (frozen
  variance) around the same reduce -> step -> gather skeleton: a RoundPlan kind of its own and a
  branch at the two marked places below.
- SparseLoCo / DiLoCo: the compute side takes H local optimizer steps between rounds and a round
  carries the pseudo-gradient theta_sync - theta_local. The compute loop (engine.py) gets a
  local-step hook; the round reuses the compressed all_to_all with top-k payloads.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from acco_loco.acco import KeptHalf, RoundKind, step_gradient
from acco_loco.optim import clip_coefficient, optimizer_step
from acco_loco.schedule import lr_at


class NonFiniteGradientError(FloatingPointError):
    """A NaN/Inf gradient reached a round and nan_policy is "stop"."""


@dataclass
class RoundRequest:
    index: int
    kind: RoundKind
    step_index: int  # 0-based committed step this round belongs to (drives the lr schedule)
    grad_index: int  # which flat gradient buffer holds this round's sum
    count: int  # this worker's micro-batches
    samples: int  # this worker's samples
    loss_sum: torch.Tensor  # sum of this worker's micro-batch losses (a 0-d tensor)
    exhausted: bool  # this worker's data ran out: everyone stops after this round


@dataclass
class RoundResult:
    index: int
    kind: RoundKind
    step_index: int
    local_count: int
    count: int  # global micro-batches behind the applied gradient (kept half included)
    samples: int
    loss: float  # mean micro-batch loss over that gradient
    lr: float
    grad_norm: float
    skipped: bool  # non-finite gradient: the shard was left unchanged
    empty: bool  # no micro-batch anywhere: nothing applied
    bad_ranks: list[int]
    exhausted_ranks: list[int]
    bytes_sent: int
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)


def squared_norm(x: torch.Tensor) -> torch.Tensor:
    """sum(x**2): an fp32 dot (one pass, no temporary), redone in float64 if it overflowed."""
    sq = torch.dot(x, x) if x.dtype == torch.float32 else x.to(torch.float32).square().sum()
    if not math.isfinite(float(sq)):
        sq = torch.linalg.vector_norm(x, dtype=torch.float64).square()
    return sq


def run_round(engine, req: RoundRequest) -> RoundResult:
    """One round for ``engine`` (an Engine); touches only comm-side state."""
    cfg, comm, flat = engine.cfg, engine.comm, engine.flat
    n, rank = comm.world_size, comm.rank
    bytes_before = comm.bytes_sent
    phases: dict[str, tuple[float, float]] = {}
    full = flat.grads[req.grad_index]

    t = time.perf_counter()
    # [what to send] gradient sum of this worker's micro-batches
    local_bad = not all(math.isfinite(float(v)) for v in torch.aminmax(full))  # NaN propagates
    if engine.grad_codec is not None:
        grad_sum = engine.grad_codec.reduce_scatter(comm, full, req.count, finite=not local_bad)
    else:
        grad_sum = comm.reduce_scatter_sum(full)
    phases["reduce_scatter"] = (t, time.perf_counter())

    t = time.perf_counter()
    kept = engine._kept if req.kind is RoundKind.COMMIT else None
    step_sum = step_gradient(req.kind, grad_sum, kept)
    # one small all-reduce carries counts, loss, the squared norm and every rank's flags
    small = torch.zeros(4 + 2 * n, dtype=torch.float64, device=full.device)
    small[0] = req.count
    small[1] = req.samples
    small[2] = req.loss_sum.to(torch.float64)
    small[3] = squared_norm(step_sum)
    small[4 + rank] = float(req.exhausted)
    small[4 + n + rank] = float(local_bad)
    small = comm.all_reduce_sum(small).cpu()
    round_count, round_samples, round_loss = int(small[0]), int(small[1]), float(small[2])
    sq_norm = float(small[3])
    exhausted_ranks = [i for i in range(n) if small[4 + i] > 0]
    bad_ranks = [i for i in range(n) if small[4 + n + i] > 0]

    count, samples, loss_sum = round_count, round_samples, round_loss
    if kept is not None:
        count, samples, loss_sum = count + kept.count, samples + kept.samples, loss_sum + kept.loss_sum
    nonfinite = bool(bad_ranks) or not math.isfinite(sq_norm)
    if nonfinite and cfg.nan_policy == "stop":
        raise NonFiniteGradientError(
            f"non-finite gradient in round {req.index} (step {req.step_index + 1}) from rank(s) "
            f"{bad_ranks or 'unknown (the reduced sum overflowed)'}: lower the learning rate, clip "
            "gradients (max_grad_norm), check the data, or set nan_policy='skip'")
    empty = count == 0
    lr = lr_at(req.step_index, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    grad_norm = math.sqrt(sq_norm) / count if count and not nonfinite else float("nan")
    state = engine.shard_state
    # [how to apply] the shard optimizer; commit writes state, estimate does not
    if nonfinite or empty:
        new_shard = state.master
    else:
        grad = step_sum / count
        coef = clip_coefficient(grad_norm, cfg.max_grad_norm)
        if coef < 1.0:
            grad.mul_(coef)
        new_shard = optimizer_step(state, grad, lr, engine.spec, commit=req.kind is RoundKind.COMMIT)
    if req.kind is RoundKind.COMMIT and engine.grad_codec is not None:
        engine.grad_codec.feedback.on_committed_step(req.step_index + 1)
    if req.kind is RoundKind.ESTIMATE:
        engine._kept = KeptHalf(grad_sum, round_count, round_loss, round_samples)
    else:
        engine._kept = None
    phases["optimizer"] = (t, time.perf_counter())

    t = time.perf_counter()
    if engine.param_codec is not None:
        engine.param_codec.all_gather(comm, new_shard, engine.gather_buf, rank)
    elif cfg.param_codec in ("float32", "bfloat16") and getattr(torch, cfg.param_codec) != flat.dtype:
        wire = torch.empty(flat.padded, dtype=getattr(torch, cfg.param_codec), device=full.device)
        engine.gather_buf.copy_(comm.all_gather(new_shard.to(wire.dtype), wire))
    else:
        comm.all_gather(new_shard.to(flat.dtype), engine.gather_buf)
    phases["all_gather"] = (t, time.perf_counter())
    if cfg.poison_freed_buffers:
        full.fill_(float("nan"))  # any read of a released buffer now shows up as NaN
    return RoundResult(
        index=req.index, kind=req.kind, step_index=req.step_index, local_count=req.count,
        count=count, samples=samples, loss=loss_sum / count if count else float("nan"), lr=lr,
        grad_norm=grad_norm, skipped=nonfinite, empty=empty, bad_ranks=bad_ranks,
        exhausted_ranks=exhausted_ranks, bytes_sent=comm.bytes_sent - bytes_before, phases=phases)
