"""Bytes one rank of a sharded strategy holds after a step, by the categories
engine/runtime/memory_accounting.py measures, and the largest set of temporaries a round makes:
``held_bytes`` (the flat and two-level layouts) and ``node_sharded_bytes`` (model_sharding='node').
engine/planner/memory.py turns them into a ``Memory`` row (its docstring: the formula, term by
term); tests/engine/test_memory_accounting*.py hold them against what a run keeps."""

from __future__ import annotations

import math

from engine.runtime.offload import OFFLOAD_PIECE

MAX_PIECE_VALUES = 1 << 24  # engine/parallel/comm.py's: a piece of all ranks' shards together
PIECE_ALIGN = 32  # engine/parallel/comm.py's: where a piece may start (with a codec: its groups too)
# a round's temporaries per value (the torch path: what a GPU runs; measured by
# tests/engine/test_memory_accounting.py): the optimizer's piece (its gradient and Adam's
# denominator), the compressed reduce-scatter's encode of one destination's piece (the
# compensated values, the rounded codes, the compression error, the re-encoded error) and its
# decode of every rank's piece at once (fp32 values, unpacked codes, the payload's copy)
OPTIMIZER_TEMP, ENCODE_TEMP, DECODE_TEMP, DELTA_TEMP = 8.0, 14.0, 7.0, 16.0


def _bits(codec: str) -> int | None:
    """The bits per value of a gradient or parameter codec name (None: uncompressed)."""
    for bits in (8, 4, 2, 1):
        if codec.endswith(str(bits)) or codec == f"int{bits}":
            return bits
    return None


def held_bytes(params: float, *, world: int, per_node: int = 1, two_level: bool = False,
               kept_shards: int = 0, codec: str = "none", param_codec: str = "auto",
               compute_bytes: int = 4, group_size: int = 128, chunks: int = 1, backend: str = "nccl",
               optimizer_state: int = 12, frozen: float = 0.0, grad_bytes: int = 4,
               step_copy: str = "whole", offload: bool = False, error_copy: bool = True) -> dict[str, float]:
    """Bytes one rank holds after a step of a sharded strategy (``kept_shards``: the fp32 shards
    it keeps between rounds) on an unsharded model, by the
    categories of engine/runtime/memory_accounting.py, plus ``temporaries``: the largest set a round
    makes (the torch path; CPU's fused kernels make fewer and keep a shard-long fp32 scratch).

    ``params``: the padded trainable values P; ``chunks``: the engine's comm_chunks (resolved);
    ``optimizer_state``: fp32 bytes per owned value (AdamW 12, SGD with momentum 8);
    ``step_copy``: where a step is proposed, resolved (``resolve_step_copy``): 'whole', a spare
    as large as the state; 'piece', min(c, 3) master slots and one slot of moments a piece long;
    ``grad_bytes``: the gradient buffers' dtype bytes (4: grad_dtype auto; the compute dtype's
    with grad_dtype='compute'), which an uncompressed gradient also travels in.
    ``offload``: optimizer_offload='cpu' (engine/runtime/offload.py): the state, its spare or
    scratch, the host copy of the reduced gradient and the fused kernel's scratch go to ``host``
    (host bytes, in no device category); ``optimizer`` keeps the device staging slots,
    min(c, 3) fp32 slots as long as the longest piece; the optimizer's temporaries are the host's."""
    p, e, n, g, ge = float(params), compute_bytes, world, group_size, grad_bytes
    nodes = world // per_node if two_level else world  # the ranks of the codec's exchange
    values = p / per_node if two_level else p  # V: what one rank's codec exchange carries
    shard = p / n
    grad_bits = None if codec == "none" else _bits(codec)
    delta_bits = _bits(param_codec) if param_codec in ("int8", "int4") else None
    wire = {"auto": e, "float32": 4, "bfloat16": 2}.get(param_codec, e)

    def pieces(total: float) -> int:  # Comm.pieces over a collective of ``total`` values
        return max(chunks, -(-int(total) // MAX_PIECE_VALUES))

    c = pieces(values)
    if step_copy not in ("whole", "piece"):
        raise ValueError(f"step_copy {step_copy!r}: 'whole' or 'piece' (resolve 'auto' first: resolve_step_copy)")
    # the state, and the spare a step is proposed into or the piece-sized scratch (ShardState.scratch):
    # a master slot per piece (three at most) and one of moments, as long as the gatherer's longest piece
    if step_copy == "whole":
        spare = optimizer_state * shard
    else:
        cut, width = _longest_piece(shard, c, math.lcm(PIECE_ALIGN, g) if delta_bits is not None else PIECE_ALIGN)
        spare = (4 * min(cut, 3) + optimizer_state - 4) * width
    out = {
        "gradients": 2 * ge * p,
        "parameters": e * p + e * frozen,
        "gathered": e * p if ge < e else 0.0,  # else into the gradient buffer just reduced
        "optimizer": optimizer_state * shard + spare,
        "error_feedback": 0.0,
        "strategy": 4 * shard * kept_shards,  # ACCO's kept estimate half
        "comm": 4 * shard,  # the reducer's fp32 output
    }
    slots = min(c, 2) / c  # two kept piece buffers reused in turn (one piece: one)
    if grad_bits is None:
        if nodes == 1:
            pass  # one rank (a node-sharded run on one node): the reduce-scatter is a copy
        elif backend == "gloo":  # all-to-all: the received rows of a piece (and, in pieces, the sent)
            out["comm"] += slots * values * ge * (2 if c > 1 else 1)
        elif ge != 4 or c > 1:  # NCCL's reduce-scatter through one fp32 piece
            out["comm"] += 4 * values / c
    else:
        row = grad_bits / 8 + 4 / g
        out["error_feedback"] = (2 if error_copy else 1) * values * (1 + 4 / g)
        out["comm"] += 2 * values * row * min(c, 3) / c  # send and receive: piece 0 and two slots in turn
    if delta_bits is None:
        if wire != 4:  # the fp32 master's piece cast to the wire dtype
            out["comm"] += slots * shard * wire
        if c > 1 or wire != e:
            out["comm"] += slots * values * wire
    else:  # engine/parallel/gatherers.py DeltaParams: streaming where the round can refill ``held``
        streaming = two_level or ge >= e
        out["comm"] += (shard + values) * (delta_bits / 8 + 4 / g) * (slots if streaming else 1.0)
    if two_level:
        # the node's level (engine/parallel/two_level.py): the node's fp32 sum of the rank's slice, the
        # slice of the held parameters, and the pieces of the node reduce-scatter, run once per
        # node's part of the gradient (P/M values: gloo's received rows; NCCL's fp32 piece unless
        # fp32); the node's all-gather writes the held buffer itself
        part = p / nodes
        cn = pieces(part)
        node = 4 * values + e * values
        if grad_bits is None and ge != 4:
            node += ge * values  # the node sum in the gradient's dtype for the rail
        node += (min(cn, 2) / cn) * part * ge * (2 if cn > 1 else 1) if backend == "gloo" else \
            (4 * part / cn if ge != 4 or cn > 1 else 0.0)
        out["comm"] += node
    piece = shard / c  # one destination's (one rank's) values of a piece
    temps = [0.0 if offload else OPTIMIZER_TEMP * piece]
    if grad_bits is not None:
        temps += [ENCODE_TEMP * piece, DECODE_TEMP * nodes * piece]
    if delta_bits is not None:
        temps.append(DELTA_TEMP * piece)
    out["temporaries"] = max(temps)
    if offload:  # the state and its proposal on the host, a piece-long staging slot per piece in flight
        cut, width = _longest_piece(shard, c, math.lcm(PIECE_ALIGN, g) if delta_bits is not None else PIECE_ALIGN)
        # + the gradient's host copy and the kernel's scratch, and ACCO's kept half (only the step reads it)
        out["host"] = out["optimizer"] + 8 * shard + out["strategy"]
        out["optimizer"] = 4 * min(cut, 3) * width
        if kept_shards:  # the kept half comes back into the commit's sum through one staging piece
            out["optimizer"] += 4 * min(shard, OFFLOAD_PIECE)
        out["strategy"] = 0.0
    return out


def _longest_piece(size: float, count: int, unit: int) -> tuple[int, float]:
    """(pieces, values of the longest) of a ``size``-long shard cut into ``count`` pieces that
    start on multiples of ``unit`` (engine/parallel/comm.py ``chunk_bounds``: the first is the longest)."""
    size = math.ceil(size)
    if size <= 0:
        return 1, 0.0
    count = max(1, min(count, -(-size // unit)))
    step = -(-size // (count * unit)) * unit
    return -(-size // step), float(min(size, step))


def node_sharded_bytes(local: float, *, nodes: int, overlap: bool, kept_shards: int = 0, codec: str = "none",
                       param_codec: str = "auto", compute_bytes: int = 4, group_size: int = 128, chunks: int = 1,
                       backend: str = "nccl", optimizer_state: int = 12, frozen: float = 0.0,
                       step_copy: str = "whole", offload: bool = False, error_copy: bool = True) -> dict[str, float]:
    """Bytes one rank of a model_sharding='node' run holds after a step (engine/parallel/sharding.py), by
    the categories of ``held_bytes``: the flat layout's formula over the rail (``nodes`` ranks) on
    the rank's local buffer (``local``: its padded local shards, about P/G), FSDP2's local shards
    in the place of the flat parameters; ``frozen``: this rank's share of the frozen values.
    Without ``overlap`` one buffer holds the gradient and then, once it is reduced, the gathered
    parameters: e per local value for both (with overlap: two gradient buffers, a round gathering
    into the one it has reduced, 2e); gradients in the compute dtype (FSDP2's, engine/core/dtypes.py). Not in it: FSDP2's
    unsharded blocks while compute runs (``fsdp_block_bytes``)."""
    out = held_bytes(local, world=nodes, kept_shards=kept_shards, codec=codec, param_codec=param_codec,
                     compute_bytes=compute_bytes, group_size=group_size, chunks=chunks, backend=backend,
                     optimizer_state=optimizer_state, frozen=frozen, grad_bytes=compute_bytes,
                     step_copy=step_copy, offload=offload, error_copy=error_copy)
    if not overlap:
        out["gradients"], out["gathered"] = compute_bytes * float(local), 0.0
    return out
