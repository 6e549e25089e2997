"""What diloco and sparseloco share (docs/local_steps.md): every worker takes inner optimizer
steps alone on its own full copy, and an outer round every H inner steps moves ``theta_sync`` (the
same on every replica) by the workers' pseudo-gradients ``Delta_w = theta_sync - theta_w``.

Compute side (the caller's thread; engine/loops/local_steps.py calls these in this order):
    inner_step     one optimizer step of this worker alone on the micro-batches it just ran
    round_due      whether the outer round starts now (every H inner steps, or the period)
    before_round   overlap: merge the last round's result; snapshot theta_w as the round's input
    after_round    no overlap: theta_w = theta_sync; overlap: the merge waits for before_round

Comm side: ``run_round`` (one small all-reduce, then the subclass's exchange and outer step).
The inner optimizer is ``cfg.optimizer`` on the whole padded flat buffer: a full-size
``ctx.shard_state`` whose master is theta_w; the model's parameters are its compute-dtype copy.
With node replicas (the two-level layout) each rank steps its slice of the node's buffer; with the
model sharded inside the node (model_sharding="node", engine/parallel/sharding.py) each rank steps
its FSDP2 local shards (1/G of the model), which FSDP2's reduce-scatter has already summed over the
node, and the outer round runs on them over the rail (docs/local_steps.md, "Node sharding and the
outer state on the CPU"). The outer state lives where ``outer_state_device`` says (outer_state.py);
with ``optimizer_offload='cpu'`` the inner state lives in host memory and each inner step runs
there, the gradient copied over and the new parameters back in pieces (inner_step.py ``offloaded``).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from acco_loco.acco import RoundKind, RoundPlan
from acco_loco.optim import can_fuse, clip_coefficient, propose_step
from acco_loco.outer import pseudo_gradient, sample_shares
from acco_loco.schedule import lr_at

from ..core.rounds import (
    NonFiniteGradientError,
    RoundContext,
    RoundRequest,
    RoundResult,
    squared_norm_f64,
)
from ..parallel.two_level import slice_of
from ..runtime.host import nonfinite_flag, small_vector, to_host
from ..runtime.offload import pieces_of
from .base import Recut, Strategy
from .inner_step import PIECE, PieceStep, inner_step_on_device, offloaded
from .local_totals import InnerStep, OuterTotals, PeriodTotals
from .node_replica import NodeReplica, inner_totals
from .outer_state import OuterPlace
from .spec import MemorySpec, StrategySpec


def device_side(t: torch.Tensor) -> bool:
    """Whether the inner step runs its accelerator path (one host read): off the CPU. Tests set
    this to run that path on CPU."""
    return t.device.type != "cpu"


class LocalStepStrategy(Strategy):
    """The skeleton; a subclass names itself and implements ``setup_outer``, ``outer_update``,
    ``outer_tensors`` and ``load_outer``."""

    name = ""
    two_level = True  # a node is one replica (engine/strategies/node_replica.py)
    node_sharding_refused = None  # each rank steps its FSDP2 local shards; the outer round runs over the rail
    offload_refused = None  # the inner state may live in host memory (optimizer_offload='cpu')
    sections = ("outer",)  # what diloco and sparseloco share: engine/strategies/outer_config.py
    # each worker's inner copy is its own; theta_sync and the outer momentum every replica's alike;
    # sparseloco's error feedback summed
    recut_rules = {"opt.": Recut("local"), "opt.master": Recut("local", new_from="outer.theta_sync"),
                   "outer.theta_sync": Recut("shared"), "outer.momentum": Recut("shared"),
                   "outer.error": Recut("summed"), "outer.submitted": Recut("local", new_from="outer.submitted")}

    def __init__(self, cfg):
        self.cfg = cfg
        self.plan = RoundPlan(self.name, overlap=cfg.outer_overlap, kinds=(RoundKind.COMMIT,),
                              local_steps=cfg.inner_steps)
        self.theta_sync: torch.Tensor | None = None  # fp32, the same on every replica
        self.submitted: torch.Tensor | None = None  # theta_w when the last round was submitted
        self.period = PeriodTotals()  # accumulating
        self.sending = PeriodTotals()  # the round in flight's
        self.unmerged = False  # overlap: a finished round whose result is not merged yet
        self.done = False  # this worker reached its step budget (outer_period_s)
        self.last: OuterTotals | None = None
        self.period_start = time.perf_counter()
        self._step_in_place = PieceStep()  # the inner step written over the state (inner_step.py)
        self.layout = None  # the node layout when a node is one replica (two-level), else None
        self.replica: NodeReplica | None = None  # node replicas, and a model sharded inside the node
        self.sharded = False  # model_sharding='node': theta_w is this rank's FSDP2 local shards
        self.place: OuterPlace | None = None  # where the outer state lives (outer_state_device)
        self.node_due = False  # node replicas: some rank of the node saw its outer period elapse
        self._exhausted: torch.Tensor | None = None  # node replicas: the data-ran-out flag's buffer
        self.offload = None  # optimizer_offload='cpu': the inner state in host memory (HostOptimizer)

    @classmethod
    def from_config(cls, cfg) -> LocalStepStrategy:
        return cls(cfg)

    outer_cost = ""  # the planner's Hardware cost attribute of an outer round, per value
    outer_round_parts = None  # (numel, world, mode, ws) -> one outer round's bytes per rank, by collective

    @classmethod
    def spec(cls) -> StrategySpec:
        return StrategySpec(rounds=1, overlap=False, memory=MemorySpec("local"), round_parts=cls.outer_round_parts,
                            local_steps=True, outer_cost=cls.outer_cost)

    @classmethod
    def check(cls, cfg) -> None:
        wrong = []
        if cfg.codec != "none":
            wrong.append("codec='none' (the pseudo-gradient has its own wire format: pseudo_grad_dtype, topk_*)")
        if cfg.param_codec not in ("auto", "float32"):
            wrong.append("param_codec='auto' or 'float32' (no parameters travel: every replica computes "
                         "theta_sync)")
        if cfg.accumulation != "fixed":
            wrong.append("accumulation='fixed' (an inner step runs a fixed number of micro-batches)")
        if cfg.balance != "equal":
            wrong.append("balance='equal' (mixed speeds: outer_period_s)")
        if wrong:
            raise ValueError(f"strategy {cfg.strategy!r} cannot honour this configuration: set " + "; ".join(wrong))

    def make_loop(self, parts):
        from ..loops.local_steps import (
            LocalStepsLoop,  # the runtime loads only when an engine is built
        )

        return LocalStepsLoop(parts)

    @classmethod
    def check_global_batches(cls, cfg) -> None:
        raise ValueError(f"strategy {cfg.strategy!r} takes local steps (each worker its own inner "
                         f"steps): pass each worker its own micro-batches, not GlobalBatches")

    # ------------------------------------------------------------------ setup
    def initial_values(self, flat, full32: torch.Tensor, rank: int, layout) -> torch.Tensor:
        """The inner optimizer's values: the whole buffer, this worker's own copy; with node
        replicas (a two-level ``layout``) this rank's slice of the node's copy."""
        self.layout = layout
        return full32 if layout is None else slice_of(full32, layout)

    def setup(self, ctx: RoundContext) -> None:
        """Allocate the outer state around the start every replica shares (rank 0's parameters)."""
        world, batch = ctx.comm.world_size, ctx.cfg.global_micro_batches
        if batch is not None and batch % world:
            raise ValueError(f"global_micro_batches={batch} is the micro-batches of one inner step over "
                             f"{world} workers, who all take the same number in {self.name!r}: use a "
                             f"multiple of {world}")
        master = ctx.shard_state.master
        dims = getattr(ctx, "dims", None)
        self.sharded = dims is not None and dims.kind == "node_sharded"
        if self.layout is not None or self.sharded:  # every rank of every node, in this order: its groups
            self.replica = NodeReplica(dims)
        owned = ctx.flat.padded // (1 if self.layout is None else self.layout.ranks_per_node)
        if master.numel() != owned:
            raise RuntimeError(f"{self.name} needs the inner optimizer state of {owned} values (the whole "
                               f"buffer, or a node replica's slice), the engine gave {master.numel()}")
        self.place = OuterPlace(ctx.cfg.outer_state_device, master.device)
        self.theta_sync = self.place.copy_of(master.detach())
        self.submitted = torch.zeros_like(self.theta_sync)
        if ctx.cfg.optimizer_offload == "cpu":
            # a node replica's norm is the node's all-reduce on the device: its gradient comes in piece slots
            self.offload = offloaded(ctx.shard_state, master.device, self._step_in_place,
                                     whole_gradient=self.replica is None)
        self.setup_outer(ctx)
        self.period_start = time.perf_counter()

    def setup_outer(self, ctx: RoundContext) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ compute side
    def inner_step(self, ctx: RoundContext, grad_sum: torch.Tensor, count: int, samples: int,
                   loss_sum: float | torch.Tensor, step_index: int) -> InnerStep:
        """One optimizer step of this worker alone on the mean of its accumulated micro-batch
        gradients (clipped by its own norm); a non-finite gradient or update leaves the state as
        it was (nan_policy='skip') or raises ('stop'). ``loss_sum``: the micro-batches' summed
        loss (a 0-d tensor on the device: read with the step's one host read)."""
        cfg = ctx.cfg
        lr = lr_at(step_index, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        if self.replica is not None:
            return self._node_inner_step(ctx, grad_sum, count, samples, loss_sum, step_index, lr)
        self.period.micro_batches += count
        self.period.samples += samples
        if self.offload is not None:  # the inner state in host memory: the CPU path, on the gradient's host copy
            grad_sum = self.offload.fetch_all(grad_sum, PIECE)
        elif device_side(grad_sum):
            return inner_step_on_device(self, ctx, grad_sum, count, loss_sum, step_index, lr)
        loss_sum = float(loss_sum)  # CPU: reading a CPU tensor waits for nothing
        self.period.loss_sum += loss_sum
        grad_sum = grad_sum.to(torch.float32)  # no copy in fp32
        sq = float(torch.dot(grad_sum, grad_sum))  # one pass, one host read
        squares_fit = math.isfinite(sq)
        if not squares_fit:  # NaN/Inf, or finite values whose fp32 squares overflowed (rare)
            sq = float(squared_norm_f64(grad_sum))
        norm = math.sqrt(sq) / count
        if not math.isfinite(norm):
            return self._skip_inner(ctx, step_index, lr, loss_sum / count, "non-finite gradient")
        coef = clip_coefficient(norm, cfg.max_grad_norm)
        state = ctx.shard_state
        if squares_fit and can_fuse(ctx.spec, grad_sum, state):
            if not self._step_in_place(state, grad_sum, count, coef, lr, ctx.spec):
                raise NonFiniteGradientError(
                    f"inner step {step_index + 1} on rank {ctx.comm.rank} gave non-finite parameters from a "
                    "finite gradient: the parameters were already near the float32 limit; lower the learning "
                    "rate or add weight decay, and restart from the last checkpoint")
        else:
            grad = grad_sum / count
            if coef < 1.0:
                grad.mul_(coef)
            proposal = propose_step(state, grad, lr, ctx.spec)
            if not bool(torch.isfinite(proposal.master).all()):
                return self._skip_inner(ctx, step_index, lr, loss_sum / count, "non-finite parameters after the update")
            state.install(proposal)
        self.install(ctx, state.master)
        return InnerStep(lr, norm, loss_sum / count, False)

    def _node_inner_step(self, ctx: RoundContext, grad_sum: torch.Tensor, count: int, samples: int,
                         loss_sum: float | torch.Tensor, step_index: int, lr: float) -> InnerStep:
        """The node's inner step: the node's summed gradient, reduce-scattered inside the node; each
        rank steps its slice; the same decisions on every rank of the node (one small all-reduce
        for the counts, the norm and the flags, one for the new slices' finiteness). The step is
        written over the state in pieces (``_step_in_place``): no second copy of the inner state,
        which is what would not fit at scale. A model sharded inside the node: FSDP2's
        reduce-scatter has already summed the node's gradients of this rank's local shards."""
        cfg, rep, state = ctx.cfg, self.replica, ctx.shard_state
        part = grad_sum if self.sharded else rep.node_sum(grad_sum)
        due = cfg.outer_period_s is not None and time.perf_counter() - self.period_start >= cfg.outer_period_s
        n, node_samples, loss_sum, sq, bad, self.node_due = inner_totals(rep, part, count, samples, loss_sum,
                                                                          grad_sum, due)
        if rep.layout.local == 0:  # the node's tallies, once per node: the outer round sums every rank's
            self.period.micro_batches += n
            self.period.samples += node_samples
            self.period.loss_sum += loss_sum
        norm = math.sqrt(sq) / n if not bad else math.nan
        if not math.isfinite(norm):
            return self._skip_inner(ctx, step_index, lr, loss_sum / n, "non-finite gradient")
        coef = clip_coefficient(norm, cfg.max_grad_norm)
        ready, fused = None, can_fuse(ctx.spec, part, state)
        if self.offload is not None:  # each piece stepped on the host in its slot, once its copy has landed
            ready = self.offload.gradient_pieces(part, pieces_of(part.numel(), PIECE))
            fused = can_fuse(ctx.spec, self.offload.grad_slots[0], state)  # fp32 host slots
        fits = self._step_in_place(state, part, n, coef, lr, ctx.spec, fused, ready)
        if rep.agree(small_vector([float(not fits)], part.device))[0] > 0:
            raise NonFiniteGradientError(
                f"inner step {step_index + 1} on the node of rank {ctx.comm.rank} gave non-finite parameters from a "
                "finite gradient: the parameters were already near the float32 limit; lower the learning "
                "rate or add weight decay, and restart from the last checkpoint")
        self.install(ctx, state.master)
        return InnerStep(lr, norm, loss_sum / n, False)

    def install(self, ctx: RoundContext, values: torch.Tensor) -> None:
        """The replica's parameters ``values`` (this rank's own: the whole buffer, or its slice of
        the node's, or its local shards) into the model's buffer."""
        if self.sharded:
            ctx.flat.install(values)  # FSDP2's local shards: no collective
            return
        if self.replica is not None:  # offloaded: the slice on the device for the node's gather
            self.replica.install(values.to(ctx.flat.data.device), ctx.flat.data)
            return
        if self.offload is not None:
            self.offload.send(ctx.flat.data, values, PIECE)
            return
        with torch.no_grad():
            ctx.flat.data.copy_(values)

    def whole_theta_sync(self, ctx: RoundContext) -> torch.Tensor:
        """theta_sync as the whole padded buffer (fp32). A node replica gathers its ranks' slices:
        every rank of the node calls this together, on the compute side. A sharded model: the
        trainable parameters' whole values in order, unpadded (FSDP2's cut gathered in the node)."""
        if self.sharded:
            return self._gather_local_shards(ctx, self.place.to_wire(self.theta_sync))
        if self.replica is None:
            return self.theta_sync
        out = torch.empty(ctx.flat.padded, dtype=torch.float32, device=self.theta_sync.device)
        self.replica.install(self.theta_sync, out)
        return out

    @staticmethod
    def _gather_local_shards(ctx: RoundContext, local: torch.Tensor) -> torch.Tensor:
        """The whole values of a local buffer laid out as ctx.flat's local shards (a node collective
        per parameter, through DTensor)."""
        from torch.distributed.tensor import DTensor

        flat, whole = ctx.flat, []
        for p, shape, (a, b) in zip(flat.params, flat.shapes, flat.offsets):
            part = DTensor.from_local(local[a:b].view(shape), p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
            whole.append(part.full_tensor().reshape(-1))
        return torch.cat(whole)

    def agree_exhausted(self, exhausted: bool) -> bool:
        """Whether this replica's data ran out: a node replica stops when any of its ranks' did
        (its ranks take every inner step together)."""
        if self.replica is None:
            return exhausted
        if self._exhausted is None:  # a kept device buffer, filled in place (no host-to-device copy)
            self._exhausted = torch.zeros(1, dtype=torch.float64, device=self.theta_sync.device)
        return self.replica.agree(self._exhausted.fill_(float(exhausted)))[0] > 0

    def _skip_inner(self, ctx: RoundContext, step_index: int, lr: float, loss: float, why: str) -> InnerStep:
        if ctx.cfg.nan_policy == "stop":
            raise NonFiniteGradientError(
                f"{why} in inner step {step_index + 1} on rank {ctx.comm.rank}: lower the learning rate, "
                "clip gradients (max_grad_norm), check the data, or set nan_policy='skip'")
        return InnerStep(lr, math.nan, loss, True)

    def round_due(self, step: int, stopping: bool) -> bool:
        """Every H inner steps (counted from the start of the run, so a resumed run keeps the
        same rounds); with outer_period_s, once the period has elapsed or this worker reached
        its step budget (checked at inner-step boundaries only)."""
        if self.cfg.outer_period_s is None:
            return step % self.plan.local_steps == 0
        if self.replica is not None:  # decided in the inner step, the same on every rank of the node
            return stopping or self.node_due
        return stopping or time.perf_counter() - self.period_start >= self.cfg.outer_period_s

    def before_round(self, ctx: RoundContext, stopping: bool) -> None:
        """Overlap: merge the finished round (theta_w += theta_sync - submitted). Then keep
        theta_w as the round's input, and start a new period."""
        master = ctx.shard_state.master
        if self.unmerged:
            self.place.merge(master, self.theta_sync, self.submitted)
            self.install(ctx, master)
            self.unmerged = False
        self.place.copy(self.submitted, master)  # on the CPU: theta_w to the host, in pieces
        self.sending, self.period = self.period, PeriodTotals()
        self.done = stopping and self.cfg.outer_period_s is not None
        if self.plan.overlap:
            self.period_start = time.perf_counter()
        if self.replica is not None:
            self.replica.round_submitted()  # the round's epoch starts here (node_replica.py)

    def after_round(self, ctx: RoundContext, result: RoundResult) -> bool:
        """Install the round's theta_sync as theta_w (no overlap) or leave it for the next
        before_round (overlap); True when every rank must stop (a worker reached its budget)."""
        if self.plan.overlap:
            self.unmerged = True
        else:
            master = ctx.shard_state.master
            self.place.copy(master, self.theta_sync)  # on the CPU: back from the host, in pieces
            self.install(ctx, master)
            self.period_start = time.perf_counter()
        return bool(self.last is not None and self.last.done_ranks)

    # ------------------------------------------------------------------ comm side
    def run_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        try:
            return self._outer_round(ctx, req)
        finally:
            if self.replica is not None:
                self.replica.round_finished()

    def _outer_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        comm, t0 = ctx.comm, time.perf_counter()
        own = [comm] if self.replica is None else [comm, self.replica.rail, self.replica.outer_node]
        before = sum(c.sent for c in own)  # the compute thread's inner steps may send meanwhile
        delta = self.form_pseudo_gradient()
        totals = self._agree(ctx, req, self.place.to_wire(self.pseudo_gradient_flag(delta)))
        self.last = totals
        skipped, reason = bool(totals.bad_ranks), "non-finite pseudo-gradient from"
        shares, outer_ctx = totals.shares, ctx
        if self.replica is not None:  # the replicas are the nodes; the exchange runs over the rail
            shares, outer_ctx = self.replica.node_shares(totals.rank_samples), replace(ctx, comm=self.replica.rail)
        if not skipped and totals.samples > 0 and not self.outer_update(outer_ctx, delta, shares):
            skipped, reason = True, "non-finite parameters after the outer step; every rank computed it:"
            if ctx.cfg.nan_policy == "stop":
                raise NonFiniteGradientError(
                    f"the outer step of round {req.index} gave non-finite parameters: lower outer_lr, or "
                    "set nan_policy='skip'")
        return RoundResult(
            index=req.index, kind=req.kind, step_index=req.step_index, local_count=self.sending.micro_batches,
            count=totals.count, samples=totals.samples,
            loss=totals.loss_sum / totals.count if totals.count else math.nan, lr=ctx.cfg.outer_lr,
            grad_norm=math.nan, skipped=skipped, empty=totals.samples == 0, bad_ranks=totals.bad_ranks,
            exhausted_ranks=totals.exhausted_ranks, bytes_sent=sum(c.sent for c in own) - before,
            phases={"outer_round": (t0, time.perf_counter())}, skip_reason=reason if skipped else "")

    def _agree(self, ctx: RoundContext, req: RoundRequest, local_bad: torch.Tensor) -> OuterTotals:
        """One float64 all-reduce of 2 + 4N values: the period's micro-batches and loss sum, and
        one slot per rank for its samples and its exhausted / non-finite / done flags."""
        comm, n, rank = ctx.comm, ctx.comm.world_size, ctx.comm.rank
        values: list = [self.sending.micro_batches, self.sending.loss_sum] + [0.0] * (4 * n)
        values[2 + rank] = self.sending.samples
        values[2 + n + rank] = float(req.exhausted)
        values[2 + 2 * n + rank] = local_bad
        values[2 + 3 * n + rank] = float(self.done)
        small = to_host(comm.all_reduce_sum(small_vector(values, local_bad.device)))
        samples = [int(s) for s in small[2:2 + n]]
        flagged = [[r for r in range(n) if small[2 + k * n + r] > 0] for k in (1, 2, 3)]
        if flagged[1] and ctx.cfg.nan_policy == "stop":
            raise NonFiniteGradientError(f"non-finite pseudo-gradient in outer round {req.index} from rank(s) "
                                         f"{flagged[1]}: lower the learning rates, or set nan_policy='skip'")
        return OuterTotals(int(small[0]), sum(samples), float(small[1]), sample_shares(samples), *flagged,
                           rank_samples=samples)

    def form_pseudo_gradient(self) -> torch.Tensor:
        """Delta_w = theta_sync - s_w, the round's input: a new tensor (a subclass may form it over
        the snapshot, which a round without overlap reads nowhere else)."""
        return pseudo_gradient(self.theta_sync, self.submitted)

    def pseudo_gradient_flag(self, delta: torch.Tensor | None) -> torch.Tensor:
        """1.0 (a 0-d float64 tensor) if Delta_w holds a NaN or an Inf, else 0.0 (a subclass that forms
        Delta_w a piece at a time in its outer_update, and gives None here, checks it in pieces)."""
        return nonfinite_flag(delta)

    def outer_update(self, ctx: RoundContext, delta: torch.Tensor | None, shares: list[float]) -> bool:
        """Exchange this worker's contribution and move theta_sync in place; False (nothing
        installed) when the new theta_sync would not be finite."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self, ctx: RoundContext) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {"outer.theta_sync": self.theta_sync.detach().cpu().contiguous()}
        if self.plan.overlap:
            tensors["outer.submitted"] = self.submitted.detach().cpu().contiguous()
        tensors.update({k: v.detach().cpu().contiguous() for k, v in self.outer_tensors().items()})
        meta = {"outer": {"strategy": self.name, "overlap": self.plan.overlap, "unmerged": self.unmerged,
                          "period": self.period.as_list(), **self.outer_meta()}}
        return tensors, meta

    @classmethod
    def recut_refusal(cls, meta: dict) -> str | None:
        if meta.get("outer", {}).get("unmerged"):
            return ("it was taken with an outer round in flight (outer_overlap): resume it at its own world size, "
                    "or use a checkpoint taken after the round was merged")
        return None

    def load_state_dict(self, ctx: RoundContext, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        saved = meta.get("outer", {})
        if saved.get("overlap") != self.plan.overlap:
            raise ValueError(f"the checkpoint was written with outer_overlap={saved.get('overlap')} and this "
                             f"run has outer_overlap={self.plan.overlap}: resume with the checkpoint's value")
        self.theta_sync.copy_(tensors["outer.theta_sync"])
        if self.plan.overlap:
            self.submitted.copy_(tensors["outer.submitted"])
        self.unmerged = saved["unmerged"]
        self.period = PeriodTotals(*saved["period"])
        self.load_outer(tensors, saved)
        self.install(ctx, ctx.shard_state.master)  # this replica's own theta_w (replicas differ)
        self.period_start = time.perf_counter()

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def outer_meta(self) -> dict:
        return {}

    def load_outer(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        pass
