"""Collectives of the engine over torch.distributed, with a count of the bytes each worker sends.

The process group comes from the launcher's environment (torchrun, ``accelerate launch``:
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) or from an already initialised default group. World size
1 needs no launcher and no process group.

Reduce-scatter is done as all_to_all_single + a local fp32 sum: gloo's reduce_scatter_tensor
sends the whole buffer, all_to_all_single sends (N-1)/N of it, and the same path carries packed
low-bit payloads that collectives cannot sum.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


# torch 2.13 renamed all_gather_into_tensor to all_gather_single; keep older releases working
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


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
    dist.init_process_group(backend_for(device), init_method="env://",
                            timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def default_store():
    """The rendezvous store of the default group, for heartbeats (None if unavailable)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private API: degrade to "no rank names in errors", never fail
        return None


class Comm:
    """The engine's collectives. Every call is made from the one comm thread, in round order,
    so ranks can never disagree on the order of collectives."""

    def __init__(self, rank: int, world_size: int, chunks: int = 1):
        self.rank = rank
        self.world_size = world_size
        self.chunks = chunks
        self.bytes_sent = 0  # what this worker put on the wire, all rounds together

    def all_to_all_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Send row j of ``rows`` ([world, L], any dtype) to rank j; returns the rows received
        (row j came from rank j). Split into ``chunks`` async pieces along L for gloo speed."""
        n = self.world_size
        if n == 1:
            return rows.clone()
        received = torch.empty_like(rows)
        bounds = _chunk_bounds(rows.shape[1], self.chunks)
        whole = len(bounds) == 1
        works = []
        for a, b in bounds:
            send = rows.contiguous() if whole else rows[:, a:b].contiguous()
            recv = received if whole else torch.empty_like(send)
            works.append((a, b, recv, dist.all_to_all_single(recv, send, async_op=True)))
        for a, b, recv, work in works:
            work.wait()
            if not whole:
                received[:, a:b].copy_(recv)
        self.bytes_sent += (n - 1) * rows[0].numel() * rows.element_size()
        return received

    def reduce_scatter_sum(self, full: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over workers of ``full``'s shard ``rank``, in fp32."""
        n = self.world_size
        shard = full.numel() // n
        if out is None:
            out = torch.empty(shard, dtype=torch.float32, device=full.device)
        if n == 1:
            return out.copy_(full)
        received = self.all_to_all_rows(full.view(n, shard))
        torch.sum(received, dim=0, dtype=torch.float32, out=out)
        return out

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Concatenate every worker's ``shard`` into ``out`` (same dtype)."""
        n = self.world_size
        if n == 1:
            return out.copy_(shard)
        size = shard.numel()
        bounds = _chunk_bounds(size, self.chunks)
        if len(bounds) == 1:
            _all_gather_single(out, shard.contiguous())
        else:
            rows = out.view(n, size)
            works = []
            for a, b in bounds:
                # gloo wants a flat receive buffer (a [n, k] one is refused)
                recv = torch.empty(n * (b - a), dtype=out.dtype, device=out.device)
                works.append((a, b, recv, _all_gather_single(recv, shard[a:b].contiguous(), async_op=True)))
            for a, b, recv, work in works:
                work.wait()
                rows[:, a:b].copy_(recv.view(n, b - a))
        self.bytes_sent += (n - 1) * size * shard.element_size()  # a ring sends N-1 pieces
        return out

    def all_reduce_sum(self, small: torch.Tensor) -> torch.Tensor:
        """In-place sum of a small vector (counts, norms, flags)."""
        if self.world_size > 1:
            dist.all_reduce(small)
            self.bytes_sent += 2 * (self.world_size - 1) * small.numel() * small.element_size() // self.world_size
        return small

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(tensor, src)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def _chunk_bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    chunks = max(1, min(chunks, size))
    step = -(-size // chunks)
    return [(a, min(size, a + step)) for a in range(0, size, step)]
