"""Where each parameter sits in the flat buffer when some must stay whole on one owner.

The sharded optimizer cuts the padded flat buffer into N equal shards of S values, rank r owning
``[r S, (r + 1) S)``. Muon (acco_loco/muon.py) steps a matrix whole, so a matrix must not cross a
shard boundary. ``place`` packs the buffer region by region: into what is left of region r the
largest matrix that still fits, else the next splittable parameter in model order (embeddings,
the head, 1-D parameters: elementwise optimizers step any cut of them, so they may run across a
boundary), else padding to the boundary. S starts at the smallest multiple of ``unit`` that holds
every value and grows until the packing fits in N regions, so with enough splittable values
the padding is what an ordinary layout has. The collectives keep their equal shards: only the
order of the parameters and where the padding falls change. No torch here."""

from __future__ import annotations


def place(sizes: list[int], whole: list[bool], world: int, unit: int) -> tuple[list[int], int]:
    """(each parameter's offset, the shard size S): no parameter marked ``whole`` crosses a
    multiple of S; S is a multiple of ``unit``; every value fits in ``world`` shards."""
    if len(sizes) != len(whole):
        raise ValueError(f"{len(sizes)} sizes but {len(whole)} whole flags")
    total = sum(sizes)
    shard = max(unit, -(-total // (world * unit)) * unit)
    while True:
        offsets = _pack(sizes, whole, world, shard)
        if offsets is not None:
            return offsets, shard
        shard += unit * max(1, shard // (64 * unit))  # about 1.5% more a try


def _pack(sizes: list[int], whole: list[bool], world: int, shard: int) -> list[int] | None:
    pending = sorted((i for i, w in enumerate(whole) if w), key=lambda i: (-sizes[i], i))
    if any(sizes[i] > shard for i in pending):
        return None
    splittable = [i for i, w in enumerate(whole) if not w]
    offsets: list[int] = [-1] * len(sizes)
    pos, next_split = 0, 0
    for region in range(world):
        end = (region + 1) * shard
        while pos < end:
            fit = next((i for i in pending if sizes[i] <= end - pos), None)
            if fit is not None:
                offsets[fit], pos = pos, pos + sizes[fit]
                pending.remove(fit)
            elif next_split < len(splittable):
                i = splittable[next_split]
                offsets[i], pos, next_split = pos, pos + sizes[i], next_split + 1
            else:
                pos = end
    if pending or next_split < len(splittable) or pos > world * shard:
        return None
    return offsets


def owners(sizes: list[int], ranks: int) -> list[int]:
    """Which of ``ranks`` ranks steps each matrix (``sizes``: their values): the largest first,
    each to the rank with the fewest values so far (the lowest rank on a tie), so the ranks'
    loads differ by at most one matrix. model_sharding='node' uses it for the matrices of a
    node's chunk, whose rows the node's ranks share (engine/parallel/node_matrices.py)."""
    if ranks < 1:
        raise ValueError(f"{ranks} ranks: at least one must own the matrices")
    load, out = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        out[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[out[i]] += sizes[i]
    return out
