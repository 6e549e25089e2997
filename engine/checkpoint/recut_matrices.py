"""Re-cut under optimizer='muon': each parameter's place in the flat buffer depends on the world size.

Muon steps a hidden matrix whole, so the flat buffer keeps every such matrix inside one shard and
packs the others around them (acco_loco/matrix_layout.py ``place``): with N workers a parameter sits
at another offset than with N'. Every tensor of the checkpoint laid out over the buffer (the master,
Muon's momentum and AdamW's moments in ``opt.*``, a reducer's error feedback, a strategy's shards)
is read back into model order by the old placement (``MatrixOrder.values``) and written at the new
one's offsets (``MatrixOrder.place``); engine/checkpoint/reshard.py applies the strategy's rules in
model order between the two. A matrix's momentum moves whole with its values to its new owner, so
the re-cut state is what a run at N' would hold had it taken the same steps.

Under model_sharding='node' the buffer is a rail's local buffer (engine/core/flat.py ``LocalShards``),
cut into one chunk per node: each parameter is placed by its slot (local rank 0's rows, so every rail
places alike) for the number of nodes, and holds this rail's rows at the slot's start. The same
``MatrixOrder`` reads the old rail's buffer placed for M nodes into the rail's model order and writes
it placed for M' (engine/checkpoint/reshard.py ``recut_rails``); a slot's tail after shorter rows
takes the fill, as padding does."""

from __future__ import annotations

import math

import torch

from acco_loco.matrix_layout import place


class ModelOrder:
    """The plain flat layout: the parameters in model order from offset 0, then padding."""

    def __init__(self, numel: int, padded: int):
        self.numel, self.padded = numel, padded

    def values(self, t: torch.Tensor) -> torch.Tensor:
        """The trainable values of an old whole buffer ``t``, in model order."""
        return t[:self.numel]

    def place(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """A new whole buffer: ``values`` (model order) at the new offsets, ``fill`` in the padding."""
        out = torch.full((self.padded,), fill, dtype=values.dtype)
        out[:self.numel] = values
        return out


class MatrixOrder(ModelOrder):
    """The layouts of the old and the new world size when matrices stay whole (``flat.matrices``);
    under node sharding the world is the rail's, the nodes, and each parameter is placed by its
    slot (``flat.slots``) but holds only its local rows."""

    def __init__(self, flat, old_world: int, unit: int):
        super().__init__(flat.numel, flat.padded)
        sizes = [b - a for a, b in flat.offsets]
        starts = {m[0] for m in flat.matrices}
        whole = [a in starts for a, _ in flat.offsets]
        offsets, self.old_shard_size = place(getattr(flat, "slots", sizes), whole, old_world, unit)
        self.old = [(a, a + n) for a, n in zip(offsets, sizes)]
        self.new = flat.offsets

    def values(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[a:b] for a, b in self.old])

    def place(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        out = torch.full((self.padded,), fill, dtype=values.dtype)
        at = 0
        for a, b in self.new:
            out[a:b] = values[at:at + b - a]
            at += b - a
        return out


def matrix_order(ctx, old_world: int) -> MatrixOrder:
    """The old and new placements of ``ctx.flat``'s parameters, the old one rebuilt as the old run
    built it: the same parameters, whole flags and shard unit, ``old_world`` shards (for a
    node-sharded rail's local buffer: nodes). The caller checks its ``old_shard_size`` against the
    one the checkpoint recorded."""
    from ..strategies import shard_groups  # the unit engine/core/context.py and parallel/sharding.py cut by

    return MatrixOrder(ctx.flat, old_world, math.lcm(ctx.cfg.align, *shard_groups(ctx.cfg)))
