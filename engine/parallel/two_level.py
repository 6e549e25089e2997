"""The two-level exchange of a sharded round: full precision inside the node, only the node's
sum across the link (docs/nodes.md).

With M nodes of G ranks and shards of S values, the flat buffer is seen as [M, G, S]: chunk
m * G + l is rank (m, l)'s shard, as in the flat layout, so master shards, optimizer moments,
clipping and checkpoints are the same as flat. Local rank l's *slice* is the M chunks
{m * G + l}: the chunks its rail (rank l of every node) owns.

Gradient: a reduce-scatter inside the node gives local rank l the node's fp32 sum of its slice
(each rank sends G - 1 slices of P/G values in the gradient's dtype to its node peers); the
node's micro-batch count is summed beside it; then the rail runs the plain or compressed
reduce-scatter of the flat engine on that slice, with the node's count as the weight, so the
codec and its error feedback see the node's mean gradient on P/G values (G x less error state).

Parameters: the rail's all-gather (cast or delta codec) brings rank (m, l) every new chunk of
slice l; then the node's all-gather (the held dtype, exact) gives every rank the whole buffer.
Every rank of a rail applies the same decoded values to the same held values, and the node's
gather copies them, so replicas stay bit-identical across all nodes.
"""

from __future__ import annotations

import torch

from ..core.rounds import Reduced
from ..runtime.host import HostRead, small_vector, to_host
from .comm import Comm
from .topology import Layout


class TwoLevelGrads:
    """A gradient reducer: the node's reduce-scatter, then ``inner`` (a flat reducer built for
    P/G values over M ranks) over the rail."""

    def __init__(self, inner, node: Comm, rail: Comm, layout: Layout):
        self.inner, self.node, self.rail, self.layout = inner, node, rail, layout
        self.feedback = getattr(inner, "feedback", None)
        self._count = None

    def node_sum(self, full: torch.Tensor) -> torch.Tensor:
        """The node's fp32 sum of this rank's slice (M chunks of S values, in node order): one
        node reduce-scatter per node's part of ``full`` (part m, G shards, is contiguous: chunk
        m x G + l goes to local rank l), each value summed over the node's ranks in rank order.
        No copy of ``full`` regrouped by destination, and each part's kept buffers are 1/M of it."""
        m, g = self.layout.nodes, self.layout.ranks_per_node
        shard, dev = full.numel() // (m * g), full.device
        out = self.node.buffer(("two_level.node_sum",), (m * shard,), torch.float32, dev)
        for node, part in enumerate(full.view(m, g * shard)):
            self.node.reduce_scatter_sum(part, out[node * shard:(node + 1) * shard])
        return out

    def reduce(self, comm: Comm, full: torch.Tensor, count: int, out: torch.Tensor | None = None) -> Reduced:
        """The rail's sum of the node sums for this rank's shard; the inner reducer's finiteness
        flag is the node sum's, not this rank's gradient: the round checks that itself."""
        m, g = self.layout.nodes, self.layout.ranks_per_node
        shard, dev = full.numel() // (m * g), full.device
        if self._count is None or self._count.device != dev:
            self._count = torch.zeros(1, dtype=torch.float64, device=dev)
        self._count.fill_(float(count))
        # the node's count is summed and its read started before the node's reduce-scatter is
        # queued: on a GPU the read then waits for the small sum only, not for the whole exchange
        node_count = HostRead(self.node.all_reduce_sum(self._count))
        node_sum = self.node_sum(full)
        node_count = int(node_count.wait()[0])
        if self.feedback is None and full.dtype != torch.float32:
            # uncompressed: the rail carries the node's sum in the gradient's dtype, as flat does
            wire = self.node.buffer(("two_level.wire",), (m * shard,), full.dtype, dev)
            node_sum = wire.copy_(node_sum)
        return Reduced(self.inner.reduce(self.rail, node_sum, node_count, out).sum)

    def begin_step(self) -> None:
        self.inner.begin_step()

    def end_step(self, committed_step: int, skipped: bool) -> None:
        self.inner.end_step(committed_step, skipped)

    def state_dict(self, mid_step: bool) -> dict[str, torch.Tensor]:
        return self.inner.state_dict(mid_step)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        self.inner.load_state_dict(tensors, where)


class TwoLevelParams:
    """A parameter gatherer: ``inner`` (a flat gatherer) over the rail on this rank's slice,
    then the node's all-gather of the slices."""

    def __init__(self, inner, node: Comm, rail: Comm, layout: Layout):
        self.inner, self.node, self.rail, self.layout = inner, node, rail, layout

    def gather(self, comm: Comm, new_shard: torch.Tensor, held: torch.Tensor, restorable: bool = False) -> list[int]:
        for k in range(len(self.begin(comm, held, restorable))):
            self.push(comm, k, new_shard)
        return self.finish(comm, held)

    def begin(self, comm: Comm, held: torch.Tensor, restorable: bool = False) -> list[tuple[int, int]]:
        # what this rail holds of its slice: the inner gatherer updates it, never ``held`` itself
        self._slice = self.rail_slice(held)
        return self.inner.begin(self.rail, self._slice, self.slice_restorable(restorable))

    def slice_restorable(self, restorable: bool) -> bool:
        """Whether the inner gatherer may leave the slice part-updated: a copy, made again by the
        next gather, so yes."""
        return True

    def rail_slice(self, held: torch.Tensor) -> torch.Tensor:
        """A copy of the part of ``held`` this rail exchanges (this rank's slice)."""
        m, g, local = self.layout.nodes, self.layout.ranks_per_node, self.layout.local
        shard = held.numel() // (m * g)
        part = self.node.buffer(("two_level.slice",), (m * shard,), held.dtype, held.device)
        part.view(m, shard).copy_(held.view(m, g, shard)[:, local, :])
        return part

    def install(self, held: torch.Tensor) -> None:
        """Every rail's new slice into ``held`` (the node's all-gather)."""
        gather_slices(self.node, self._slice, held, self.layout)

    def push(self, comm: Comm, k: int, new_shard: torch.Tensor, start: int = 0) -> None:
        self.inner.push(self.rail, k, new_shard, start)

    def finish(self, comm: Comm, held: torch.Tensor) -> list[int]:
        """Install the new parameters in ``held`` once every rail's are in and finite; else
        return the (global) ranks whose new shard was not finite, ``held`` untouched on every
        replica: the node agrees on the union of its rails' findings first."""
        bad = self.node_bad(self.inner.finish(self.rail, self._slice), held.device)
        if bad:
            return bad
        self.install(held)
        return []

    def node_bad(self, bad_rail: list[int], device: torch.device) -> list[int]:
        """The (global) ranks whose new shard was not finite, on any rail of this node."""
        m, g, local = self.layout.nodes, self.layout.ranks_per_node, self.layout.local
        mine = [0.0] * (m * g)
        for node in bad_rail:
            mine[node * g + local] = 1.0
        flags = small_vector(mine, device)
        return [r for r, f in enumerate(to_host(self.node.all_reduce_sum(flags)).tolist()) if f > 0]


class ShardGrads:
    """model_sharding='node' (engine/parallel/sharding.py): FSDP2's reduce-scatter already left the node's
    fp32 sum of this rank's local shards in ``full`` (the local buffer, in the compute dtype); the
    node's micro-batch count is summed beside it, then ``inner`` (a flat reducer built for the
    local buffer over M ranks) runs over the rail with the node's count as the weight, as
    TwoLevelGrads does with its node sum. The finiteness flag is the node sum's: a NaN from any
    rank of the node shows up on the rank that holds its shard."""

    def __init__(self, inner, node: Comm, rail: Comm, layout: Layout):
        self.inner, self.node, self.rail, self.layout = inner, node, rail, layout
        self.feedback = getattr(inner, "feedback", None)
        self._count = None

    def reduce(self, comm: Comm, full: torch.Tensor, count: int, out: torch.Tensor | None = None) -> Reduced:
        if self._count is None or self._count.device != full.device:
            self._count = torch.zeros(1, dtype=torch.float64, device=full.device)
        self._count.fill_(float(count))
        node_count = int(to_host(self.node.all_reduce_sum(self._count))[0])
        return self.inner.reduce(self.rail, full, node_count, out)

    begin_step, end_step = TwoLevelGrads.begin_step, TwoLevelGrads.end_step
    state_dict, load_state_dict = TwoLevelGrads.state_dict, TwoLevelGrads.load_state_dict


class ShardParams(TwoLevelParams):
    """model_sharding='node': ``inner`` over the rail on this rank's whole local buffer, written
    into ``held`` itself (no copy of it); the node agrees on finiteness as TwoLevelParams does
    before a delta gatherer adds its deltas (so ``held`` stays untouched when another rail's
    shard was not finite; a cast gatherer's part-written ``held`` is gathered again by the
    round; a streaming one, ``restorable``, leaves it part-updated too and the round fills it again),
    and there is no node gather (FSDP2 gathers in the forward pass). Without overlap
    ``held`` is the gradient buffer the round has reduced (engine/parallel/sharding.py), filled with the
    parameters by ``refresh`` first where a delta gatherer adds to them."""

    def __init__(self, inner, node: Comm, rail: Comm, layout: Layout, refresh=None):
        super().__init__(inner, node, rail, layout)
        self.refresh = refresh  # fills ``held`` with the parameters when it is not kept between rounds
        self.deltas = hasattr(inner, "arrived")  # a delta gatherer: its arrival and its apply are apart

    def rail_slice(self, held: torch.Tensor) -> torch.Tensor:
        if self.refresh is not None and self.deltas:
            self.refresh(held)  # ``held`` is the round's reduced gradient buffer: deltas need the base
        return held

    def slice_restorable(self, restorable: bool) -> bool:
        # ``held`` itself: part-updated only where it is filled again before the next gather
        return restorable or self.refresh is not None

    def finish(self, comm: Comm, held: torch.Tensor) -> list[int]:
        kept_rows = self.deltas and not self.inner.streaming  # deltas added only once the node agrees
        bad_rail = self.inner.arrived(self.rail) if kept_rows else self.inner.finish(self.rail, held)
        bad = self.node_bad(bad_rail, held.device)
        if not bad and kept_rows:
            self.inner.apply(self.rail, held)
        return bad


def slice_of(full: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's slice of a whole buffer (chunks node x G + local, in node order), a copy."""
    m, g = layout.nodes, layout.ranks_per_node
    return full.view(m, g, full.numel() // (m * g))[:, layout.local, :].contiguous().view(-1)


def gather_slices(node: Comm, part: torch.Tensor, out: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Every local rank's slice (in ``out``'s dtype) into its place in the whole buffer ``out``:
    one node all-gather per node's part, straight into it (part m of ``out`` is chunk m of every
    local rank's slice, in rank order), so no whole-buffer receive copy is kept."""
    m, g = layout.nodes, layout.ranks_per_node
    shard = out.numel() // (m * g)
    send = part if part.dtype == out.dtype else node.buffer(("two_level.cast",), part.shape, out.dtype,
                                                            out.device).copy_(part)
    for index, whole in enumerate(out.detach().view(m, g * shard)):  # (an alias outside autograd)
        node.all_gather(send[index * shard:(index + 1) * shard], whole)
    return out
