"""A node as one replica of a local-step strategy (diloco, sparseloco; docs/nodes.md,
"diloco and sparseloco: a node as one replica"). With the model sharded inside the node
(model_sharding="node") the same groups and agreements serve, but FSDP2 does the node's gradient
sum and each rank's slice is its local shards (engine/strategies/local_steps.py).

With the two-level layout (M nodes of G ranks), the G ranks of a node take every inner step
together: the node's fp32 sum of their gradients is reduce-scattered inside the node, each rank
steps the inner optimizer on its 1/G slice (the inner state is sharded inside the node), and the
slices are all-gathered inside the node, so every rank of a node holds the node's theta_w. Only
the outer round crosses nodes: each rank exchanges its slice of the node's pseudo-gradient with
the ranks of the same local rank on the other nodes (its rail), and theta_sync, the outer momentum
and sparseloco's error live on that slice. A rank's slice is the shards (m, l) of every node m,
the layout the sharded strategies' two-level exchange uses (engine/parallel/two_level.py ``slice_of``).

Two sets of groups (engine/parallel/dims.py): the inner steps run on the compute thread (role
"node.compute"), the outer round on the comm thread ("node", "rail"), and a process group must
not be used from two threads at once (outer_overlap runs both at the same time).

Under NCCL the two threads' collectives also run over the same GPUs on different communicators,
and NCCL asks that such collectives either never be in flight together or be launched in the
same order on every rank (docs/gpu.md, "Collectives of two threads under NCCL"). Here: epochs
fixed in the compute thread's program order. The compute thread marks a round in flight just
before it submits it (``round_submitted``, the same inner-step boundary on every rank); its next
node collective waits until the comm thread has finished that round (``round_finished``: by
then the round's host reads have seen its last collective complete). So every rank launches
..., inner step b, the whole round, inner step b + 1, ...: no order to disagree on. The outer
round still overlaps the next inner step's forward and backward; under gloo (no device
kernels waiting on each other) the threads run freely.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from ..parallel.two_level import gather_slices, slice_of
from ..runtime import host
from ..runtime.host import nonfinite_flag, small_vector, to_host


class NodeReplica:
    EPOCHS: bool | None = None  # the default of ``epochs`` (None: under NCCL only)

    def __init__(self, dims, epochs: bool | None = None):
        self.layout = dims.layout
        # None: epochs under NCCL only (EPOCHS: tests force them on over gloo)
        epochs = self.EPOCHS if epochs is None else epochs
        self.epochs = dist.get_backend() == "nccl" if epochs is None else epochs
        self._idle = threading.Event()  # set: no outer round in flight
        self._idle.set()
        self.inner_node = dims.comm("node.compute")  # the compute thread's
        self.outer_node, self.rail = dims.comm("node"), dims.comm("rail")  # the comm thread's

    # ------------------------------------------------------------------ epochs
    def round_submitted(self) -> None:
        """Compute thread, just before it submits an outer round."""
        if self.epochs:
            self._idle.clear()

    def round_finished(self) -> None:
        """Comm thread, once the round's last collective is done (or the round failed)."""
        self._idle.set()

    def _wait_for_round(self) -> None:
        """Before a node collective of the compute thread: the round in flight must be done."""
        if self.epochs and not self._idle.wait(host.wait_limit_s):
            raise TimeoutError(f"the outer round in flight did not finish within {host.wait_limit_s:g} s: "
                               "a collective is stuck (a peer lost or stalled?)")

    # ------------------------------------------------------------------ compute thread
    def node_sum(self, full: torch.Tensor) -> torch.Tensor:
        """The node's fp32 sum of this rank's slice of ``full`` (every rank's own gradient sum)."""
        self._wait_for_round()
        lay, node = self.layout, self.inner_node
        m, g = lay.nodes, lay.ranks_per_node
        shard, dev = full.numel() // (m * g), full.device
        rows = node.buffer(("replica.rows",), (g, m * shard), full.dtype, dev)
        rows.view(g, m, shard).copy_(full.view(m, g, shard).transpose(0, 1))
        out = node.buffer(("replica.sum",), (m * shard,), torch.float32, dev)
        return node.reduce_scatter_sum(rows.view(-1), out)

    def agree(self, small: torch.Tensor) -> list[float]:
        """A small float64 sum over the node's ranks (counts, flags): the same numbers on each."""
        self._wait_for_round()
        return [float(x) for x in to_host(self.inner_node.all_reduce_sum(small))]

    def install(self, part: torch.Tensor, full: torch.Tensor) -> None:
        """Every rank's slice ``part`` into the node's whole buffer ``full`` (the model's)."""
        self._wait_for_round()
        with torch.no_grad():
            gather_slices(self.inner_node, part, full, self.layout)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        return slice_of(full, self.layout)

    # ------------------------------------------------------------------ comm thread
    def node_shares(self, rank_samples: list[int]) -> list[float]:
        """Each node's share of the period's samples (ranks are numbered node by node)."""
        g = self.layout.ranks_per_node
        per_node = [sum(rank_samples[k * g:(k + 1) * g]) for k in range(self.layout.nodes)]
        total = sum(per_node)
        return [s / total if total else 0.0 for s in per_node]


def squares(part: torch.Tensor, piece: int = 1 << 22) -> torch.Tensor:
    """The sum of squares of ``part`` in fp32 (a 0-d device tensor); a low-precision ``part`` (a
    sharded bf16 model's gradient) is cast a piece at a time, not whole."""
    if part.dtype == torch.float32:
        return torch.dot(part, part)
    total = torch.zeros((), dtype=torch.float32, device=part.device)
    for a in range(0, part.numel(), piece):
        p = part[a:a + piece].to(torch.float32)
        total += torch.dot(p, p)
    return total


def inner_totals(replica: NodeReplica, part: torch.Tensor, count: int, samples: int, loss_sum,
                 grad_sum: torch.Tensor, due: bool) -> tuple[int, int, float, float, bool, bool]:
    """The node's (micro-batches, samples, loss sum, squared norm of its summed gradient, whether
    any rank's gradient was not finite, whether any rank's outer period elapsed): one small
    all-reduce, one host read."""
    # this rank's slice's squares: the node's norm adds up
    small = small_vector([count, samples, loss_sum, squares(part), nonfinite_flag(grad_sum), float(due)],
                         part.device)
    got = replica.agree(small)
    sq = got[3]
    if not math.isfinite(sq) and got[4] == 0:  # finite values whose fp32 squares overflowed (rare)
        sq = replica.agree(torch.linalg.vector_norm(part, dtype=torch.float64).square().reshape(1))[0]
    return int(got[0]), int(got[1]), got[2], sq, got[4] > 0, got[5] > 0
