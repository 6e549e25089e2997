"""A step's time from the strategy's round timeline (docs/planning.md, "Time").

Per worker, with T_c the forward + backward of its samples, a round's comm side
``work`` (shard optimizer, copies, codec passes), ``intra`` and ``inter`` its transfer times
inside the node and through the node's link (the round's collectives run one after another, so
a round takes work + intra + inter), and, where the comm side shares the worker's core (the CPU
testbed), ``shared`` the CPU it takes from compute:

    torch DDP     T_c + opt + max(0, A - overlappable)      A = all-reduce time; its buckets overlap
                                                            the last micro-batch's backward after the first bucket
    no overlap    T_c + R round                             the R rounds of a step follow compute
    overlap       R max(T_c / R + shared, round)            each round hides behind 1/R of the step's compute
                                                            (R = 1: the round of step t runs during step t+1's)
    local steps   an inner step T_c + opt (two-level: + the node's sharded round at full precision),
                  plus the outer round / H; with outer_overlap the outer round runs behind the
                  next H inner steps and only what exceeds them is exposed.

R and the overlap are the strategy's round plan, the round's work its spec's (engine/strategies/spec.py),
plus, under step_copy 'piece' (auto on a GPU), the shard's optimizer once more per installing round.
With the model sharded over the node, FSDP2's per-micro-batch collectives inside the node run
behind compute (only what exceeds it counts) and the round has no intra-node part of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.strategies.spec import resolve_step_copy

from .hardware import Hardware
from .modes import Mode
from .shape import ModelShape
from .wire import ALIGN, Layout, StepBytes, WireSettings, padded, step_bytes


@dataclass(frozen=True)
class Batch:
    global_samples: int  # B per optimizer step (local steps: per inner step, all replicas together)
    micro_batch: int  # samples per micro-batch per worker
    checkpointing: bool = False  # activation checkpointing: the forward runs again in the backward

    def micro_batches_per_worker(self, world: int) -> float:
        return max(1.0, self.global_samples / (world * self.micro_batch))


@dataclass(frozen=True)
class StepTime:
    mode: Mode
    step_s: float
    compute_s: float  # forward + backward per worker per step
    comm_work_s: float  # comm-side work per step (codecs, shard optimizer, transport CPU)
    inter_s: float  # node-link transfer time per step
    intra_s: float  # intra-node transfer time per step
    exposed_s: float  # step_s - compute_s: what the overlap did not hide
    bytes: StepBytes

    @property
    def compute_utilisation(self) -> float:
        return self.compute_s / self.step_s if self.step_s else 0.0


def _compute(hw: Hardware, shape: ModelShape, samples: float, recompute: bool = False) -> float:
    plain = hw.compute_s(samples, shape.flops_per_sample())
    return plain * shape.flops_per_sample(True) / shape.flops_per_sample() if recompute else plain


def step_time(mode: Mode, shape: ModelShape, layout: Layout, hw: Hardware, batch: Batch,
              ws: WireSettings | None = None, worker_speeds: tuple[float, ...] | None = None,
              balance: str = "speed") -> StepTime:
    """Predicted time of one optimizer step. ``worker_speeds`` (relative compute speeds, one per
    worker) models heterogeneous workers: with ``balance='speed'`` the step's samples are shared
    in proportion (every worker finishes together), with 'equal' the slowest sets the pace."""
    ws = ws or WireSettings()
    n, g = layout.world, layout.ranks_per_node
    numel = shape.trainable
    b = step_bytes(numel, layout, mode, ws, ddp_numel=shape.trainable)
    t_c = _compute(hw, shape, batch.global_samples / n, batch.checkpointing)
    if worker_speeds:
        mean = sum(worker_speeds) / len(worker_speeds)
        # speed shares need micro-batches to move: with one per worker per round (G_r <= N) every
        # worker runs one and the slowest sets the pace, as under equal shares
        per_round = batch.global_samples / batch.micro_batch / mode.rounds
        if balance == "equal" or mode.is_ddp or per_round <= n:
            t_c = t_c * mean / min(worker_speeds)
    t_c_eff = t_c * (1 + hw.compute_inflation)
    if mode.sharding == "node":  # FSDP2's gathers and reduce-scatters behind compute, per micro-batch
        t_c_eff = max(t_c_eff, fsdp_intra_s(shape, layout, hw, batch, ws))
    transport = hw.transport_s_per_byte * b.rank
    if mode.is_ddp:
        return _ddp(mode, shape, layout, hw, batch, b, t_c, t_c_eff, transport)
    if mode.local_steps:
        return _local(mode, numel, layout, hw, b, t_c, t_c_eff, transport)
    two_level = mode.exchange == "two-level" and g > 1
    world = layout.nodes if two_level else n
    slice_ = -(-numel // g) if two_level else numel
    shard = padded(slice_, world, ALIGN) / world
    rounds = b.rounds
    work = hw.work_s(mode.spec.work(numel, slice_, shard, mode))
    if mode.spec.installs and resolve_step_copy(ws.step_copy, cuda=not hw.shares_core) == "piece":
        # the step recomputed in place at install: the shard's optimizer once more per installing
        # round (where the round's constant folds the optimizer in, the compute side's rate)
        work += (hw.shard_opt_s_per_param or hw.optimizer_s_per_param) * shard * mode.spec.installs / rounds
    inter = hw.wire_s(b.round_node_link)
    intra = hw.intra_s(b.round_intra_rank) if mode.sharding == "none" else 0.0  # sharded: FSDP2 did it
    round_s = work + inter + intra
    shared = (work + transport / rounds) if hw.shares_core else 0.0
    if mode.overlap:  # each round hides behind 1/rounds of the step's compute
        step = rounds * max(t_c_eff / rounds + shared, round_s)
    else:  # the rounds follow compute
        step = t_c_eff + rounds * round_s
    return StepTime(mode, step, t_c, rounds * work + transport, rounds * inter, rounds * intra, step - t_c, b)


def fsdp_intra_s(shape: ModelShape, layout: Layout, hw: Hardware, batch: Batch, ws: WireSettings) -> float:
    """FSDP2 inside the node, per step: every micro-batch gathers the parameters for the forward
    and again for the backward (reshard_after_forward) and reduce-scatters the gradients, each
    (G-1)/G of the model at the compute dtype per rank."""
    g = layout.ranks_per_node
    per_mb = 3 * (g - 1) / g * shape.params * ws.compute_bytes
    return batch.micro_batches_per_worker(layout.world) * hw.intra_s(per_mb) if g > 1 else 0.0


def _ddp(mode, shape, layout, hw, batch, b, t_c, t_c_eff, transport) -> StepTime:
    numel = shape.trainable
    opt = hw.optimizer_s_per_param * numel
    inter = hw.wire_s(b.node_link)
    intra = hw.intra_s(b.intra_rank) if layout.nodes == 1 else 0.0  # a ring's time is its slowest edge
    allreduce = max(inter, intra)
    grad_bytes = numel * (2 if mode.ddp_dtype == "bfloat16" else 4)
    t_mb = t_c / batch.micro_batches_per_worker(layout.world)
    overlappable = (2 / 3) * t_mb * max(0.0, 1 - hw.ddp_bucket_bytes / grad_bytes) if not hw.shares_core else 0.0
    # the transport's CPU runs while compute waits for the all-reduce: it adds nothing
    step = t_c_eff + opt + max(0.0, allreduce - overlappable)
    return StepTime(mode, step, t_c, opt + transport, inter, intra, step - t_c, b)


def _local(mode, numel, layout, hw, b, t_c, t_c_eff, transport) -> StepTime:
    g, h = layout.ranks_per_node, mode.inner_steps
    two_level = mode.exchange == "two-level" and g > 1
    if two_level:  # the node's ranks take each inner step together: a sharded round at full precision
        shard = padded(numel, g, ALIGN) / g
        inner_work = hw.round_s_per_param * numel + hw.shard_opt_s_per_param * shard
        inner = t_c_eff + inner_work + hw.intra_s(b.round_intra_rank)
    else:
        inner_work = hw.optimizer_s_per_param * numel
        inner = t_c_eff + inner_work
    slice_ = -(-numel // g) if two_level else numel
    outer_work = getattr(hw, mode.spec.outer_cost) * slice_ + transport * h
    outer = outer_work + hw.wire_s(b.round_node_link)
    if mode.outer_overlap:
        shared = outer_work if hw.shares_core else 0.0
        step = inner + (shared + max(0.0, outer - shared - h * inner)) / h
    else:
        step = inner + outer / h
    return StepTime(mode, step, t_c, inner_work + outer_work / h, hw.wire_s(b.round_node_link) / h,
                    hw.intra_s(b.round_intra_rank) if two_level else 0.0, step - t_c, b)
