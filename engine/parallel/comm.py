"""Collectives of the engine over torch.distributed, with a count of the bytes each worker sends.

The process group comes from the launcher's environment (torchrun, ``accelerate launch``:
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) or from an already initialised default group. World size
1 needs no launcher and no process group.

Reduce-scatter is done as all_to_all_single + a local fp32 sum: gloo's reduce_scatter_tensor
sends the whole buffer, all_to_all_single sends (N-1)/N of it, and the same path carries packed
low-bit payloads that collectives cannot sum.

``chunks`` (EngineConfig.comm_chunks) pipelines: ``reduce_scatter_sum`` sends piece k+1 of the
shard while it sums piece k, and the engine's reducers and gatherers (engine/parallel/collectives.py)
start one async collective per piece with ``all_to_all_start``/``all_gather_start``. Send and
receive tensors come from ``buffer`` and are reused every round. Pieces start at multiples of
PIECE_ALIGN values, so that every piece computes the same bits as the whole would.
"""

from __future__ import annotations

import math
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; keep older releases working
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# under NCCL the process group's own timeout is a backstop beyond the engine's: the engine's
# time-limited waits (timeout_s) fire first, name the lost peer from the heartbeats and abort the
# communicators (streams.CommWorker.abort); only if that path itself hangs does NCCL's watchdog
# end the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, set unless the user chose). Beyond the
# diagnosis (2.5 heartbeats; heartbeat_s <= timeout_s / 3, so under 0.84 timeout_s) and a margin.
NCCL_BACKSTOP = (2.0, 60.0)  # pg timeout = 2 * timeout_s + 60 s


def init_process_group(device: torch.device, timeout_s: float) -> tuple[int, int]:
    """Return (rank, world_size), creating the default group from the launcher's env if needed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world} but {missing} are not set: start the workers with "
                           "torchrun or `accelerate launch`, which set them")
    backend = backend_for(device)
    # NCCL: bind the group to this rank's GPU (its communicator is made at once, on that device)
    bound = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method="env://", timeout=prepare_backend(backend, timeout_s), **bound)
    return dist.get_rank(), dist.get_world_size()


def group_timeout_s(backend: str, timeout_s: float) -> float:
    """The timeout of a process group the engine uses: ``timeout_s`` under gloo (its collectives
    time out and raise on their own), the backstop beyond it under NCCL."""
    return NCCL_BACKSTOP[0] * timeout_s + NCCL_BACKSTOP[1] if "nccl" in str(backend) else timeout_s


def prepare_backend(backend: str, timeout_s: float) -> timedelta:
    """The default group's timeout for ``backend`` (also for a launcher's group: the recipe hands
    it to accelerate); under NCCL also its watchdog's error handling, unless the user chose."""
    if "nccl" in str(backend):
        # errors and timeouts of NCCL collectives are handled by its watchdog, never left hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    return timedelta(seconds=group_timeout_s(backend, timeout_s))


def default_store():
    """The rendezvous store of the default group, for heartbeats (None if unavailable)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private API: degrade to "no rank names in errors", never fail
        return None


class LinkBytes:
    """Bytes this worker sent, split by the link they cross: ``intra`` to ranks on its own node,
    ``inter`` to ranks on other nodes (docs/nodes.md). Every Comm of a worker (the
    world, its node, its rail) adds to one of these."""

    def __init__(self) -> None:
        self.intra = 0
        self.inter = 0
        self._lock = threading.Lock()  # node replicas count from the compute and the comm thread

    def add(self, intra: int, inter: int) -> None:
        with self._lock:
            self.intra += intra
            self.inter += inter

    @property
    def total(self) -> int:
        return self.intra + self.inter


class Comm:
    """The engine's collectives over one of its process groups (engine/parallel/dims.py: the
    world, a node's group or a rail, each used by one thread), so ranks can never disagree on the
    order of collectives. A collective from a second thread is refused (``owner``).

    ``peer_nodes[j]`` is the node of group rank j (None: every peer on another node, as the
    one-rank-per-node layout has it); it splits the bytes sent into intra- and inter-node."""

    def __init__(self, rank: int, world_size: int, chunks: int = 1, group=None,
                 peer_nodes: list[int] | None = None, counter: LinkBytes | None = None, name: str = "world"):
        self.rank = rank
        self.name = name  # its role (engine/parallel/dims.py ROLES), for errors
        self.owner: int | None = None  # the thread that issues its collectives (the first to issue one)
        self.world_size = world_size
        self.chunks = chunks
        self.group = group  # None: the default group
        self.counter = counter if counter is not None else LinkBytes()
        self.sent = 0  # bytes this Comm's own collectives sent (the counter adds every Comm's)
        if peer_nodes is None:
            peer_nodes = list(range(world_size))
        if len(peer_nodes) != world_size:
            raise ValueError(f"peer_nodes names {len(peer_nodes)} ranks for a group of {world_size}")
        # of the world_size - 1 peers, how many sit on this rank's own node
        self._same_node = sum(1 for j, node in enumerate(peer_nodes) if j != rank and node == peer_nodes[rank])
        self._peer_nodes = peer_nodes
        self._buffers: dict = {}  # buffer(): send/receive tensors reused every round
        # NCCL sums inside its reduce-scatter (a ring: (N-1)/N of the buffer out of each rank);
        # gloo's sends the whole buffer, so there the all-to-all + local sum below is faster
        self.native_reduce_scatter = (world_size > 1 and dist.is_available() and dist.is_initialized()
                                      and dist.get_backend(group) == "nccl")

    def _enter(self) -> None:
        """A collective is about to start: it must come from the thread this group belongs to."""
        me = threading.get_ident()
        if self.owner is None:
            self.owner = me
        elif self.owner != me:
            raise RuntimeError(f"the engine's {self.name!r} group was used from thread "
                               f"{threading.current_thread().name!r} after another thread used it: each engine "
                               "group belongs to one thread (engine/parallel/dims.py ROLES)")

    @property
    def bytes_sent(self) -> int:
        """What this worker put on the wire through any of its Comms, all rounds together."""
        return self.counter.total

    def _add(self, intra: int, inter: int) -> None:
        self.sent += intra + inter
        self.counter.add(intra, inter)

    def _count(self, per_peer: int) -> None:
        """``per_peer`` bytes to each of the other ranks of the group (an all-to-all row, an
        all-gather piece), split by where the peer sits."""
        self._add(self._same_node * per_peer, (self.world_size - 1 - self._same_node) * per_peer)

    def all_to_all_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Send row j of ``rows`` ([world, L], any dtype) to rank j; returns the rows received
        (row j came from rank j). Split into ``chunks`` async pieces along L for gloo speed."""
        n = self.world_size
        if n == 1:
            return rows.clone()
        self._enter()
        received = torch.empty_like(rows)
        bounds = _chunk_bounds(rows.shape[1], self.chunks)
        whole = len(bounds) == 1
        works = []
        for a, b in bounds:
            send = rows.contiguous() if whole else rows[:, a:b].contiguous()
            recv = received if whole else torch.empty_like(send)
            works.append((a, b, recv, dist.all_to_all_single(recv, send, group=self.group, async_op=True)))
        for a, b, recv, work in works:
            work.wait()
            if not whole:
                received[:, a:b].copy_(recv)
        self._count(rows[0].numel() * rows.element_size())
        return received

    def all_to_all_split(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Send ``send_counts[j]`` values of flat ``send`` (rank order) to rank j; returns the values
        received, ``recv_counts[j]`` from rank j, in rank order (all_to_all_single, uneven splits)."""
        out = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)
        if self.world_size == 1:
            return out.copy_(send)
        self._enter()
        dist.all_to_all_single(out, send, recv_counts, send_counts, group=self.group)
        mine, size = self._peer_nodes[self.rank], send.element_size()
        same = sum(n for j, n in enumerate(send_counts) if j != self.rank and self._peer_nodes[j] == mine)
        other = sum(n for j, n in enumerate(send_counts) if self._peer_nodes[j] != mine)
        self._add(same * size, other * size)
        return out

    def buffer(self, key, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor kept for ``key`` and reused every round (no per-round allocation of
        buffer-sized tensors); a new one when the shape, dtype or device changes."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def drop_buffers(self) -> None:
        """Free every kept buffer (a strategy whose later rounds no longer run the collectives that
        kept them: 1-bit Adam after its freeze); ``buffer`` makes one again on its next use."""
        self._buffers.clear()

    def all_to_all_start(self, recv: torch.Tensor, send: torch.Tensor):
        """Start sending row j of ``send`` ([world, L], contiguous) to rank j into ``recv``;
        returns the work to wait on (None at world size 1, where it is done)."""
        if self.world_size == 1:
            recv.copy_(send)
            return None
        self._enter()
        self._count(send[0].numel() * send.element_size())
        return dist.all_to_all_single(recv, send, group=self.group, async_op=True)

    def all_gather_start(self, recv: torch.Tensor, piece: torch.Tensor):
        """Start gathering every rank's ``piece`` (contiguous) into flat ``recv`` (rank order);
        returns the work to wait on (None at world size 1)."""
        if self.world_size == 1:
            recv.copy_(piece.view(-1))
            return None
        self._enter()
        self._count(piece.numel() * piece.element_size())  # N-1 pieces, as a ring sends
        return _all_gather_single(recv, piece, group=self.group, async_op=True)

    def pieces(self, size: int, unit: int = 1) -> list[tuple[int, int]]:
        """The ``[a, b)`` pieces a pipelined collective over shards of ``size`` values takes:
        ``chunks`` of them, more where one piece of every rank's shard together would pass
        MAX_PIECE_VALUES (the kept send/receive buffers and the temporaries of a piece stay
        bounded whatever the model's size); starts at multiples of ``unit`` and PIECE_ALIGN."""
        count = max(self.chunks, -(-size * self.world_size // MAX_PIECE_VALUES))
        return chunk_bounds(size, count, math.lcm(unit, PIECE_ALIGN))

    def slot(self, key, k: int, pieces: list[tuple[int, int]], rows: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A kept ``[rows, b - a]`` buffer for piece k of ``pieces``, one of two reused in turn (a
        pipelined collective has at most two pieces in flight: piece k starts once piece k - 2 is
        done), each as long as the longest piece (the first)."""
        a, b = pieces[k]
        width = pieces[0][1] - pieces[0][0]
        flat = self.buffer((key, k % 2), (rows * width,), dtype, device)
        return flat[:rows * (b - a)].view(rows, b - a)

    def reduce_scatter_sum(self, full: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over workers of ``full``'s shard ``rank``, in fp32.

        Pipelined over the pieces of the shard (``pieces``): piece k+1 is copied out and on the
        wire while piece k is summed. Each output value is the same sum of the same rows in the
        same order whatever the pieces, so the result does not depend on ``chunks``."""
        n = self.world_size
        shard = full.numel() // n
        if out is None:
            out = torch.empty(shard, dtype=torch.float32, device=full.device)
        if n == 1:
            return out.copy_(full)
        self._enter()
        rows, bounds = full.view(n, shard), self.pieces(shard)
        if self.native_reduce_scatter:
            # the backend's own collective on fp32 values, so that the sum is fp32 as below (its
            # order is the backend's): a gradient in another dtype, or more than one piece, goes
            # through one kept fp32 buffer a piece long (never an fp32 copy of the whole
            # gradient); the calls are synchronous, so the next piece's copy waits for the last
            for a, b in bounds:
                if full.dtype == torch.float32 and len(bounds) == 1:
                    src = full
                else:
                    src = self.buffer(("rs.fp32",), (n * (bounds[0][1] - bounds[0][0]),), torch.float32,
                                      full.device)[:n * (b - a)]
                    src.view(n, b - a).copy_(rows[:, a:b])
                dist.reduce_scatter_tensor(out[a:b], src, group=self.group)
            self._count(shard * 4)
            return out
        pending: list = []
        for k, (a, b) in enumerate(bounds):
            recv = self.slot("rs.recv", k, bounds, n, full.dtype, full.device)
            if len(bounds) == 1:
                send = rows  # already contiguous: no copy
            else:
                send = self.slot("rs.send", k, bounds, n, full.dtype, full.device)
                send.copy_(rows[:, a:b])
            pending.append((a, b, recv, self.all_to_all_start(recv, send)))
            if len(pending) > 1:  # sum the piece before this one while this one is on the wire
                _sum_rows(pending.pop(0), out)
        for item in pending:
            _sum_rows(item, out)
        return out

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Concatenate every worker's ``shard`` into ``out`` (same dtype)."""
        n = self.world_size
        if n == 1:
            return out.copy_(shard)
        self._enter()
        size = shard.numel()
        bounds = _chunk_bounds(size, self.chunks)
        if len(bounds) == 1:
            _all_gather_single(out, shard.contiguous(), group=self.group)
        else:
            rows = out.view(n, size)
            works = []
            for a, b in bounds:
                # gloo wants a flat receive buffer (a [n, k] one is refused)
                recv = torch.empty(n * (b - a), dtype=out.dtype, device=out.device)
                works.append((a, b, recv, _all_gather_single(recv, shard[a:b].contiguous(), group=self.group,
                                                             async_op=True)))
            for a, b, recv, work in works:
                work.wait()
                rows[:, a:b].copy_(recv.view(n, b - a))
        self._count(size * shard.element_size())  # N-1 pieces, as a ring sends
        return out

    def all_reduce_sum(self, small: torch.Tensor) -> torch.Tensor:
        """In-place sum of a small vector (counts, norms, flags)."""
        if self.world_size > 1:
            self._enter()
            dist.all_reduce(small, group=self.group)
            n, size = self.world_size, small.numel() * small.element_size()
            # a ring all-reduce sends 2 (N-1)/N of the vector; split like the other collectives
            self._add(2 * self._same_node * size // n, 2 * (n - 1 - self._same_node) * size // n)
        return small

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            self._enter()
            dist.broadcast(tensor, self.global_rank(src), group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            self._enter()
            dist.barrier(group=self.group)

    def global_rank(self, group_rank: int) -> int:
        """The default group's rank of this group's rank ``group_rank`` (torch's point-to-point
        and broadcast calls name ranks so)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in group rank order."""
        if self.world_size == 1:
            return [obj]
        self._enter()
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, src: int = 0):
        """Group rank ``src``'s picklable ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        self._enter()
        box = [obj]
        dist.broadcast_object_list(box, self.global_rank(src), group=self.group)
        return box[0]


# pieces of a pipelined collective start at multiples of this many values: torch's elementwise
# kernels run whole vectors from the start of a tensor, so a piece computes the same bits as the
# whole buffer would (and low-bit payload and scale slices stay byte- and word-aligned)
PIECE_ALIGN = 32

# a pipelined collective's piece, all ranks' shares together, holds at most this many values
# (64 MB in fp32): what a piece keeps (send/receive slots) and makes (temporaries) is bounded by
# it, not by the model; NCCL reaches its bus rate well below this size
MAX_PIECE_VALUES = 1 << 24


# comm_chunks="auto": benchmarks/link_check.py measured one gloo all_to_all at 48-50% of a shaped
# link's rate and 8 pieces issued at once at 82-86% (100 Mbit/s and 1 Gbit/s); smaller pieces
# only add per-operation CPU, so no piece is cut below MIN_PIECE values. NCCL pipelines inside.
AUTO_CHUNKS, MIN_PIECE = 8, 1 << 16


def resolve_chunks(setting: int | str, shard_values: int, device: torch.device) -> int:
    """The pieces a collective of a ``shard_values``-long shard is split into (the same on every
    rank: the shard size and the backend are)."""
    if setting != "auto":
        return int(setting)
    if torch.device(device).type == "cuda":
        return 1
    return max(1, min(AUTO_CHUNKS, shard_values // MIN_PIECE))


def chunk_bounds(size: int, chunks: int, unit: int = 1) -> list[tuple[int, int]]:
    """``[a, b)`` pieces of ``range(size)``, at most ``chunks``, every ``a`` a multiple of ``unit``
    (``size`` itself need not be one: the last piece takes the rest)."""
    if size <= 0:
        return [(0, 0)]
    chunks = max(1, min(chunks, -(-size // unit)))
    step = -(-size // (chunks * unit)) * unit
    return [(a, min(size, a + step)) for a in range(0, size, step)]


def _chunk_bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    return chunk_bounds(size, chunks)


def _sum_rows(item, out: torch.Tensor) -> None:
    a, b, recv, work = item
    if work is not None:
        work.wait()
    torch.sum(recv, dim=0, dtype=torch.float32, out=out[a:b])
