"""The ZeRO-1 round every sharded strategy shares, top to bottom:

    reduce-scatter this worker's gradient sum -> the fp32 sum of the owned shard
    one small all-reduce: counts, loss, squared norm, every rank's flags and speed
    the shard optimizer proposes a step (nothing written yet)
    all-gather the new shards; a commit installs the proposal once all of them are finite

A strategy changes what a round carries in (``carried``: ACCO's kept estimate half) and what it
keeps for later (``keep``); the rest is here. Skips and stops follow docs/design/rounds.md, "Non-finite gradients and updates".

Pipelining (``comm_chunks`` pieces of the shard, engine/parallel/collectives.py): inside the
reduce-scatter, piece k+1 is encoded while piece k is on the wire and piece k-1 is decoded as it
arrives; after the small all-reduce, the optimizer steps piece k and puts it on the all-gather
at once, so piece k is on the wire while piece k+1 is being stepped and the pieces already
received are copied into place. What does not overlap, and why: the all-gather cannot start
while the reduce-scatter is still running. The optimizer needs, before it may step any piece,
(1) the clipping coefficient, from the global norm of the whole reduced gradient, (2) the global
micro-batch count it divides by, and (3) the skip decision (a non-finite gradient on any rank,
or a reduced sum that overflowed, seen in that norm); all three come from the small all-reduce,
which needs every piece reduced. Without clipping, (2) and the rank flags could be agreed before
the reduce-scatter and an overflow caught by the gather's finiteness check instead, but the
step's reported gradient norm and the reason of a skip would then change: not done. On a link
that is the bottleneck the two collectives share it anyway; what the pipeline hides is the CPU
work (encode, decode, optimizer, copies) behind the wire time. The gathered parameters are
installed only after every piece arrived and all are finite (a replica must never hold half a
step), so the delta gather's decode into the held parameters runs at the end.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from acco_loco.acco import KeptHalf, RoundKind, step_gradient
from acco_loco.optim import ShardState, can_fuse, clip_coefficient, propose_slice
from acco_loco.schedule import lr_at

from ..core.rounds import NonFiniteGradientError, RoundContext, RoundRequest, RoundResult, squared_norm_f64
from ..parallel.gatherers import DeltaParams
from ..runtime.host import nonfinite_flag, small_vector, to_host
from ..runtime.offload import HostOptimizer
from .base import Strategy
from .spec import MemorySpec, StrategySpec, resolve_step_copy, sharded_round_parts, sharded_work


@dataclass
class RoundTotals:
    """What the small all-reduce tells every rank about a round (the carried half included)."""

    round_count: int
    round_samples: int
    round_loss: float
    count: int
    samples: int
    loss_sum: float
    sq_norm: float
    exhausted_ranks: list[int]
    bad_ranks: list[int]
    nonfinite: bool
    reason: str  # why the step is skipped, for the warning
    micro_batch_s: list[float]  # every rank's seconds per micro-batch in this round

    @property
    def grad_norm(self) -> float:
        """The norm of the round's global mean gradient (NaN when the step is skipped or empty)."""
        return math.sqrt(self.sq_norm) / self.count if self.count and not self.nonfinite else float("nan")


class ShardedStrategy(Strategy):
    two_level = True  # its reducer and gatherer take the node's level first (engine/parallel/two_level.py)
    node_sharding_refused = None  # its round runs on a rail's local-shard buffer as on a flat one
    whole_matrices_refused = None  # an owner steps its whole shard (Muon: whole matrices, acco_loco/matrix_layout.py)
    offload_refused = None  # its state is the shard optimizer's: it may live in host memory (optimizer_offload)
    kept_shards = 0  # fp32 shard-sized buffers it keeps between a step's rounds (the planner's memory)
    gathers_into_gradients = True  # a round gathers into the gradient buffer it has reduced (RoundContext.gather_target)
    stale_update = False  # StrategySpec.stale_update

    @classmethod
    def spec(cls) -> StrategySpec:
        return StrategySpec(rounds=len(cls.plan.kinds), overlap=cls.plan.overlap,
                            installs=cls.plan.kinds.count(RoundKind.COMMIT),
                            memory=MemorySpec("sharded", cls.kept_shards), round_parts=sharded_round_parts,
                            work=sharded_work, adamw_class=True, codec_variants=True,
                            stale_update=cls.stale_update)

    offload: HostOptimizer | None = None  # optimizer_offload='cpu': the shard state in host memory

    def setup(self, ctx: RoundContext) -> None:
        """With optimizer_offload='cpu', move the shard state to host memory (a subclass that
        allocates device buffers shaped like the master makes them before calling this)."""
        if ctx.cfg.optimizer_offload == "cpu":
            self.offload = HostOptimizer(ctx.shard_state, ctx.dims.device)

    def carried(self, req: RoundRequest) -> KeptHalf | None:
        """A reduced half from an earlier round that this round's step adds (none here)."""
        return None

    def keep(self, req: RoundRequest, grad_sum: torch.Tensor, totals: RoundTotals) -> None:
        """Remember what a later round needs (nothing here)."""

    def step_sum(self, req: RoundRequest, grad_sum: torch.Tensor, kept: KeptHalf | None) -> torch.Tensor:
        """The gradient sum this round's step uses (acco_loco/acco.py ``step_gradient``)."""
        return step_gradient(req.kind, grad_sum, kept)

    def correct(self, ctx: RoundContext, req: RoundRequest, step_sum: torch.Tensor, totals: RoundTotals) -> None:
        """Change a round's gradient sum in place before its step, once the round is known to step
        (ACCO's delay compensation; nothing here)."""

    def clip_norm(self, req: RoundRequest, grad_norm: float) -> float:
        """The norm that sets this round's clipping coefficient (its own gradient's here; ACCO's
        ``estimate_clip='step'`` gives the estimate round the last commit's)."""
        return grad_norm

    def after_piece(self, ctx: RoundContext, req: RoundRequest):
        """None, or ``f(proposal, a, b)`` called once values [a, b) are proposed and before they
        go on the wire (ACCO's weight prediction replaces an estimate's; nothing here); read them
        as ``proposal.part(a, b)``: the proposal is the whole spare or a piece-sized scratch
        (step_copy), whose tensors start at the piece."""
        return None

    def reduce_into(self, req: RoundRequest) -> torch.Tensor | None:
        """A buffer of the strategy's own for this round's reduced sum, when it keeps the sum past
        the next round (ACCO's estimate half); None: the reducer's buffer, reused next round."""
        return None

    def run_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        comm, full = ctx.comm, ctx.flat.grads[req.grad_index]
        held = ctx.gather_target(req.grad_index)  # ``full`` itself once reduced, or the context's own buffer
        bytes_before, phases = comm.bytes_sent, {}
        if req.first_of_step:
            ctx.grads.begin_step()

        t = time.perf_counter()
        # [what to send] gradient sum of this worker's micro-batches; whether it is finite (a
        # device flag: the small all-reduce carries it)
        grad_sum, local_bad = reduce_flagged(ctx.grads, comm, full, req.count, self.reduce_into(req))
        phases["reduce_scatter"] = (t, time.perf_counter())

        t = time.perf_counter()
        kept = self.carried(req)
        step_sum = self.step_sum(req, grad_sum, kept)
        totals = agree(ctx, req, step_sum, local_bad, kept)
        if not totals.nonfinite and totals.count:
            self.correct(ctx, req, step_sum, totals)
        lr = lr_at(req.step_index, ctx.cfg.lr, ctx.cfg.lr_schedule, ctx.cfg.warmup_steps, ctx.cfg.max_steps,
                   ctx.cfg.min_lr_ratio)
        grad_norm = totals.grad_norm
        # [how to apply] the shard optimizer proposes piece by piece, each piece on the wire as
        # soon as it is done; nothing is written before the whole gather is in and finite
        stepping = not totals.nonfinite and totals.count > 0
        proposal, started, proposed = step_and_gather(ctx, step_sum, totals.count, self.clip_norm(req, grad_norm), lr,
                                                      stepping, self.after_piece(ctx, req), self.offload, held)
        phases["optimizer"] = (t, proposed)

        overflowed = finish_and_install(ctx, req, proposal, self.offload, held)
        if overflowed:
            totals.nonfinite, grad_norm = True, float("nan")
            totals.bad_ranks = sorted(set(totals.bad_ranks) | set(overflowed))
            totals.reason = "non-finite parameters after the update on the shard(s) of"
        phases["all_gather"] = (started, time.perf_counter())

        self.keep(req, grad_sum, totals)
        if req.kind is RoundKind.COMMIT:
            ctx.grads.end_step(req.step_index + 1, skipped=totals.nonfinite)
        if ctx.cfg.poison_freed_buffers and full.data_ptr() != held.data_ptr():
            full.fill_(float("nan"))  # any read of a released buffer now shows up as NaN
        # (a buffer that holds the gathered parameters is poisoned by the loop once it has installed them)
        return RoundResult(
            index=req.index, kind=req.kind, step_index=req.step_index, local_count=req.count,
            count=totals.count, samples=totals.samples,
            loss=totals.loss_sum / totals.count if totals.count else float("nan"), lr=lr, grad_norm=grad_norm,
            skipped=totals.nonfinite, empty=totals.count == 0, bad_ranks=totals.bad_ranks,
            exhausted_ranks=totals.exhausted_ranks, bytes_sent=comm.bytes_sent - bytes_before,
            phases=phases, skip_reason=totals.reason, micro_batch_s=totals.micro_batch_s, gathered=held)


def agree(ctx: RoundContext, req: RoundRequest, step_sum: torch.Tensor, local_bad: torch.Tensor,
          kept: KeptHalf | None) -> RoundTotals:
    """One small all-reduce carries counts, loss, the squared norm, every rank's flags and
    seconds per micro-batch; it is the round's one host read (engine/runtime/host.py)."""
    n, rank = ctx.comm.world_size, ctx.comm.rank
    values: list = [req.count, req.samples, req.loss_sum, torch.dot(step_sum, step_sum)] + [0.0] * (3 * n)
    values[4 + rank] = float(req.exhausted)  # (the dot in fp32: one pass, no temporary)
    values[4 + n + rank] = local_bad
    values[4 + 2 * n + rank] = req.micro_batch_s  # one writer per slot: the sum is exact on every rank
    small = to_host(ctx.comm.all_reduce_sum(small_vector(values, step_sum.device)))
    round_count, round_samples, round_loss = int(small[0]), int(small[1]), float(small[2])
    own_bad = {i for i in range(n) if small[4 + n + i] > 0}
    if not own_bad and not math.isfinite(float(small[3])):
        # finite gradients whose fp32 sum of squares overflowed: redo it in float64 (rare)
        small[3] = float(to_host(ctx.comm.all_reduce_sum(squared_norm_f64(step_sum).reshape(1)))[0])
    # an estimate half that was bad spoils the whole step, even if this half is clean
    bad_ranks = sorted(own_bad | set(kept.bad_ranks if kept else ()))
    count, samples, loss_sum = round_count, round_samples, round_loss
    if kept is not None:
        count, samples, loss_sum = count + kept.count, samples + kept.samples, loss_sum + kept.loss_sum
    sq_norm = float(small[3])
    nonfinite = bool(bad_ranks) or not math.isfinite(sq_norm) or (kept is not None and kept.skipped)
    reason = ""
    if nonfinite:
        reason = "non-finite gradient from" if own_bad or kept is None or not kept.bad_ranks \
            else "non-finite estimate half (gradient or update) from"
        if ctx.cfg.nan_policy == "stop":
            raise NonFiniteGradientError(
                f"non-finite gradient in round {req.index} (step {req.step_index + 1}) from rank(s) "
                f"{bad_ranks or 'unknown (the reduced sum overflowed)'}: lower the learning rate, clip "
                "gradients (max_grad_norm), check the data, or set nan_policy='skip'")
    return RoundTotals(round_count, round_samples, round_loss, count, samples, loss_sum, sq_norm,
                       [i for i in range(n) if small[4 + i] > 0], bad_ranks, nonfinite, reason,
                       [float(t) for t in small[4 + 2 * n:]])


def reduce_flagged(grads, comm, full: torch.Tensor, count: int,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the reduced shard, whether ``full`` held a NaN/Inf as a 0-d device flag): the reducer's
    own flag when it looked on its way through the gradient, else a check here."""
    reduced = grads.reduce(comm, full, count, out)
    bad = reduced.input_nonfinite
    return reduced.sum, nonfinite_flag(full) if bad is None else bad


@dataclass
class Proposal:
    """A round's optimizer step while its gather is in flight: what it was stepped from (the
    reduced sum, the global count, the clipping coefficient, the lr, the pieces), and where it
    went. With the whole spare (step_copy 'whole') a commit installs ``spare`` as it is; with
    piece-sized scratch ('piece') only the pieces' new masters went out, and a commit steps the
    state again in place from the same inputs, piece by piece (:meth:`restep`: the same bits)."""

    grad_sum: torch.Tensor
    count: int
    coef: float
    lr: float
    pieces: list[tuple[int, int]]
    spare: ShardState | None  # None: proposed into piece-sized scratch
    scratch: torch.Tensor | None = None  # the fused kernel's square roots
    fused: bool = False

    def restep(self, ctx: RoundContext) -> None:
        """Install by recomputing: each piece stepped in place into the shard state, reading
        ``step + 1`` as the proposal did; the count goes up once, after the last piece."""
        state = ctx.shard_state
        for a, b in self.pieces:
            propose_slice(state, self.grad_sum, self.count, self.coef, self.lr, ctx.spec, state, a, b,
                          self.scratch, self.fused)
        state.step += 1


def step_copy(ctx: RoundContext) -> str:
    """'whole' or 'piece': the run's step_copy for where its shard state lives."""
    return resolve_step_copy(ctx.cfg.step_copy, ctx.shard_state.master.device.type == "cuda", ctx.spec.name)


def step_and_gather(ctx: RoundContext, step_sum: torch.Tensor, count: int, grad_norm: float, lr: float,
                    stepping: bool, after_piece=None, offload: HostOptimizer | None = None,
                    held: torch.Tensor | None = None) -> tuple[Proposal | None, float, float]:
    """Step each piece of the shard (the mean gradient, clipped to max_grad_norm: propose_step's
    bits, piece by piece) into the whole spare or into piece-sized scratch (``step_copy``) and
    start its all-gather at once; when not ``stepping`` (a skipped or empty step) the unchanged
    master goes out. Returns the proposal (None when not stepping), when the first gather started
    and when the last piece was stepped. ``offload``: the state is in host memory
    (engine/runtime/offload.py): each piece's gradient is stepped from its host copy and its new
    master reaches the gatherer through a device staging slot. ``held``: where the new parameters
    are gathered (``RoundContext.gather_target``; None: ctx.gather_buf); a gradient buffer the
    round has reduced first receives the parameters every replica holds where the gatherer adds
    deltas onto them (``refresh_held``)."""
    state, comm = ctx.shard_state, ctx.comm
    held = ctx.gather_buf if held is None else held
    refresh_held(ctx, held)
    pieces = ctx.params.begin(comm, held, restorable=held is not ctx.gather_buf)
    proposal, width = None, max(b - a for a, b in pieces)
    if stepping:
        grad = step_sum if offload is None else offload.fetch_gradient(step_sum, pieces)
        spare = state.spare() if step_copy(ctx) == "whole" else None
        first = spare if spare is not None else state.scratch(0, *pieces[0], width)
        fused = can_fuse(ctx.spec, grad, state, first)
        scratch = None
        if fused:
            scratch = offload.host_kernel_scratch() if offload is not None else comm.buffer(
                ("optimizer.scratch",), (step_sum.numel(),), torch.float32, step_sum.device)
        proposal = Proposal(grad, count, clip_coefficient(grad_norm, ctx.cfg.max_grad_norm), lr, pieces, spare,
                            scratch, fused)
        if ctx.node_matrices is not None:  # Muon, node-sharded: matrices orthogonalized whole in the node first
            ctx.node_matrices.orthogonalize(state, grad, count, proposal.coef, ctx.spec)
    started = None
    for k, (a, b) in enumerate(pieces):
        new = state
        if proposal is not None:
            if offload is not None:
                offload.wait(k)  # this piece's gradient is on the host
                if proposal.spare is None:
                    offload.before_writing(k)  # the scratch slot's last copy to the device is done
            new = proposal.spare if proposal.spare is not None else state.scratch(k, a, b, width)
            propose_slice(state, proposal.grad_sum, count, proposal.coef, lr, ctx.spec, new, a, b, proposal.scratch,
                          proposal.fused)
            if after_piece is not None:
                after_piece(new, a, b)
        if started is None:
            started = time.perf_counter()
        if offload is None:
            ctx.params.push(comm, k, new.master, new.start)
        else:
            sent = new.master[a - new.start:b - new.start]
            ctx.params.push(comm, k, offload.staged(k, sent, width), a)
    return proposal, started, time.perf_counter()


def finish_and_install(ctx: RoundContext, req: RoundRequest, proposal: Proposal | None,
                       offload: HostOptimizer | None = None, held: torch.Tensor | None = None) -> list[int]:
    """Finish the gather into ``held`` (None: ctx.gather_buf); a commit installs its proposal when
    all the new shards are finite (the spare as it is, or the step recomputed in place). Returns
    the ranks whose new parameters were not (then nothing is installed and the unchanged master is
    gathered again, as a skipped step does)."""
    state = ctx.shard_state
    held = ctx.gather_buf if held is None else held
    overflowed = ctx.params.finish(ctx.comm, held)
    if overflowed:
        # every replica sees the same gathered values, so every rank takes this branch
        if ctx.cfg.nan_policy == "stop":
            raise NonFiniteGradientError(
                f"non-finite parameters after the update of round {req.index} (step "
                f"{req.step_index + 1}) on the shard(s) of rank(s) {overflowed}: nothing was installed; "
                "lower the learning rate or clip gradients (max_grad_norm), or set nan_policy='skip'")
        master = state.master if offload is None else offload.device_master()
        refresh_held(ctx, held)  # a delta gather that added pieces as they came left it part-updated
        ctx.params.gather(ctx.comm, master, held, restorable=held is not ctx.gather_buf)
    elif proposal is not None and req.kind is RoundKind.COMMIT:
        if proposal.spare is not None:
            state.install(proposal.spare, recycle=True)
        else:
            proposal.restep(ctx)
    return overflowed


def refresh_held(ctx: RoundContext, held: torch.Tensor) -> None:
    """Fill ``held``, a gradient buffer the round has just reduced (``RoundContext.gather_target``),
    with the parameters every replica holds (the compute side's, installed from the last round
    and read-only until the next install), when the gatherer adds decoded deltas onto ``held``
    (param_codec int8/int4); a cast gather overwrites all of it. Since the round fills it so
    before every gather, the gatherer may leave it part-updated (``restorable``): a delta
    gather then adds each piece as it arrives and keeps no piece's rows past the next. A node-sharded run without
    overlap has its gatherer do this (ShardParams' ``refresh``), and a buffer of the context's
    own keeps them between rounds."""
    if held is ctx.gather_buf or getattr(ctx.params, "refresh", None) is not None:
        return
    if isinstance(getattr(ctx.params, "inner", ctx.params), DeltaParams):
        with torch.no_grad():
            ctx.flat.read_into(held)
