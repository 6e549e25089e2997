"""Bytes per optimizer step, per rank and per link class, from the strategies' own formulas.

A strategy's spec gives one round's bytes per rank over a flat group, by collective
(engine/strategies/spec.py): the counts are ``Comm``'s (engine/parallel/comm.py), built from the codecs'
own ``wire_bytes``, so that they match the engine's counters exactly (docs/design/wire.md,
the strategies' topic files under docs/). Here they are put on the links
they cross, the same way for every strategy.

Through one node's network link (G ranks per node, M nodes; ranks ordered node by node): a
flat all-to-all sends G (N - G) of the N (N - 1) rows across nodes, i.e. G (M-1)/M of the
payload per collective; a ring all-gather crosses each node boundary once, (N-1)/N of the
gathered buffer; a ring all-reduce likewise, 2 (N-1)/N P e (torch DDP: 2 (N-1) P e / N per rank).
Two-level (issue 22): reduce-scatter inside the node in the gradient's dtype, then each rank
sends its node's 1/G slice over its rail, the strategy's own round over M ranks: (M-1)/M of the
codec's bytes of the whole buffer per node link, and (G-1)/G P e_g and (G-1)/G P e per rank
inside the node for the two intra-node collectives (e_g: the gradient's bytes, ``grad_bytes``).
A local-step strategy's node is one replica: each inner step runs a full-precision sharded round
inside the node, the outer round goes over the rails. Model sharding over the node changes none
of it: FSDP2's intra-node collectives carry what the two-level exchange's did, the rails carry the
same slice, in the compute dtype (FSDP2's gradients: e_g = e there).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.parallel.topology import Layout
from engine.strategies.spec import ALIGN, WireSettings, padded, sharded_round_parts

from .modes import Mode

__all__ = ["ALIGN", "Layout", "StepBytes", "WireSettings", "padded", "round_rank_bytes", "step_bytes"]


@dataclass(frozen=True)
class StepBytes:
    """Bytes of one optimizer step (local-step modes: one inner step, the outer round's bytes
    divided by H; ``round_node_link`` then holds one outer round's)."""
    rank: float  # what one rank sends (Comm's count, all link classes)
    node_link: float  # through one node's network link, one direction
    intra_rank: float  # what one rank sends inside its node (two-level)
    round_node_link: float  # one round's (or one outer round's) node-link bytes
    round_intra_rank: float
    rounds: int  # rounds per step; local steps: 1 outer round per H steps


def round_rank_bytes(numel: int, world: int, mode: Mode, ws: WireSettings) -> dict:
    """One round of ``mode`` over a flat group of ``world`` ranks, per rank, by collective."""
    return mode.spec.round_parts(numel, world, mode, ws)


def flat_node_link(cross: float, parts: dict, nodes: int) -> float:
    """Through one node's link, of a flat exchange's per-rank counts: an all-to-all sends
    ``cross`` (= G (N-G)/(N-1)) of every rank's rows across; a ring all-gather ordered node by node
    crosses each node boundary once, carrying one rank's count (the testbed's node counters
    measure this: docs/nodes.md, benchmarks/node_bytes.py)."""
    return cross * (parts["all_to_all"] + parts["small"]) + (parts["all_gather"] if nodes > 1 else 0.0)


def _ddp(numel: int, layout: Layout, mode: Mode) -> StepBytes:
    n, m, g = layout.world, layout.nodes, layout.ranks_per_node
    de = 2 if mode.ddp_dtype == "bfloat16" else 4
    rank = 2 * (n - 1) * numel * de // n if n > 1 else 0
    # a ring ordered node by node crosses each node boundary once: the node's link carries one
    # rank's ring traffic; inside the node the other G-1 edges carry the same
    node = rank if m > 1 else 0
    return StepBytes(rank, node, rank if g > 1 else 0, node, rank if g > 1 else 0, 1)


def node_round_bytes(numel: int, g: int, mode: Mode, ws: WireSettings) -> float:
    """What one rank sends inside its node per round of a two-level exchange: a sharded
    strategy's reduce-scatter in the gradient's dtype and all-gather at compute precision; a
    local-step strategy's inner step, a full-precision sharded round over the node (with its
    small all-reduce)."""
    if mode.local_steps:
        return sum(sharded_round_parts(numel, g, Mode(mode.strategy), ws).values())
    return (g - 1) * (padded(numel, g, ALIGN) // g) * (ws.grad_bytes(mode) + ws.compute_bytes)


def step_bytes(numel: int, layout: Layout, mode: Mode, ws: WireSettings,
               ddp_numel: int | None = None) -> StepBytes:
    """Bytes of one optimizer step of ``mode`` on ``layout`` (``numel`` trainable parameters;
    ``ddp_numel`` the gradient DDP reduces, the same unless stated)."""
    if mode.is_ddp:
        return _ddp(ddp_numel or numel, layout, mode)
    m, g, n = layout.nodes, layout.ranks_per_node, layout.world
    period = mode.inner_steps if mode.local_steps else 1  # optimizer steps per round
    rounds = mode.rounds
    if mode.exchange == "flat" or g == 1:
        cross = g * (n - g) / (n - 1) if n > 1 else 0.0  # node-link share of a flat collective's rank bytes
        parts = round_rank_bytes(numel, n, mode, ws)
        rank, node = sum(parts.values()), flat_node_link(cross, parts, m)
        return StepBytes(rounds * rank / period, rounds * node / period, 0.0, node, 0.0, rounds)
    intra = node_round_bytes(numel, g, mode, ws)
    rail = sum(round_rank_bytes(-(-numel // g), m, mode, ws).values()) if m > 1 else 0
    if mode.local_steps:  # an intra-node round every inner step, a rail round every H
        return StepBytes(rail / period + intra, g * rail / period, intra, g * rail, intra, rounds)
    return StepBytes(rounds * (rail + intra), rounds * g * rail, rounds * intra, g * rail, intra, rounds)
