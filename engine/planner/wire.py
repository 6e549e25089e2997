"""Bytes per optimizer step, per rank and per link class, from the engine's own formulas.

Flat exchange (what the engine runs today): the counts are ``Comm``'s (engine/comm.py), built
from the codecs' own ``wire_bytes`` so that they match the engine's counters exactly
(docs/DESIGN.md sections 2.2, 3.2, 8.6, 9.4). Per rank, N ranks, S = P/N (P padded):

    reduce-scatter   (N-1) S e                          uncompressed (e: compute dtype bytes)
                     (N-1) (wire_bytes(S) + 4)          compressed, + the 4-byte count weight
    all-gather       (N-1) S e_p  |  (N-1) wire_bytes(S) (int8/int4 deltas)
    small all-reduce 2 (N-1) 8 (4 + 3N) // N
    torch DDP        2 (N-1) P e / N                    (ring all-reduce, P unpadded)

Through one node's network link (G ranks per node, M nodes; ranks ordered node by node): a
flat all-to-all sends G (N - G) of the N (N - 1) rows across nodes, i.e. G (M-1)/M of the
payload per collective; a ring all-gather crosses each node boundary once, (N-1)/N of the
gathered buffer; a ring all-reduce likewise, 2 (N-1)/N P e.
Two-level (issue 22): reduce-scatter inside the node at compute precision, then each rank
sends its node's 1/G slice over its rail: (M-1)/M of the codec's bytes of the whole buffer per
node link, and (G-1)/G P e per rank inside the node for each of the two intra-node collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from acco_loco.registry import WIRE_CODECS
from acco_loco.topk_codec import TopKCodec

from .modes import Mode

ALIGN = 128  # EngineConfig.align


@dataclass(frozen=True)
class Layout:
    nodes: int  # M
    per_node: int = 1  # G

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class WireSettings:
    compute_bytes: int = 4  # 4 = fp32, 2 = bf16
    group_size: int = 128
    scale_dtype: str = "float32"
    topk_density: float = 0.02
    topk_chunk: int = 4096
    topk_bits: int = 2
    pseudo_grad_bytes: int = 4  # diloco pseudo_grad_dtype


@dataclass(frozen=True)
class StepBytes:
    """Bytes of one optimizer step (local-step modes: one inner step, the outer round's bytes
    divided by H; ``round_bytes`` then holds one outer round's)."""
    rank: float  # what one rank sends (Comm's count, all link classes)
    node_link: float  # through one node's network link, one direction
    intra_rank: float  # what one rank sends inside its node (two-level)
    round_node_link: float  # one round's (or one outer round's) node-link bytes
    round_intra_rank: float
    rounds: int  # rounds per step (acco 2); local steps: 1 outer round per H steps


def padded(numel: int, world: int, unit: int) -> int:
    step = world * unit
    return -(-numel // step) * step


def _param_bytes(param_codec: str, compute_bytes: int) -> int | None:
    return {"auto": compute_bytes, "float32": 4, "bfloat16": 2}.get(param_codec)


def _wire(name: str, ws: WireSettings):
    return WIRE_CODECS[name](ws.group_size, ws.scale_dtype)


def sharded_round_rank_bytes(numel: int, world: int, mode: Mode, ws: WireSettings) -> dict:
    """One zero1/dpu/acco round of a flat exchange over ``world`` ranks, per rank (Comm's
    count): {'reduce_scatter', 'all_gather', 'small'}."""
    codec_on = mode.codec != "none" or mode.param_codec in ("int8", "int4")
    p = padded(numel, world, math.lcm(ALIGN, ws.group_size) if codec_on else ALIGN)
    s = p // world
    if mode.codec == "none":
        rs = (world - 1) * s * ws.compute_bytes
    else:
        from acco_loco.registry import parse_grad_codec
        rs = (world - 1) * (parse_grad_codec(mode.codec).make_wire(ws.group_size, ws.scale_dtype).wire_bytes(s) + 4)
    cast = _param_bytes(mode.param_codec, ws.compute_bytes)
    ag = (world - 1) * (s * cast if cast is not None else _wire(mode.param_codec, ws).wire_bytes(s))
    small = 2 * (world - 1) * 8 * (4 + 3 * world) // world
    return {"reduce_scatter": rs, "all_gather": ag, "small": small, "padded": p}


def onebit_step_rank_bytes(numel: int, world: int, ws: WireSettings) -> int:
    """engine.strategies.onebit_adam.compressed_step_bytes, on the padded buffer."""
    p = padded(numel, world, math.lcm(ALIGN, ws.group_size))
    row = _wire("sign1", ws).wire_bytes(p // world)
    return 2 * (world - 1) * row + 2 * (world - 1) * (4 + 3 * world) * 8 // world


def outer_round_parts(numel: int, world: int, mode: Mode, ws: WireSettings) -> dict:
    """One diloco / sparseloco outer round (docs/DESIGN.md section 8.6), per rank (Comm's count):
    {'all_to_all', 'all_gather', 'small'}."""
    p = padded(numel, world, ALIGN)
    small = 2 * (world - 1) * 8 * (2 + 4 * world) // world
    if mode.strategy == "diloco":
        half = (world - 1) * (p // world) * ws.pseudo_grad_bytes
        return {"all_to_all": half, "all_gather": half, "small": small}
    codec = TopKCodec(ws.topk_chunk, ws.topk_density, ws.topk_bits)
    return {"all_to_all": 0, "all_gather": (world - 1) * codec.payload_bytes(p), "small": small}


def outer_round_rank_bytes(numel: int, world: int, mode: Mode, ws: WireSettings) -> int:
    return sum(outer_round_parts(numel, world, mode, ws).values())


def flat_node_link(cross: float, all_to_all: float, all_gather: float, small: float, nodes: int) -> float:
    """Through one node's link, of a flat exchange's per-rank counts: an all-to-all sends
    ``cross`` (= G (N-G)/(N-1)) of every rank's rows across; a ring all-gather ordered node by node
    crosses each node boundary once, carrying one rank's count (the testbed's node counters
    measure this: README "Nodes", benchmarks/node_bytes.py)."""
    return cross * (all_to_all + small) + (all_gather if nodes > 1 else 0.0)


def step_bytes(numel: int, layout: Layout, mode: Mode, ws: WireSettings,
               ddp_numel: int | None = None) -> StepBytes:
    """Bytes of one optimizer step of ``mode`` on ``layout`` (``numel`` trainable parameters;
    ``ddp_numel`` the gradient DDP reduces, the same unless stated)."""
    m, g, n = layout.nodes, layout.per_node, layout.world
    e = ws.compute_bytes
    if mode.is_ddp:
        de = 2 if mode.ddp_dtype == "bfloat16" else 4
        rank = 2 * (n - 1) * (ddp_numel or numel) * de // n if n > 1 else 0
        # a ring ordered node by node crosses each node boundary once: the node's link carries one
        # rank's ring traffic; inside the node the other G-1 edges carry the same
        node = rank if m > 1 else 0
        return StepBytes(rank, node, rank if g > 1 else 0, node, rank if g > 1 else 0, 1)
    cross = g * (n - g) / (n - 1) if n > 1 else 0.0  # node-link share of a flat collective's rank bytes
    if mode.local_steps:
        h = mode.inner_steps
        if mode.exchange == "flat" or g == 1:
            o = outer_round_parts(numel, n, mode, ws)
            r, node = sum(o.values()), flat_node_link(cross, o["all_to_all"], o["all_gather"], o["small"], m)
            return StepBytes(r / h, node / h, 0.0, node, 0.0, 1)
        # two-level: the node is one replica; inner steps run a full-precision zero1 round inside
        # the node; the outer round crosses nodes on rails (each rank its 1/G slice)
        inner = sharded_round_rank_bytes(numel, g, Mode("zero1"), ws)
        inner_rank = inner["reduce_scatter"] + inner["all_gather"] + inner["small"]
        rail = outer_round_rank_bytes(-(-numel // g), m, mode, ws)
        return StepBytes(rail / h + inner_rank, g * rail / h, inner_rank, g * rail, inner_rank, 1)
    if mode.strategy == "onebit_adam":
        if mode.exchange == "flat" or g == 1:
            r = onebit_step_rank_bytes(numel, n, ws)
            small = 2 * (n - 1) * (4 + 3 * n) * 8 // n
            node = flat_node_link(cross, (r - small) / 2, (r - small) / 2, small, m)  # rows out, then gathered
            return StepBytes(r, node, 0.0, node, 0.0, 1)
        intra = 2 * (g - 1) * (padded(numel, g, ALIGN) // g) * e
        rail = onebit_step_rank_bytes(-(-numel // g), m, ws)
        return StepBytes(rail + intra, g * rail, intra, g * rail, intra, 1)
    rounds = mode.rounds
    if mode.exchange == "flat" or g == 1:
        b = sharded_round_rank_bytes(numel, n, mode, ws)
        r = b["reduce_scatter"] + b["all_gather"] + b["small"]
        node = flat_node_link(cross, b["reduce_scatter"], b["all_gather"], b["small"], m)
        return StepBytes(rounds * r, rounds * node, 0.0, node, 0.0, rounds)
    # two-level: intra-node reduce-scatter and all-gather at compute precision ((G-1)/G P e each),
    # the rails carry the codec's bytes of the node's 1/G slice over M nodes
    intra = 2 * (g - 1) * (padded(numel, g, ALIGN) // g) * e
    rail_b = sharded_round_rank_bytes(-(-numel // g), m, mode, ws) if m > 1 else None
    rail = rail_b["reduce_scatter"] + rail_b["all_gather"] + rail_b["small"] if rail_b else 0
    return StepBytes(rounds * (rail + intra), rounds * g * rail, rounds * intra, g * rail, intra, rounds)
