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

With the optimizer's state on the CPU (optimizer_offload='cpu', engine/runtime/offload.py) the
round's shard step leaves the GPU: its device optimizer work is replaced by ``offload_round_s``,
the reduced gradient's shard to the host (4 bytes a value), the host step, and the new fp32
master back (4 bytes a value), pipelined over the round's c pieces: the longest of the three plus
the other two's share of one piece. Step copy auto is then 'whole' (the spare is host memory),
so nothing is stepped twice. The rates are assumptions, stated once (``HostLink``):
- PCIe Gen5 x16 carries 32 GT/s x 16 lanes x 128/130 = 63 GB/s per direction; large pinned
  copies reach about 50 GB/s. We assume two GPUs share one such link to the host (a PCIe switch's
  uplink, as on 8-GPU HGX boards where GPUs and NICs pair up behind switches): 25 GB/s per GPU
  per direction while all of a node's GPUs copy at once.
- The host step is the fused CPU AdamW kernel (acco_loco/kernels.c) on the round's one comm
  thread, one core per GPU: it reads gradient, master and moments and writes master and moments,
  28 bytes a value. Measured on the project's 2-core CPU machine under load: 0.107 G values/s
  (16.8 M values, ``propose_slice`` with the kernel; the torch path 0.034); a server core with
  its share of a socket's memory bandwidth is assumed to reach 0.25 G values/s (7 GB/s).
A local-step strategy's offloaded inner step (``offload_inner_s``) is priced with the same rates:
its gradient's pieces go to the host behind the host step, and the new master comes back after
the step (engine/strategies/local_steps.py installs it whole), on the compute side, every inner step.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.strategies.spec import resolve_step_copy

from .hardware import TESTBED_CONSTANTS, Hardware
from .modes import Mode
from .shape import ModelShape
from .wire import ALIGN, Layout, StepBytes, WireSettings, padded, step_bytes


@dataclass(frozen=True)
class HostLink:
    """What an offloaded optimizer's round costs besides the wire (the module's docstring says
    where each figure comes from)."""

    copy_Bps: float = 25e9  # host <-> GPU bytes/s per GPU per direction (PCIe Gen5 x16, two GPUs a link)
    step_values_per_s: float = 0.25e9  # the fused CPU AdamW on one core per GPU


HOST_LINK = HostLink()
MAX_PIECE_VALUES = 1 << 24  # engine/parallel/comm.py's: a piece of all ranks' shards together


def offload_round_s(shard: float, exchange_ranks: int, link: HostLink = HOST_LINK, steps: float = 1.0) -> float:
    """Seconds one round of an offloaded optimizer adds (per GPU): the shard's gradient to the
    host, ``steps`` host steps of the shard (1; 2 when a commit recomputes under step_copy
    'piece'), the new master back, pipelined over the round's pieces (each at most
    MAX_PIECE_VALUES values of the ``exchange_ranks`` ranks' shards together)."""
    pieces = max(1, -(-int(shard * exchange_ranks) // MAX_PIECE_VALUES))
    parts = [4 * shard / link.copy_Bps, steps * shard / link.step_values_per_s, 4 * shard / link.copy_Bps]
    longest = max(parts)
    return longest + (sum(parts) - longest) / pieces


def offload_inner_s(values: float, link: HostLink = HOST_LINK) -> float:
    """Seconds an offloaded local-step inner step adds (per GPU, ``values`` its inner state's
    values): the gradient to the host pipelined with the host step over 2^20-value pieces, then
    the new master back to the device."""
    pieces = max(1, -(-int(values) // (1 << 20)))
    fetch, step = 4 * values / link.copy_Bps, values / link.step_values_per_s
    return max(fetch, step) + min(fetch, step) / pieces + 4 * values / link.copy_Bps


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
    offload = mode.offload == "cpu"
    recompute = bool(mode.spec.installs) and resolve_step_copy(
        ws.step_copy, cuda=not hw.shares_core and not offload) == "piece"
    if offload:  # the shard's step leaves the GPU: host copies and the host step instead
        work -= hw.shard_opt_s_per_param * shard
        work += offload_round_s(shard, world, steps=1 + (mode.spec.installs / rounds if recompute else 0))
    elif recompute:
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
    sharded = two_level and mode.sharding == "node"  # FSDP2 summed the node's gradients (in t_c_eff)
    offload = mode.offload == "cpu"  # optimizer_offload='cpu': the inner step on the host
    if sharded:  # each rank steps its local shards: no node round of the engine's
        shard = padded(numel, g, ALIGN) / g
        inner_work = offload_inner_s(shard) if offload else hw.shard_opt_s_per_param * shard
        inner = t_c_eff + inner_work
    elif two_level:  # the node's ranks take each inner step together: a sharded round at full precision
        shard = padded(numel, g, ALIGN) / g
        step_s = offload_inner_s(shard) if offload else hw.shard_opt_s_per_param * shard
        inner_work = hw.round_s_per_param * numel + step_s
        inner = t_c_eff + inner_work + hw.intra_s(b.round_intra_rank)
    else:
        inner_work = offload_inner_s(numel) if offload else hw.optimizer_s_per_param * numel
        inner = t_c_eff + inner_work
    slice_ = -(-numel // g) if two_level else numel
    outer_work = getattr(hw, mode.spec.outer_cost) * slice_ + transport * h
    if mode.outer_state == "cpu":  # outer_state_device='cpu': theta_w to the host and theta_sync back, and
        # the outer step on a host core at the CPU testbed's measured rate (engine/strategies/outer_state.py)
        outer_work = TESTBED_CONSTANTS[mode.spec.outer_cost] * slice_ + 2 * 4 * slice_ / HOST_LINK.copy_Bps + transport * h
    outer = outer_work + hw.wire_s(b.round_node_link)
    if mode.outer_overlap:
        shared = outer_work if hw.shares_core else 0.0
        step = inner + (shared + max(0.0, outer - shared - h * inner)) / h
    else:
        step = inner + outer / h
    return StepTime(mode, step, t_c, inner_work + outer_work / h, hw.wire_s(b.round_node_link) / h,
                    hw.intra_s(b.round_intra_rank) if two_level and not sharded else 0.0, step - t_c, b)
