"""Bytes through one node's network link per optimizer step, by formula (docs/testbed.md).

M nodes of G ranks (N = M x G, ranks numbered node by node as torchrun numbers them), one link
per node; S = the fp32 gradient's bytes (4 x parameters). What crosses a node's link is what its
ranks send to ranks of other nodes; traffic inside a node never touches it. The collectives as
gloo (and NCCL) run them:

* ring all-reduce of X bytes: a ring through the ranks in order has one edge leaving each
  node, and every edge carries 2 (N - 1) / N x X;
* ring all-gather of X bytes in all (each rank holds X / N): the edge out of a node carries
  (N - 1) / N x X;
* all-to-all of X bytes per rank (the engine's reduce-scatter: ``all_to_all_single`` + a local
  sum): each rank sends X / N to each of the G (M - 1) ranks on other nodes, so the node's G
  ranks send G (M - 1) / M x X through its link.

Two-level (issue 22): the node first reduces inside itself at full precision, then each of its
G ranks runs the compressed exchange of its 1/G slice over its "rail" (the M ranks with its
local rank, one per node); each rail's ring or all-to-all has M ranks, so G rails put
(M - 1) / M x X through the node's link for an exchange of X bytes of the whole vector.

Codec ratios r (wire bytes over fp32 bytes) come from the codecs' own sizes: a b-bit group codec
with one fp32 scale per ``group`` values sends (b / 8 + 4 / group) / 4 of fp32's bytes
(loco4 / int4 at group 128: 0.1328; 1-bit Adam's sign1: 0.0391); SparseLoCo's top-k sends, per
chunk of C values, k = ceil(density x C) values of ``value_bits`` bits with ceil(log2 C)-bit
indices and 8 bytes of scales.

Not counted: TCP/IP headers and ACKs, gloo's message headers, the engine's small per-round
all-reduces (loss, counts, norms), the start-up broadcast. On the testbed the node link's
counter over the training window is 0.5-1.5% above these formulas for large messages (DDP,
zero1) and ~9% above for ACCO's chunked compressed exchange at 2 x 2 (many small messages).
"""

from __future__ import annotations

import math

from engine.parallel.topology import Layout

FP32 = 4


def group_codec_ratio(bits: int, group: int = 128, scale_bytes: int = 4) -> float:
    """Wire bytes over fp32 bytes of a ``bits``-bit codec with one scale per ``group`` values."""
    return (bits / 8 + scale_bytes / group) / FP32


def topk_ratio(density: float = 0.02, chunk: int = 4096, value_bits: int = 2) -> float:
    """SparseLoCo's chunked top-k payload over fp32 bytes (acco_loco/topk_codec.py's sizes)."""
    k = min(chunk, max(1, math.ceil(density * chunk - 1e-9)))
    index_bits = (chunk - 1).bit_length()
    return (k * (index_bits + value_bits) / 8 + 8) / (chunk * FP32)


R_LOCO4 = group_codec_ratio(4)  # loco4 gradients, int4 parameter deltas
R_SIGN1 = group_codec_ratio(1)  # 1-bit Adam's momentum, both ways
R_TOPK = topk_ratio()


# each: bytes through one node's link (as a multiple of the exchange's size X = 1), on the one
# Layout (engine/parallel/topology.py: M nodes of G ranks)
def ring_all_reduce(lay: Layout) -> float:
    n = lay.world
    return 2 * (n - 1) / n if lay.nodes > 1 else 0.0


def ring_all_gather(lay: Layout) -> float:
    n = lay.world
    return (n - 1) / n if lay.nodes > 1 else 0.0


def all_to_all(lay: Layout) -> float:
    return lay.ranks_per_node * (lay.nodes - 1) / lay.nodes


def rail(lay: Layout) -> float:
    """A two-level exchange's ring all-gather or all-to-all over the rails (X: the whole vector)."""
    return (lay.nodes - 1) / lay.nodes


def sharded(layout: Layout, r_grad: float, r_param: float, rounds: int, topology: str) -> float:
    """zero1 / acco / 1-bit Adam: per round a reduce-scatter (all-to-all) of the gradient at
    ``r_grad`` and an all-gather of the parameters at ``r_param``; per step ``rounds`` rounds."""
    if topology == "flat":
        per_round = all_to_all(layout) * r_grad + ring_all_gather(layout) * r_param
    elif topology == "two_level":
        per_round = rail(layout) * (r_grad + r_param)
    else:
        raise ValueError(f"topology {topology!r}: 'flat' or 'two_level'")
    return rounds * per_round


def sparseloco(layout: Layout, topology: str, inner_steps: int = 15, r: float = R_TOPK) -> float:
    """Per inner step: every ``inner_steps`` an all-gather of every replica's top-k payload.
    flat: N replicas, each payload the whole vector's; two-level: M node replicas, each rank
    carrying its 1/G slice's payload over its rail."""
    if topology == "flat":
        per_round = (layout.world - 1) * r if layout.nodes > 1 else 0.0
    elif topology == "two_level":
        per_round = (layout.nodes - 1) * r
    else:
        raise ValueError(f"topology {topology!r}: 'flat' or 'two_level'")
    return per_round / inner_steps


# name -> bytes through one node's link per optimizer step, over S
FORMULAS = {
    "torch-ddp fp32": lambda lay: ring_all_reduce(lay),
    "torch-ddp bf16": lambda lay: ring_all_reduce(lay) / 2,
    "zero1@flat": lambda lay: sharded(lay, 1.0, 1.0, 1, "flat"),
    "zero1@two_level": lambda lay: sharded(lay, 1.0, 1.0, 1, "two_level"),
    "acco+loco4+int4params@flat": lambda lay: sharded(lay, R_LOCO4, R_LOCO4, 2, "flat"),
    "acco+loco4+int4params@two_level": lambda lay: sharded(lay, R_LOCO4, R_LOCO4, 2, "two_level"),
    "onebit-adam@flat (after freeze)": lambda lay: sharded(lay, R_SIGN1, R_SIGN1, 1, "flat"),
    "onebit-adam@two_level (after freeze)": lambda lay: sharded(lay, R_SIGN1, R_SIGN1, 1, "two_level"),
    "sparseloco-h15@flat": lambda lay: sparseloco(lay, "flat"),
    "sparseloco-h15@two_level": lambda lay: sparseloco(lay, "two_level"),
}


def node_link_bytes_over_s(name: str, nodes: int, ranks_per_node: int) -> float:
    """Bytes through one node's link per optimizer step (inner step for sparseloco), over S."""
    if name not in FORMULAS:
        raise KeyError(f"no formula for {name!r}: choose from {', '.join(FORMULAS)}")
    return FORMULAS[name](Layout(nodes, ranks_per_node))


def table(ranks_per_node: int = 8, nodes: tuple[int, ...] = (2, 8, 64)) -> list[dict]:
    """One row per formula: {"name", "M=2": x S, ...} (the table in docs/nodes.md)."""
    return [{"name": name, **{f"M={m}": node_link_bytes_over_s(name, m, ranks_per_node) for m in nodes}}
            for name in FORMULAS]


def markdown(ranks_per_node: int = 8, nodes: tuple[int, ...] = (2, 8, 64)) -> str:
    head = f"| per step, x S (G = {ranks_per_node}) | " + " | ".join(f"M = {m}" for m in nodes) + " |"
    lines = [head, "|---" * (len(nodes) + 1) + "|"]
    for row in table(ranks_per_node, nodes):
        lines.append(f"| {row['name']} | " + " | ".join(f"{row[f'M={m}']:.3g}" for m in nodes) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
