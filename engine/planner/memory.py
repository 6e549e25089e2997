"""Bytes per GPU of the training state (activations: engine/planner/activations.py), from
the memory sections of docs/design/ and of the strategies' topic files: memory per parameter. Each
strategy names the formula its state follows (its spec's ``MemorySpec``,
engine/strategies/spec.py); the numbers are here, one function per formula.

Per trainable parameter, e = compute dtype bytes, e_g = the gradient buffers' (4 under grad_dtype
auto, e with 'compute' or under model sharding: ``WireSettings.grad_bytes``), N = ranks sharing the
optimizer, g = codec group, G = ranks per node:

    replicated        16: fp32 parameters, fp32 gradients, AdamW's two moments (torch DDP, AMP); Muon's
                      hidden matrices keep one
    sharded           ``held_bytes`` (engine/planner/sharded_bytes.py): every tensor the engine keeps
                      after a step, by the categories engine/runtime/memory_accounting.py measures,
                      and the largest set of temporaries a round makes
                      (tests/engine/test_memory_accounting.py holds the two against each other).
                      S = P/N the owned shard, V the values the inter-node codec sees
                      (P flat, P/G two-level), c pieces (``Comm.pieces``), w a cast gather's bytes:
                        e + 2e_g       parameters, two gradient buffers; a round gathers the new
                                       parameters into the one it has reduced (+ e, a buffer of
                                       their own, where e_g < e: float64 parameters, fp32 gradients)
                        24/N           fp32 master and moments, the spare a step is proposed into
                                       (step_copy 'whole'); 'piece': 12/N and piece-sized
                                       scratch, min(c, 3) fp32 master slots and one of moments:
                                       (4 min(c, 3) + 8)/(N c)
                        4/N + 4/N per kept shard   the reducer's fp32 output (+ ACCO's kept half)
                        2 (1 + 4/g) V/P   codec: int8 error + group scales, its rollback copy
                                       (error_after_skip 'rollback'; 'reset', auto on a GPU: 1 (1 + 4/g))
                        2 (b/8 + 4/g) V/P min(c, 3)/c   codec: send and receive rows of
                                       piece 0 and of two slots the later pieces take in turn
                                       (stochastic rounding keeps every piece: not modelled)
                        (1 + 1/N)(b/8 + 4/g) V/P min(c, 2)/c   b-bit parameter deltas: send and
                                       receive rows of two slots the pieces take in turn, each piece
                                       added as it arrives (into a kept buffer of its own, e_g < e
                                       and not two-level: every piece's rows until all are in)
                        2w/(N c), 2w/c  a cast gather in pieces or to another dtype (one piece in
                                       the held dtype goes straight into the gathered buffer)
                        (4 + e)/G + e/M   two-level: the node's level (engine/parallel/two_level.py)
                        8 to 16 per value of a piece   a round's temporaries; a piece is at most
                                       MAX_PIECE_VALUES values of all ranks, so on a large model
                                       the cast buffers and the temporaries are constants
                      optimizer_offload='cpu': the 12/N of the state, its 12/N spare, the host copy
                                       of the reduced gradient and the fused kernel's scratch (4/N each) are
                                       host bytes (``host``, per GPU: 32/N with AdamW), ACCO's kept half too
                                       (4/N); the device keeps min(c, 3) fp32 staging slots a piece long
                                       (ACCO: one more, OFFLOAD_PIECE long), and no optimizer temporaries
    sharded, model sharded over the node (model_sharding="node", FSDP2 on the node's G ranks):
                      ``node_sharded_bytes``: the flat formula over the M nodes of a rail on the
                      rank's local buffer (V = P/G values): e/G parameters (FSDP2's local shards),
                      e/G for the gradient, into which the round then gathers the new parameters
                      (an overlapping strategy: 2e/G gradients, compute accumulating into one while
                      the round reads the other and gathers into it: 3e/G), the optimizer's 24/N + 4/N per
                      kept shard with N = G x M (step_copy 'piece': 12/N and the scratch), the
                      codec's error on the 1/G, the rail's buffers;
                      plus FSDP2's unsharded block (the one in use and the one prefetched), 2 e P/L
    whole             the compressed stage after the variance is frozen, on the V values a worker keeps
                      (P flat; its P/G slice two-level or its local shards under node sharding) and
                      its shard of them, V/W (W workers: the ranks flat, the nodes else): compute
                      parameters and their gathered copy 2e (FSDP2's local shards: e V and its blocks),
                      gradient buffers 2e_g (node sharded: one, e V), and ``whole_state``: momentum,
                      frozen denominator and worker error 12, the mask 1, the round's kept buffers 12
                      (the message/decoded momentum, the proposed master and worker error), an fp32
                      master 4 unless the parameters are it (e = 4), server error and its proposal
                      8/W; a round's temporaries: 2 + 1/W sets of 1-bit rows ((1/8 + s/g) V each) and
                      WHOLE_PIECE_TEMP per value of a piece, min(V/W, the spec's ``piece``); two-level
                      without node sharding, the node's level too: (4 + e) V and NCCL's fp32 piece
    local             2e + 2e_g + 24 (full-size inner AdamW state, theta_sync, s_w, momentum / error);
                      two-level: the node's G ranks shard all of it but the compute buffers: 2e + 2e_g + 24/G;
                      model sharded over the node: (2e + 12 + 12 + OUTER_TEMP)/G and FSDP2's blocks
                      (``local_node_sharded``); the outer state on the CPU: (2e + 12)/G on the device,
                      12/G and piece-sized round temporaries (a top-k round: and its payloads) on the host;
                      the inner state on the CPU too (optimizer_offload='cpu'): 2e/G on the device,
                      12/G of the inner state and its gradient's host copy in piece slots in host memory
                      (a flat replica's: 4, whole: its norm is taken on the host)
    replica           e + e + 2e_g + 8/N flat (parameters, the replica's own copy, two gradient buffers, the
                      engine's unread SGD shard state) and the step's e temporary; under node sharding
                      on the local shards, one gradient buffer, 8/M (``replica``)
Frozen parameters: e each (a copy in the compute dtype); 1/G of that under node sharding."""

from __future__ import annotations

import math
from dataclasses import dataclass

from acco_loco.topk_codec import TopKCodec
from engine.parallel.topology import Layout
from engine.runtime.offload import OFFLOAD_PIECE
from engine.strategies.spec import MemorySpec, WireSettings, resolve_error_after_skip, resolve_step_copy

from .modes import Mode
from .shape import ModelShape
from .sharded_bytes import MAX_PIECE_VALUES, held_bytes, node_sharded_bytes

INNER_PIECE = 1 << 20  # engine/strategies/inner_step.py's PIECE: a local step's fp32 piece scratch (min(V, it))


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    codec_state: float  # error feedback, local-step state, 1-bit Adam's whole buffers
    buffers: float = 0.0  # comm-side kept buffers, the two-level node's buffers, a round's temporaries
    host: float = 0.0  # host memory, not in ``total``: an offloaded optimizer's state (optimizer_offload='cpu')

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.codec_state + self.buffers


def fsdp_block_bytes(shape: ModelShape, compute_bytes: int) -> float:
    """FSDP2's unsharded parameters while compute runs: the block in use and the one prefetched."""
    return 2 * compute_bytes * shape.params / shape.layers


def replicated(spec: MemorySpec, mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    pt, frozen = shape.trainable, shape.params - shape.trainable
    # Muon keeps one momentum for the hidden matrices: all but an untied embedding and head (upper bound)
    matrices = max(0, pt - 2 * shape.vocab * shape.hidden) if ws.optimizer == "muon" else 0
    return Memory(4 * pt + ws.compute_bytes * frozen, 4 * pt, 8 * pt - 4 * matrices, 0.0)


def sharded(spec: MemorySpec, mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    e, n, g = ws.compute_bytes, layout.world, layout.ranks_per_node
    pt, frozen = shape.trainable, shape.params - shape.trainable
    offload = mode.offload == "cpu"  # the state in host memory: step_copy auto is then whole (on the host)
    copy = resolve_step_copy(ws.step_copy, cuda=not offload, optimizer=ws.optimizer)  # a GPU's: memory is per GPU
    error_copy = resolve_error_after_skip(ws.error_after_skip, cuda=True) == "rollback"
    if mode.sharding == "node":
        held = node_sharded_bytes(pt / g, nodes=n // g, overlap=mode.overlap, kept_shards=spec.kept_shards,
                                  codec=mode.codec, param_codec=mode.param_codec, compute_bytes=e,
                                  group_size=ws.group_size, frozen=frozen / g, step_copy=copy, offload=offload,
                                  error_copy=error_copy)
        return Memory(held["parameters"] + held["gathered"] + fsdp_block_bytes(shape, e), held["gradients"],
                      held["optimizer"] + held["strategy"], held["error_feedback"], held["comm"] + held["temporaries"],
                      held.get("host", 0.0))
    held = held_bytes(pt, world=n, per_node=g, two_level=mode.exchange == "two-level", kept_shards=spec.kept_shards,
                      codec=mode.codec, param_codec=mode.param_codec, compute_bytes=e, group_size=ws.group_size,
                      frozen=frozen, grad_bytes=ws.grad_bytes(mode), step_copy=copy, offload=offload,
                      error_copy=error_copy)
    return Memory(held["parameters"] + held["gathered"], held["gradients"], held["optimizer"] + held["strategy"],
                  held["error_feedback"], held["comm"] + held["temporaries"], held.get("host", 0.0))


# a frozen-variance round's largest temporaries per value of a piece, the owner's (measured on the torch
# path by tests/engine/test_memory_accounting_local.py: 10.16 at 2 x 2 fp32 and 1 x 4 bf16): its fp32 sum of
# the received rows 4, the sign x RMS encode's codes and their packing 2.16 and its decoded values 4
WHOLE_PIECE_TEMP = 10.16


def whole_state(spec: MemorySpec, values: float, workers: int, ws: WireSettings) -> tuple[float, float]:
    """(state, a round's largest temporaries) of the compressed stage after the freeze, bytes for a
    worker that keeps ``values`` values, one of ``workers`` (engine/strategies' frozen-variance mode:
    its state whole, its shard's server error)."""
    v, w = values, workers
    state = 12 * v + v + 12 * v + (0 if ws.compute_bytes == 4 else 4 * v) + 8 * v / w
    row = 1 / 8 + (4 if ws.scale_dtype == "float32" else 2) / ws.group_size  # 1-bit codes and group scales
    piece = min(v / w, spec.piece) if spec.piece else v / w
    return state, (2 + 1 / w) * row * v + WHOLE_PIECE_TEMP * piece


def whole(spec: MemorySpec, mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    e, g = ws.compute_bytes, layout.ranks_per_node
    pt, frozen = shape.trainable, shape.params - shape.trainable
    if mode.exchange == "two-level":  # a node is one worker; each rank keeps its 1/G of the state
        state, temps = whole_state(spec, pt / g, layout.nodes, ws)
        if mode.sharding != "node":  # the node's level, kept: the node's fp32 sum of the slice, NCCL's fp32
            # piece of its reduce-scatter (as held_bytes' two-level), the warmup gatherer's copy of the slice
            part = pt / layout.nodes
            cn = max(1, math.ceil(part / MAX_PIECE_VALUES))
            state += (4 + e) * pt / g + (4 * part / cn if ws.grad_bytes(mode) != 4 or cn > 1 else 0.0)
    else:
        state, temps = whole_state(spec, pt, layout.world, ws)
    if mode.sharding == "node":  # e/G parameters, e/G gathered, one e/G gradient buffer, FSDP2's blocks
        return Memory(2 * e * pt / g + e * frozen / g + fsdp_block_bytes(shape, e), e * pt / g, 0.0, state, temps)
    return Memory(2 * e * pt + e * frozen, 2 * ws.grad_bytes(mode) * pt, 0.0, state, temps)


# an outer round's temporaries per value of the outer state, by the round's kind (its spec's
# ``outer_cost``), measured on the torch path by tests/engine/test_local_steps_sharded.py (2 x 2, fp32):
# the pseudo-gradient, the exchange's rows and result and the outer step's proposal (momentum SGD: one
# piece covers that model; at scale the proposal is piece-sized);
# the error's encode and decode (error feedback + top-k). And whether the exchange's wire rows are
# as long as the outer state on the device with the state on the CPU: neither (an averaging
# all-to-all runs then in column pieces of 4M values; top-k payloads are a few percent of the values)
OUTER_TEMP = {"outer_sgd_s_per_param": (20.0, False), "outer_topk_s_per_param": (36.25, False)}
# with the outer state on the CPU, a round that runs there in pieces (momentum SGD's: the pseudo-gradient written
# over the snapshot, the average over it a column piece at a time, the outer step proposed a piece at a
# time; its strategy's outer_update): bytes per value of one piece, min(V, OUTER_PIECE) values (the wire
# rows of every rank's columns, the received rows and the gathered result; or the step's proposal and its
# intermediate), measured by tests/engine/test_outer_round_pieces.py; and the full-size bytes per value
# with outer_overlap (the pseudo-gradient then has a buffer of its own: the snapshot is merged after the round)
OUTER_PIECE = 1 << 22  # engine/strategies/outer_state.py's PIECE (DiLoCo.outer_piece, wire_piece)
# error feedback + top-k's (its strategy's outer_update, acco_loco/topk_pieces.py): Delta_w formed a piece at a time
# into the error and each piece's top-k encoding (Delta_w's piece 4, |x| 4 and its int64 keys 16; a piece of
# whole chunks: 25 B a value, and 4 more for the padded copy of a last piece that ends inside a chunk: 29 is
# the bound taken) or its combined step (11); no overlap buffer; besides the pieces, the top-k payloads: its
# own and the N gathered (topk_payload_host_bytes)
OUTER_HOST_PIECES = {"outer_sgd_s_per_param": (12.0, 4.0), "outer_topk_s_per_param": (29.0, 0.0)}
INNER_GRAD_SLOTS = 2  # engine/runtime/offload.py's GRAD_SLOTS: a node replica's gradient on the host, in pieces


def outer_piece_values(mode: Mode, values: float, ws: WireSettings) -> float:
    """Values of the largest piece of a round on host state: min(V, OUTER_PIECE); a top-k round's
    pieces are whole chunks (the last one padded to a chunk)."""
    if mode.spec.outer_cost == "outer_topk_s_per_param":
        values = math.ceil(values / ws.topk_chunk) * ws.topk_chunk
    return min(values, OUTER_PIECE)


def topk_payload_host_bytes(mode: Mode, values: float, replicas: int, ws: WireSettings) -> float:
    """A top-k round on host state: its own payload for ``values`` and the ``replicas`` gathered ones
    (each about 1% of 4 ``values`` at the defaults); 0 for a round without payloads."""
    if mode.spec.outer_cost != "outer_topk_s_per_param":
        return 0.0
    return (replicas + 1) * TopKCodec(ws.topk_chunk, ws.topk_density, ws.topk_bits).payload_bytes(math.ceil(values))


def inner_gradient_host_bytes(values: float) -> float:
    """A node replica's offloaded inner step: its gradient's host copy in GRAD_SLOTS slots of
    INNER_PIECE values (engine/runtime/offload.py ``gradient_pieces``; one slot for a single piece)."""
    return 4 * min(values, INNER_PIECE) * min(INNER_GRAD_SLOTS, math.ceil(values / INNER_PIECE))


def local(spec: MemorySpec, mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    e = ws.compute_bytes
    pt, frozen = shape.trainable, shape.params - shape.trainable
    if mode.sharding == "node":
        return local_node_sharded(mode, shape, layout, ws)
    share = layout.ranks_per_node if mode.exchange == "two-level" else 1
    scratch = 4 * min(pt / share, INNER_PIECE)  # the inner step's piece scratch
    if mode.offload == "cpu":  # the inner state and the gradient's host copy in host memory (a node replica's:
        # piece slots); a node replica's new slice goes to the device for the node's gather (a slice-sized temporary)
        grad_copy = inner_gradient_host_bytes(pt / share) if share > 1 else 4 * pt
        return Memory(2 * e * pt + e * frozen, 2 * ws.grad_bytes(mode) * pt, 0.0, 12 * pt / share,
                      4 * pt / share if share > 1 else 0.0, host=12 * pt / share + grad_copy + scratch)
    return Memory(2 * e * pt + e * frozen, 2 * ws.grad_bytes(mode) * pt, 12 * pt / share + scratch, 12 * pt / share)


def local_node_sharded(mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    """A local-step strategy on a model sharded over the node (engine/strategies/local_steps.py):
    per rank, V = P/G values, its FSDP2 local shards: e V parameters and one gradient buffer of e V
    (FSDP2's unsharded blocks besides), the inner AdamW state 12 V and its step's piece scratch
    (4 min(V, INNER_PIECE)), the outer state 12 V
    (theta_sync, the submitted snapshot, momentum or error) and an outer round's temporaries
    (OUTER_TEMP V). With the outer state on the CPU (outer_state_device='cpu') those two are host
    bytes; the device keeps a piece of the exchange's wire rows (an averaging all-to-all runs in
    pieces then; top-k payloads are a few percent of V); the round there makes piece-sized
    temporaries only (OUTER_HOST_PIECES: momentum SGD 12 min(V, 2^22), + 4 V with outer_overlap; top-k
    29 bytes a value of a piece of whole chunks and its payloads, topk_payload_host_bytes). With the inner
    state on the CPU (optimizer_offload='cpu', engine/runtime/offload.py) its 12 V and the gradient's
    host copy (two slots of min(V, 2^20) values) are host bytes; the device keeps no inner state
    (the new parameters go into FSDP2's local shards from the host, a parameter at a time)."""
    e, g = ws.compute_bytes, layout.ranks_per_node
    v, frozen = shape.trainable / g, (shape.params - shape.trainable) / g
    per_value, whole_rows = OUTER_TEMP.get(mode.spec.outer_cost, max(OUTER_TEMP.values()))
    outer, temps, host = 12 * v, per_value * v, 0.0
    if mode.outer_state == "cpu":
        pieces = OUTER_HOST_PIECES.get(mode.spec.outer_cost)
        if pieces is not None:
            piece_bytes, overlap_bytes = pieces
            temps = (piece_bytes * outer_piece_values(mode, v, ws) + (overlap_bytes * v if mode.outer_overlap else 0.0)
                     + topk_payload_host_bytes(mode, v, layout.nodes, ws))
        host, outer = outer + temps, 0.0
        temps = 2 * ws.pseudo_grad_bytes * v if whole_rows else 0.0
    inner = 12 * v + 4 * min(v, INNER_PIECE)  # the inner state and its step's piece scratch
    if mode.offload == "cpu":
        host, inner = host + inner + inner_gradient_host_bytes(v), 0.0
    return Memory(e * v + e * frozen + fsdp_block_bytes(shape, e), e * v, inner, outer, temps, host)


def replica(spec: MemorySpec, mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    """Every replica steps its own parameters with stateless SGD and averages them every few steps:
    per rank, on the V values it steps (P flat; its FSDP2 local shards, P/G, under node sharding), the
    compute parameters e V (FSDP2's blocks besides) and the replica's own copy e V, the gradient
    buffers (one of e V under node sharding; two flat), the step's temporary e V (the gradient over
    its count), and the engine's shard optimizer state, which the mode never reads: an SGD master and
    momentum buffer of the owned shard, 8 V/W (W ranks share V: the rail's M, or N flat). With the
    copy in host memory (optimizer_offload='cpu', engine/runtime/offload.py ``HostParams``) its e V,
    the gradient's host piece and the step's piece, e min(V, OFFLOAD_PIECE) each, are host bytes
    (NCCL's device piece of the average, as long, is left out as piece-sized)."""
    e, g = ws.compute_bytes, layout.ranks_per_node
    if mode.sharding == "node":
        v, frozen, owners = shape.trainable / g, (shape.params - shape.trainable) / g, layout.nodes
        params, grads = e * v + e * frozen + fsdp_block_bytes(shape, e), e * v
    else:
        v, frozen, owners = shape.trainable, shape.params - shape.trainable, layout.world
        params, grads = e * v + e * frozen, 2 * ws.grad_bytes(mode) * v
    unread = 8 * v / owners
    if mode.offload == "cpu":
        return Memory(params, grads, unread, 0.0, 0.0, host=e * v + 2 * e * min(v, OFFLOAD_PIECE))
    return Memory(params + e * v, grads, unread, 0.0, e * v)


FORMULAS = {"replicated": replicated, "sharded": sharded, "whole": whole, "local": local, "replica": replica}
REFERENCE = MemorySpec("replicated")  # torch DDP, the planner's reference


def memory_per_gpu(mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings | None = None) -> Memory:
    spec = REFERENCE if mode.is_ddp else mode.spec.memory
    if spec.state not in FORMULAS:
        raise ValueError(f"memory formula {spec.state!r} of {mode.strategy!r}: choose one of {sorted(FORMULAS)}")
    return FORMULAS[spec.state](spec, mode, shape, layout, ws or WireSettings())
