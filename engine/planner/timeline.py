"""A step's time from the strategy's round timeline (docs/DESIGN.md section 12.2).

Per worker, with T_c the forward + backward of its samples, a round's comm side
``work`` (shard optimizer, copies, codec passes), ``intra`` and ``inter`` its transfer times
inside the node and through the node's link (the round's collectives run one after another, so
a round takes work + intra + inter), and, where the comm side shares the worker's core (the CPU
testbed), ``shared`` the CPU it takes from compute:

    torch DDP     T_c + opt + max(0, A - overlappable)      A = all-reduce time; its buckets overlap
                                                            the last micro-batch's backward after the first bucket
    zero1, 1-bit  T_c + R round                             nothing overlaps
    dpu           max(T_c + shared, round)                  the round of step t runs during step t+1's compute
    acco          2 max(T_c / 2 + shared, round)            each round hides behind half the step's compute
    diloco/sparseloco: an inner step T_c + opt (two-level: + the node's zero1 round at full
                  precision), plus the outer round / H; with outer_overlap the outer round runs
                  behind the next H inner steps and only what exceeds them is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware
from .modes import Mode
from .shape import ModelShape
from .wire import ALIGN, Layout, StepBytes, WireSettings, padded, step_bytes


@dataclass(frozen=True)
class Batch:
    global_samples: int  # B per optimizer step (local steps: per inner step, all replicas together)
    micro_batch: int  # samples per micro-batch per worker

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


def _compute(hw: Hardware, shape: ModelShape, samples: float) -> float:
    return hw.compute_s(samples, shape.flops_per_sample())


def step_time(mode: Mode, shape: ModelShape, layout: Layout, hw: Hardware, batch: Batch,
              ws: WireSettings | None = None, worker_speeds: tuple[float, ...] | None = None,
              balance: str = "speed") -> StepTime:
    """Predicted time of one optimizer step. ``worker_speeds`` (relative compute speeds, one per
    worker) models heterogeneous workers: with ``balance='speed'`` the step's samples are shared
    in proportion (every worker finishes together), with 'equal' the slowest sets the pace."""
    ws = ws or WireSettings()
    n, g = layout.world, layout.per_node
    numel = shape.trainable
    b = step_bytes(numel, layout, mode, ws, ddp_numel=shape.trainable)
    t_c = _compute(hw, shape, batch.global_samples / n)
    if worker_speeds:
        mean = sum(worker_speeds) / len(worker_speeds)
        # speed shares need micro-batches to move: with one per worker per round (G_r <= N) every
        # worker runs one and the slowest sets the pace, as under equal shares
        per_round = batch.global_samples / batch.micro_batch / (1 if mode.is_ddp else mode.rounds)
        if balance == "equal" or mode.is_ddp or per_round <= n:
            t_c = t_c * mean / min(worker_speeds)
    t_c_eff = t_c * (1 + hw.compute_inflation)
    transport = hw.transport_s_per_byte * b.rank
    if mode.is_ddp:
        return _ddp(mode, shape, layout, hw, batch, b, t_c, t_c_eff, transport)
    if mode.local_steps:
        return _local(mode, numel, layout, hw, b, t_c, t_c_eff, transport, ws)
    # sharded rounds: work per round
    two_level = mode.exchange == "two-level" and g > 1
    world = layout.nodes if two_level else n
    slice_ = -(-numel // g) if two_level else numel
    p = padded(slice_, world, ALIGN)
    shard = p / world
    if mode.strategy == "onebit_adam":
        work = hw.onebit_s_per_param * numel + hw.codec_s_per_param * 2 * slice_
    else:
        codec_passes = (2 if mode.codec != "none" else 0)  # encode + error feedback, decode + sum
        work = (hw.round_s_per_param * numel + hw.shard_opt_s_per_param * shard
                + hw.codec_s_per_param * codec_passes * slice_
                + (hw.codec_s_per_param * (shard + numel) if mode.param_codec in ("int8", "int4") else 0.0))
    inter = hw.wire_s(b.round_node_link)
    intra = hw.intra_s(b.round_intra_rank)
    rounds = b.rounds
    round_s = work + inter + intra
    shared = (work + transport / rounds) if hw.shares_core else 0.0
    if mode.strategy == "acco":
        step = 2 * max(t_c_eff / 2 + shared, round_s)
    elif mode.strategy == "dpu":
        step = max(t_c_eff + shared, round_s)
    else:  # zero1, onebit_adam: the round follows compute
        step = t_c_eff + rounds * round_s
    return StepTime(mode, step, t_c, rounds * work + transport, rounds * inter, rounds * intra, step - t_c, b)


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


def _local(mode, numel, layout, hw, b, t_c, t_c_eff, transport, ws) -> StepTime:
    g, h = layout.per_node, mode.inner_steps
    two_level = mode.exchange == "two-level" and g > 1
    if two_level:  # the node's ranks take each inner step together: a zero1 round at full precision
        shard = padded(numel, g, ALIGN) / g
        inner_work = hw.round_s_per_param * numel + hw.shard_opt_s_per_param * shard
        inner = t_c_eff + inner_work + hw.intra_s(b.round_intra_rank)
    else:
        inner_work = hw.optimizer_s_per_param * numel
        inner = t_c_eff + inner_work
    slice_ = -(-numel // g) if two_level else numel
    outer_work = hw.outer_s_per_param.get(mode.strategy, 0.0) * slice_ + transport * h
    outer = outer_work + hw.wire_s(b.round_node_link)
    if mode.outer_overlap:
        shared = outer_work if hw.shares_core else 0.0
        step = inner + (shared + max(0.0, outer - shared - h * inner)) / h
    else:
        step = inner + outer / h
    return StepTime(mode, step, t_c, inner_work + outer_work / h, hw.wire_s(b.round_node_link) / h,
                    hw.intra_s(b.round_intra_rank) if two_level else 0.0, step - t_c, b)
