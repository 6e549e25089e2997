"""The parameter gatherers of a round (each owner's new shard -> the full buffer every replica
holds, ``ParamGatherer`` of engine/core/rounds.py), pipelined over the pieces of the shard as the
reducers of engine/parallel/collectives.py are: a gatherer sends each piece of the new shard as
soon as the optimizer has produced it (``begin``/``push``/``finish``, see
engine/strategies/sharded.py).

The delta parameter all-gather sends Q(master_new - theta') where theta' is what every replica
holds; every replica, the owner included, adds the same decoded delta, so replicas stay
bit-identical and the owner's exact fp32 master carries any error into the next delta.
"""

from __future__ import annotations

import torch

from acco_loco import kernel_policy, kernels
from acco_loco.registry import WIRE_CODECS

from ..runtime.host import false_rows, nonfinite_rows, nonfinite_rows_parts
from .comm import Comm
from .wire_rows import _bytes_as, _decoded_rows, _scale_bytes, _segments


class _Gatherer:
    """A pipelined all-gather of a new shard into ``held`` (the full buffer every replica holds):
    ``begin`` gives the pieces, ``push(k)`` sends piece k of the new shard as soon as it is
    ready, ``finish`` waits, checks and installs; ``gather`` does the three in a row."""

    def gather(self, comm: Comm, new_shard: torch.Tensor, held: torch.Tensor, restorable: bool = False) -> list[int]:
        """Fill ``held``; returns the ranks whose gathered values are not finite."""
        for k in range(len(self.begin(comm, held, restorable))):
            self.push(comm, k, new_shard)
        return self.finish(comm, held)

    def begin(self, comm: Comm, held: torch.Tensor, restorable: bool = False) -> list[tuple[int, int]]:
        self._pending: list = []
        self._shard = held.numel() // comm.world_size
        self._bounds = self._pieces(comm)
        return [(a, b) for a, b, *_ in self._bounds]


class CastParams(_Gatherer):
    """All-gather of the new shards cast to a wire dtype (the compute dtype, or a cast).

    Received pieces go into ``held`` as they arrive: with one piece in the held dtype straight
    (every rank's shard lands in its place: no receive buffer), else through one of two kept
    receive buffers a piece long (at most two pieces are in flight: a push waits for the piece
    before the last). ``finish`` then checks ``held`` itself; when some rank's values are not
    finite, ``held`` is left part-written and must be gathered again (the round does)."""

    def __init__(self, wire_dtype: torch.dtype):
        self.wire_dtype = wire_dtype

    def _pieces(self, comm: Comm):
        return comm.pieces(self._shard)

    def begin(self, comm: Comm, held: torch.Tensor, restorable: bool = False) -> list[tuple[int, int]]:
        self._held = held  # (written as pieces arrive whatever ``restorable``: a cast gather overwrites it all)
        return super().begin(comm, held)

    def push(self, comm: Comm, k: int, new_shard: torch.Tensor, start: int = 0) -> None:
        """Send piece k of ``new_shard`` (its first value the shard's ``start``); a piece sent as it
        is (already in the wire dtype) is read until the push of piece k + 2 has drained it."""
        held, dev = self._held, new_shard.device
        self._drain(comm, keep=1)  # piece k - 2 is in place: its buffers are free
        a, b = self._bounds[k]
        piece = new_shard[a - start:b - start]
        if piece.dtype != self.wire_dtype or not piece.is_contiguous():
            piece = comm.slot("params.cast", k, self._bounds, 1, self.wire_dtype, dev).view(-1).copy_(piece)
        if len(self._bounds) == 1 and held.dtype == self.wire_dtype:
            recv = held.detach()  # an alias outside autograd: the backend writes it in place
        else:
            recv = comm.slot("params.recv", k, self._bounds, comm.world_size, self.wire_dtype, dev)
        self._pending.append((k, recv, comm.all_gather_start(recv.view(-1), piece)))

    def _drain(self, comm: Comm, keep: int) -> None:
        """Wait for all but the last ``keep`` pieces in flight and copy each into its rows of held."""
        rows = self._held.view(comm.world_size, self._shard)
        while len(self._pending) > keep:
            k, recv, work = self._pending.pop(0)
            if work is not None:
                work.wait()
            if recv.data_ptr() != self._held.data_ptr():  # not gathered in place
                a, b = self._bounds[k]
                rows[:, a:b].copy_(recv)  # while the later pieces are still on the wire

    def finish(self, comm: Comm, held: torch.Tensor) -> list[int]:
        """Fill ``held``; returns the ranks whose gathered values are not finite (``held`` must
        then be gathered again)."""
        self._drain(comm, keep=0)
        self._held = None
        return nonfinite_rows(held.view(comm.world_size, self._shard))


class DeltaParams(_Gatherer):
    """The delta all-gather of new parameter shards against what every replica holds.

    Where the caller can fill ``held`` again (``restorable``) each piece's deltas are added as the
    piece arrives, through two kept send and receive slots a piece long that the pieces take in
    turn (a push waits for the piece before the last), and ``finish`` names the ranks whose rows
    were not finite, with ``held`` then part-updated. Otherwise every piece's rows are kept until
    all have arrived and are finite, so that ``held`` stays untouched when some are not."""

    def __init__(self, name: str, world: int, group_size: int, scale_dtype: str):
        self.codec = WIRE_CODECS[name](group_size, scale_dtype)
        self.world = world
        self.fused = kernel_policy.wire_codec(self.codec)

    def _pieces(self, comm: Comm):
        return _segments(self.codec, comm, self._shard)

    def _fused_for(self, held: torch.Tensor, *tensors: torch.Tensor) -> bool:
        return self.fused and kernel_policy.fits(held, *tensors)

    def begin(self, comm: Comm, held: torch.Tensor, restorable: bool = False) -> list[tuple[int, int]]:
        self._held, self._fused_now, self.streaming = held, None, restorable
        self._finite = None  # streaming: every row's finiteness so far, on the device
        return super().begin(comm, held)

    def _rows(self, comm: Comm, k: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Piece k's send buffer and receive rows: its own pair, or (streaming) one of two slots."""
        a, b, p, s = self._bounds[k]
        if not self.streaming or len(self._bounds) <= 2:  # two pieces or fewer: their own buffers are no more
            return (comm.buffer(("params.send", k), (p + s,), torch.uint8, dev),
                    comm.buffer(("params.recv", k), (comm.world_size * (p + s),), torch.uint8, dev))
        width = max(p_ + s_ for _, _, p_, s_ in self._bounds)
        send = comm.buffer(("params.send.turn", k % 2), (width,), torch.uint8, dev)
        recv = comm.buffer(("params.recv.turn", k % 2), (comm.world_size * width,), torch.uint8, dev)
        return send[:p + s], recv[:comm.world_size * (p + s)]

    def push(self, comm: Comm, k: int, new_shard: torch.Tensor, start: int = 0,
             held: torch.Tensor | None = None) -> None:
        """Send piece k of Q(new_shard - mine), mine = this rank's shard of ``held``; ``new_shard``'s
        first value is the shard's ``start`` (it is read here, encoded into the piece's own send buffer)."""
        held = self._held if held is None else held
        if self.streaming:
            self._drain(comm, held, keep=1)  # piece k - 2 is added: its slots are free
        a, b, p, s = self._bounds[k]
        codec, dev = self.codec, held.device
        send, recv = self._rows(comm, k, dev)
        lo = comm.rank * self._shard
        mine, new = held[lo + a:lo + b], new_shard[a - start:b - start]
        if self._fused_now is None:  # once a round
            self._fused_now = self._fused_for(held, new_shard)
        if self._fused_now and p % 4 == 0:
            kernels.delta_encode(new.data_ptr(), mine.data_ptr(), b - a, codec.bits, codec.group_size,
                                 send.data_ptr(), p)
        else:
            delta = new.to(torch.float32) - mine.to(torch.float32)
            payload, scales = codec.encode(delta, check_finite=False)
            # a NaN group would encode as scale 0: say it in the scales, on the device
            scales = torch.where(torch.isfinite(delta).all(), scales, float("nan")).to(scales.dtype)
            send[:p].copy_(payload)
            send[p:].copy_(_scale_bytes(scales))
        self._pending.append((k, recv, comm.all_gather_start(recv, send)))

    def _drain(self, comm: Comm, held: torch.Tensor, keep: int) -> None:
        """Streaming: wait for all but the last ``keep`` pieces in flight and add each into ``held``."""
        n = comm.world_size
        while len(self._pending) > keep:
            k, recv, work = self._pending.pop(0)
            if work is not None:
                work.wait()
            a, b, p, s = self._bounds[k]
            rows = recv.view(n, p + s)
            finite = torch.isfinite(_bytes_as(rows[:, p:], self.codec.scale_dtype)).all(dim=1)
            self._finite = finite if self._finite is None else self._finite & finite
            self._add(comm, held, [(a, b, p, rows)])

    def finish(self, comm: Comm, held: torch.Tensor) -> list[int]:
        """Add the deltas into ``held``; returns the ranks whose new shard was not finite. Kept rows
        (not ``restorable``): nothing is added then, ``held`` untouched on every replica (all see the
        same rows); streaming: ``held`` holds what arrived, to be filled again by the caller."""
        if not self.streaming:
            return self.arrived(comm) or self.apply(comm, held) or []
        self._drain(comm, held, keep=0)
        self._held, finite, self._finite = None, self._finite, None
        if finite is None:
            return []
        return false_rows(finite)

    def arrived(self, comm: Comm) -> list[int]:
        """Wait for every piece (kept rows); the ranks whose new shard was not finite (``apply`` if none)."""
        n, codec, self._got = comm.world_size, self.codec, []
        for k, recv, work in self._pending:
            if work is not None:
                work.wait()
            a, b, p, s = self._bounds[k]
            rows = recv.view(n, p + s)
            self._got.append((a, b, p, rows, _bytes_as(rows[:, p:], codec.scale_dtype)))
        self._held = None
        return nonfinite_rows_parts([scales for *_, scales in self._got])

    def apply(self, comm: Comm, held: torch.Tensor) -> None:
        """Add the arrived deltas into ``held``."""
        got, self._got = self._got, None
        self._add(comm, held, [(a, b, p, rows) for a, b, p, rows, _ in got])

    def _add(self, comm: Comm, held: torch.Tensor, pieces) -> None:
        """Add each received piece's decoded rows (a, b, payload bytes, rows) into its place in ``held``."""
        n, shard, codec = comm.world_size, self._shard, self.codec
        fused = self._fused_for(held)
        for a, b, p, rows in pieces:
            if fused and p % 4 == 0:  # every row's piece into its place in held
                kernels.decode_add(rows.data_ptr(), n, rows.shape[1], p, b - a, codec.bits, codec.group_size,
                                   held.data_ptr() + 4 * a, shard)
                continue
            for j0, j1, deltas in _decoded_rows(codec, rows, p, rows.shape[1] - p, b - a):
                view = held.view(n, shard)[j0:j1, a:b]  # each row's piece in its replica's shard
                view.add_(deltas) if held.dtype == torch.float32 else view.copy_(view.to(torch.float32).add_(deltas))
