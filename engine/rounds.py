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
from acco_loco.optim import clip_coefficient, propose_step
from acco_loco.schedule import lr_at

from .flat import nonfinite_rows


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
    first_of_step: bool = True  # the first round of an optimizer step (error state is marked)


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
    skip_reason: str = ""  # why a skipped step was skipped, for the warning


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
    feedback = engine.grad_codec.feedback if engine.grad_codec is not None else None
    if feedback is not None and req.first_of_step:
        feedback.mark()  # a skipped step goes back here: it must leave no error behind

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
    # an estimate half that was bad spoils the whole step, even if this half is clean
    bad_ranks = sorted({i for i in range(n) if small[4 + n + i] > 0} | set(kept.bad_ranks if kept else ()))

    count, samples, loss_sum = round_count, round_samples, round_loss
    if kept is not None:
        count, samples, loss_sum = count + kept.count, samples + kept.samples, loss_sum + kept.loss_sum
    nonfinite = bool(bad_ranks) or not math.isfinite(sq_norm) or (kept is not None and kept.skipped)
    if nonfinite and cfg.nan_policy == "stop":
        raise NonFiniteGradientError(
            f"non-finite gradient in round {req.index} (step {req.step_index + 1}) from rank(s) "
            f"{bad_ranks or 'unknown (the reduced sum overflowed)'}: lower the learning rate, clip "
            "gradients (max_grad_norm), check the data, or set nan_policy='skip'")
    empty = count == 0
    lr = lr_at(req.step_index, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    grad_norm = math.sqrt(sq_norm) / count if count and not nonfinite else float("nan")
    state = engine.shard_state
    # [how to apply] the shard optimizer proposes; the proposal is installed (commit rounds)
    # only once the gather showed every rank's new parameters finite
    proposal = None
    reason = ""
    if nonfinite:
        own_bad = any(small[4 + n + i] > 0 for i in range(n))
        reason = "non-finite gradient from" if own_bad or kept is None or not kept.bad_ranks \
            else "non-finite estimate half (gradient or update) from"
    if not (nonfinite or empty):
        grad = step_sum / count
        coef = clip_coefficient(grad_norm, cfg.max_grad_norm)
        if coef < 1.0:
            grad.mul_(coef)
        proposal = propose_step(state, grad, lr, engine.spec)
    phases["optimizer"] = (t, time.perf_counter())

    t = time.perf_counter()
    overflowed = gather_params(engine, proposal.master if proposal is not None else state.master)
    if overflowed:
        # every replica sees the same gathered values, so every rank takes this branch
        if cfg.nan_policy == "stop":
            raise NonFiniteGradientError(
                f"non-finite parameters after the update of round {req.index} (step "
                f"{req.step_index + 1}) on the shard(s) of rank(s) {overflowed}: nothing was installed; "
                "lower the learning rate or clip gradients (max_grad_norm), or set nan_policy='skip'")
        gather_params(engine, state.master)  # what a skipped step gathers: the unchanged master
        nonfinite, grad_norm = True, float("nan")
        bad_ranks = sorted(set(bad_ranks) | set(overflowed))
        reason = "non-finite parameters after the update on the shard(s) of"
    elif proposal is not None and req.kind is RoundKind.COMMIT:
        state.install(proposal)
    phases["all_gather"] = (t, time.perf_counter())

    if req.kind is RoundKind.ESTIMATE:
        engine._kept = KeptHalf(grad_sum, round_count, round_loss, round_samples,
                                skipped=nonfinite, bad_ranks=tuple(bad_ranks))
    else:
        engine._kept = None
        if feedback is not None:
            if nonfinite:
                feedback.rollback()
            feedback.on_committed_step(req.step_index + 1)
    if cfg.poison_freed_buffers:
        full.fill_(float("nan"))  # any read of a released buffer now shows up as NaN
    return RoundResult(
        index=req.index, kind=req.kind, step_index=req.step_index, local_count=req.count,
        count=count, samples=samples, loss=loss_sum / count if count else float("nan"), lr=lr,
        grad_norm=grad_norm, skipped=nonfinite, empty=empty, bad_ranks=bad_ranks,
        exhausted_ranks=exhausted_ranks, bytes_sent=comm.bytes_sent - bytes_before, phases=phases,
        skip_reason=reason)


def gather_params(engine, new_shard: torch.Tensor) -> list[int]:
    """All-gather every rank's new shard into ``engine.gather_buf``; returns the ranks whose
    gathered values are not finite (then gather_buf is left as it was or must be re-gathered)."""
    cfg, comm, flat = engine.cfg, engine.comm, engine.flat
    if engine.param_codec is not None:
        return engine.param_codec.all_gather(comm, new_shard, engine.gather_buf, comm.rank)
    wire_dtype = getattr(torch, cfg.param_codec) if cfg.param_codec in ("float32", "bfloat16") else flat.dtype
    if wire_dtype != flat.dtype:
        wire = torch.empty(flat.padded, dtype=wire_dtype, device=new_shard.device)
        comm.all_gather(new_shard.to(wire_dtype), wire)
    else:
        wire = comm.all_gather(new_shard.to(flat.dtype), engine.gather_buf)
    bad = nonfinite_rows(wire.view(comm.world_size, -1))
    if wire is not engine.gather_buf and not bad:
        engine.gather_buf.copy_(wire)
    return bad

