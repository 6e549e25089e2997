"""The two collectives of a round, apart from the loop: gradient reducers (a worker's gradient
sum -> the fp32 sum of its owned shard) and parameter gatherers (each owner's new shard -> the
full buffer every replica holds). Plain and compressed variants behind one interface each.

Low-bit values cannot be summed inside gloo/NCCL, so the compressed reduce-scatter is an
all_to_all of packed slices that each owner decodes and sums in fp32 (docs/design/wire.md).
Each row a worker sends to owner j holds: the packed payload of shard j, its scales, and the
sender's micro-batch count (the weight). Workers send their *mean* micro-batch gradient, so the
error state stays in one unit whatever the count of a round; the owner weights by the count.

Both collectives are pipelined over the pieces of the shard (``comm_chunks`` or more: engine/parallel/comm.py
``Comm.pieces``, starts aligned to the codec groups and to PIECE_ALIGN): a reducer encodes
piece k+1 while piece k is on the wire and decodes piece k-1 as soon as it has arrived; a
gatherer sends each piece of the new shard as soon as the optimizer has produced it
(``begin``/``push``/``finish``, see engine/strategies/sharded.py). Each piece of a row is a
segment [payload | scales] (the reducer's first piece also carries the sender's count), so the
bytes on the wire are the same for any number of pieces, and every value goes through the same
arithmetic in the same order: the results do not depend on the pieces. On CPU the encode and
decode loops run in acco_loco/kernels.py's fused kernels where acco_loco/kernel_policy.py says they apply (int codecs with fp32
scales, round-to-nearest, int8 error storage), with the same bits as the torch code beside them;
the send/receive/output buffers are kept and reused every round.

The delta parameter all-gather sends Q(master_new - theta') where theta' is what every replica
holds; every replica, the owner included, adds the same decoded delta, so replicas stay
bit-identical and the owner's exact fp32 master carries any error into the next delta.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from acco_loco import compiled, kernel_policy, kernels
from acco_loco.feedback import ErrorFeedback
from acco_loco.registry import WIRE_CODECS, GradCodecSpec, parse_codecs

from ..core.rounds import Reduced
from ..runtime.host import nonfinite_flag, nonfinite_rows, nonfinite_rows_parts
from ..strategies.spec import resolve_error_after_skip
from .comm import Comm


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret received bytes as ``dtype``; a slice at an odd offset (sign1's payload is
    1/8 byte a value) is copied first, since a view needs the offset aligned to the dtype."""
    if not raw.is_contiguous() or raw.storage_offset() % dtype.itemsize:
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.view(dtype)


DECODE_BLOCK_VALUES = 1 << 24  # fp32 values decoded at once (64 MB): rows are decoded in blocks


def _decoded_rows(codec, rows: torch.Tensor, p: int, s: int, numel: int):
    """(first row, end row, their decoded pieces as (rows, numel) fp32) for blocks of the received
    ``rows`` (payload ``[:p]``, scales ``[p:p + s]`` each): one decode per block instead of one per
    row. Decoding is per group, so a block's concatenated rows decode to the rows' own values."""
    block = max(1, DECODE_BLOCK_VALUES // max(1, numel))
    for j0 in range(0, rows.shape[0], block):
        j1 = min(rows.shape[0], j0 + block)
        out = torch.empty((j1 - j0) * numel, dtype=torch.float32, device=rows.device)
        scales = _bytes_as(rows[j0:j1, p:p + s], codec.scale_dtype).reshape(-1)
        codec.decode(rows[j0:j1, :p].contiguous().view(-1), scales, out=out)
        yield j0, j1, out.view(j1 - j0, numel)


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.contiguous().view(torch.uint8)


_SEGMENTS: dict = {}


def _segments(codec, comm: Comm, shard: int) -> list[tuple[int, int, int, int]]:
    """The pieces of a shard (``Comm.pieces``, starts on codec groups): (a, b, payload bytes,
    scale bytes) of values [a, b)."""
    group = getattr(codec, "group_size", 1)
    bounds = comm.pieces(shard, group)
    key = (codec.name, group, codec.scale_dtype, shard, len(bounds))
    if key not in _SEGMENTS:
        _SEGMENTS[key] = [(a, b, codec.payload_bytes(b - a), codec.scale_bytes(b - a)) for a, b in bounds]
    return _SEGMENTS[key]


class _Output:
    """The reducer's own output buffer, kept and reused every round; a caller that keeps a sum
    past the next round (ACCO's estimate half) passes a buffer of its own instead."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def get(self, shard: int, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
        if out is not None:
            return out
        buf = self._buf
        if buf is None or buf.numel() != shard or buf.device != device:
            buf = self._buf = torch.empty(shard, dtype=torch.float32, device=device)
        return buf


# ------------------------------------------------------------------------ gradient reducers
class PlainGrads:
    """Uncompressed reduce-scatter in the gradient's dtype, summed in fp32."""

    feedback = None

    def __init__(self) -> None:
        self._output = _Output()

    def reduce(self, comm: Comm, full: torch.Tensor, count: int, out: torch.Tensor | None = None) -> Reduced:
        """``out``: where the sum goes (default: the reducer's own buffer, overwritten next round)."""
        shard = self._output.get(full.numel() // comm.world_size, full.device, out)
        return Reduced(comm.reduce_scatter_sum(full, shard))  # the round checks the gradient itself

    def begin_step(self) -> None:
        pass

    def end_step(self, committed_step: int, skipped: bool) -> None:
        pass

    def state_dict(self, mid_step: bool) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        pass


class CompressedGrads:
    """One worker's compensated, quantized reduce-scatter."""

    def __init__(self, spec: GradCodecSpec, numel: int, world: int, group_size: int, scale_dtype: str,
                 beta: float, reset_period: int, storage: str, device: torch.device, stochastic: bool, seed: int,
                 after_skip: str = "rollback"):
        self.codec = spec.make_wire(group_size, scale_dtype)
        self.after_skip = after_skip  # 'rollback' (a copy of the error, taken at each step's start) or 'reset'
        self.world = world
        beta_arg = None if spec.feedback != "loco" else beta
        self.feedback = ErrorFeedback(spec.feedback, numel, beta=beta_arg, reset_period=reset_period,
                                      storage=storage, group_size=group_size, device=device)
        self.generator = None
        if stochastic:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)
        fb = self.feedback
        # the fused CPU kernels: deterministic rounding, and an int8 error state in the codec's groups
        self.fused = kernel_policy.reducer(self.codec, fb, self.generator, device)
        self.compiled = compiled.available(device) and self.generator is None
        self._output = _Output()
        self._weight: torch.Tensor | None = None

    def reduce(self, comm: Comm, full: torch.Tensor, count: int, out: torch.Tensor | None = None) -> Reduced:
        """fp32 sum over workers of count_w * deQ(mean_w) for this rank's shard (into ``out``
        when given), and whether ``full`` held a NaN/Inf, found on the way through it.

        Pipelined: piece k of every destination's shard is encoded and put on the wire, then
        piece k-1, which is on the wire meanwhile, is decoded on arrival."""
        n, codec, dev = self.world, self.codec, full.device
        shard = full.numel() // n
        segs = _segments(codec, comm, shard)
        fused = (self.fused and kernel_policy.fits(full)
                 and all(p % 4 == 0 for _, _, p, _ in segs))  # the scales land word-aligned
        sends, recvs = [], []
        # kept rows: piece 0 (it carries every sender's count, read by every decode) and two slots
        # the later pieces take in turn (piece k's rows are free once piece k - 2 is decoded),
        # so the rows held do not grow with the pieces; stochastic rounding encodes every piece
        # before the first is sent and keeps them all
        turns = self.generator is None and len(segs) > 3
        width = max((p + s for _, _, p, s in segs[1:]), default=0)
        for k, (a, b, p, s) in enumerate(segs):
            shape = (n, p + s + (4 if k == 0 else 0))  # the first piece ends with the sender's count
            if turns and k > 0:
                slot = 1 + (k - 1) % 2
                sends.append(comm.buffer(("grads.send", slot), (n * width,), torch.uint8, dev)[:n * shape[1]].view(shape))
                recvs.append(comm.buffer(("grads.recv", slot), (n * width,), torch.uint8, dev)[:n * shape[1]].view(shape))
                continue
            sends.append(comm.buffer(("grads.send", k), shape, torch.uint8, dev))
            recvs.append(comm.buffer(("grads.recv", k), shape, torch.uint8, dev))
        p0, s0 = segs[0][2], segs[0][3]
        # the sender's count as 4 bytes: a kept device buffer filled in place (no host-to-device copy)
        if self._weight is None or self._weight.device != torch.device(dev):
            self._weight = torch.zeros(1, dtype=torch.float32, device=dev)
        weight = self._weight.fill_(float(count)).view(torch.uint8)
        sends[0][:, p0 + s0:].copy_(weight.view(1, 4).expand(n, 4))
        out = self._output.get(shard, dev, out)
        fb = self.feedback
        with fb.lent_to_kernel(fused, update=count > 0) as (codes, escales, zero):
            bad = self._send_and_sum(comm, full, count, fused, segs, sends, recvs, out, codes, escales, zero)
        if fused:  # the kernels' flag is a host bool: a 0-d tensor from a number (CPU: no copy)
            bad = torch.tensor(float(bad), dtype=torch.float64, device=dev)
        return Reduced(out, bad)

    def _send_and_sum(self, comm, full, count, fused, segs, sends, recvs, out, codes, escales, zero):
        """Encode each piece for every destination, put it on the wire, decode and sum the
        pieces received; returns whether ``full`` held a NaN/Inf (the kernels': a bool; else a flag)."""
        n, codec, shard = self.world, self.codec, full.numel() // self.world
        fb = self.feedback
        with ExitStack() as stack:
            if fused:
                bad = False
                group, bits, beta = codec.group_size, codec.bits, fb.beta if fb.active else 0.0
                xp = full.data_ptr()
                cp, ep = (None, None) if codes is None else (codes.data_ptr(), escales.data_ptr())
            else:
                # torch: each destination's piece on its own (temporaries one piece long, never
                # the gradient's size), compiled into a few kernels on a GPU with Triton
                # (acco_loco/compiled.py); stochastic rounding draws in buffer order (each row's
                # pieces in turn), so every piece is encoded before the first is sent
                bad = nonfinite_flag(full)
                run = compiled.compress_piece if self.compiled else None
                piece = stack.enter_context(fb.in_pieces(codec, self.generator, update=count > 0, run=run))
                if self.generator is not None:
                    for j in range(n):
                        for k in range(len(segs)):
                            self._encode_into(piece, full, count, j, segs[k], sends[k])
            pending = []
            for k, (a, b, p, s) in enumerate(segs):
                send = sends[k]
                if fused:  # piece k of every destination's shard, rows [payload | scales] of the send buffer
                    bad |= kernels.encode(xp + 4 * a, n, shard, b - a, max(count, 1), bits, group, send.data_ptr(),
                                          send.shape[1], p, None if cp is None else cp + a,
                                          None if ep is None else ep + 4 * (a // group), zero, count > 0, beta)
                elif self.generator is None:
                    for j in range(n):
                        self._encode_into(piece, full, count, j, segs[k], send)
                pending.append((k, comm.all_to_all_start(recvs[k], send)))
                if len(pending) > 1:  # decode the piece before while this one is on the wire
                    self._decode(pending.pop(0), segs, recvs, out, fused)
            for item in pending:
                self._decode(item, segs, recvs, out, fused)
        return bad

    def _encode_into(self, piece, full: torch.Tensor, count: int, j: int, seg, send: torch.Tensor) -> None:
        """Row j of ``send`` = [payload | scales] of destination j's piece ``seg`` of this worker's
        compensated mean gradient (``piece``: the error feedback's pass, engine-side of compress)."""
        a, b, p, s = seg
        lo = j * (full.numel() // self.world)
        payload, scales = piece(full[lo + a:lo + b].to(torch.float32, copy=True).div_(max(count, 1)), lo + a)
        send[j, :p].copy_(payload)
        send[j, p:p + s].copy_(_scale_bytes(scales))

    def _decode(self, item, segs, recvs, out: torch.Tensor, fused: bool) -> None:
        """out[a:b] = sum over rows j (in order) of w_j * deQ(row j's piece)."""
        k, work = item
        if work is not None:
            work.wait()
        a, b, p, s = segs[k]
        recv, codec = recvs[k], self.codec
        wpos = segs[0][2] + segs[0][3]
        target = out[a:b]
        if fused:
            kernels.decode_sum(recv.data_ptr(), recv.shape[0], recv.shape[1], p, recvs[0].data_ptr() + wpos,
                               recvs[0].shape[1], b - a, codec.bits, codec.group_size, target.data_ptr())
            return
        weights = _bytes_as(recvs[0][:, wpos:wpos + 4], torch.float32).view(-1)  # stays on the device
        target.zero_()
        for j0, j1, parts in _decoded_rows(codec, recv, p, s, b - a):
            for j in range(j1 - j0):  # in row order, one addcmul each: the bits of one row at a time
                target.addcmul_(parts[j], weights[j0 + j])

    def begin_step(self) -> None:
        if self.after_skip == "rollback":
            self.feedback.mark()  # a skipped step goes back here: it must leave no error behind

    def end_step(self, committed_step: int, skipped: bool) -> None:
        if skipped:  # it must leave no error behind: back to the step's mark, or none at all ('reset')
            self.feedback.rollback() if self.feedback.marked else self.feedback.reset()
        self.feedback.on_committed_step(committed_step)

    def state_dict(self, mid_step: bool) -> dict[str, torch.Tensor]:
        """The error state; between the rounds of a step also the step's mark (a skipped
        commit after a resume must still roll back to it)."""
        out = {f"feedback.{k}": v for k, v in self.feedback.state_dict().items()}
        if mid_step and self.after_skip == "rollback":
            out.update({f"feedback_mark.{k}": v for k, v in self.feedback.mark_state_dict().items()})
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        fb = {k[len("feedback."):]: v for k, v in tensors.items() if k.startswith("feedback.")}
        if not fb:
            raise ValueError(f"{where} holds no error-feedback state but the gradient codec needs it")
        self.feedback.load_state_dict(fb)
        mark = {k[len("feedback_mark."):]: v for k, v in tensors.items() if k.startswith("feedback_mark.")}
        if mark and self.after_skip == "rollback":
            self.feedback.load_mark_state_dict(mark)
        else:  # no mark to go back to in this step: a skipped commit resets the error instead
            self.feedback.forget_mark()


# ------------------------------------------------------------------------ parameter gatherers
class _Gatherer:
    """A pipelined all-gather of a new shard into ``held`` (the full buffer every replica holds):
    ``begin`` gives the pieces, ``push(k)`` sends piece k of the new shard as soon as it is
    ready, ``finish`` waits, checks and installs; ``gather`` does the three in a row."""

    def gather(self, comm: Comm, new_shard: torch.Tensor, held: torch.Tensor) -> list[int]:
        """Fill ``held``; returns the ranks whose gathered values are not finite."""
        for k in range(len(self.begin(comm, held))):
            self.push(comm, k, new_shard)
        return self.finish(comm, held)

    def begin(self, comm: Comm, held: torch.Tensor) -> list[tuple[int, int]]:
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

    def begin(self, comm: Comm, held: torch.Tensor) -> list[tuple[int, int]]:
        self._held = held
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
    """The delta all-gather of new parameter shards against what every replica holds."""

    def __init__(self, name: str, world: int, group_size: int, scale_dtype: str):
        self.codec = WIRE_CODECS[name](group_size, scale_dtype)
        self.world = world
        self.fused = kernel_policy.wire_codec(self.codec)

    def _pieces(self, comm: Comm):
        return _segments(self.codec, comm, self._shard)

    def _fused_for(self, held: torch.Tensor, *tensors: torch.Tensor) -> bool:
        return self.fused and kernel_policy.fits(held, *tensors)

    def push(self, comm: Comm, k: int, new_shard: torch.Tensor, start: int = 0,
             held: torch.Tensor | None = None) -> None:
        """Send piece k of Q(new_shard - mine), mine = this rank's shard of ``held``; ``new_shard``'s
        first value is the shard's ``start`` (it is read here, encoded into the piece's own send buffer)."""
        held = self._held if held is None else held
        a, b, p, s = self._bounds[k]
        codec, dev = self.codec, held.device
        send = comm.buffer(("params.send", k), (p + s,), torch.uint8, dev)
        recv = comm.buffer(("params.recv", k), (comm.world_size * (p + s),), torch.uint8, dev)
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

    def begin(self, comm: Comm, held: torch.Tensor) -> list[tuple[int, int]]:
        self._held, self._fused_now = held, None
        return super().begin(comm, held)

    def finish(self, comm: Comm, held: torch.Tensor) -> list[int]:
        """Add the deltas into ``held`` once every piece is in and all are finite; else return the
        ranks whose were not, ``held`` untouched on every replica (all see the same rows)."""
        return self.arrived(comm) or self.apply(comm, held) or []

    def arrived(self, comm: Comm) -> list[int]:
        """Wait for every piece; the ranks whose new shard was not finite (``apply`` if none)."""
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
        n, shard, codec = comm.world_size, self._shard, self.codec
        got, self._got = self._got, None
        fused = self._fused_for(held)
        for a, b, p, rows, scales in got:
            if fused and p % 4 == 0:  # every row's piece into its place in held
                kernels.decode_add(rows.data_ptr(), n, rows.shape[1], p, b - a, codec.bits, codec.group_size,
                                   held.data_ptr() + 4 * a, shard)
                continue
            for j0, j1, deltas in _decoded_rows(codec, rows, p, rows.shape[1] - p, b - a):
                view = held.view(n, shard)[j0:j1, a:b]  # each row's piece in its replica's shard
                view.add_(deltas) if held.dtype == torch.float32 else view.copy_(view.to(torch.float32).add_(deltas))


def make_collectives(cfg, padded: int, world: int, device: torch.device, rank: int, compute_dtype: torch.dtype):
    """(gradient reducer, parameter gatherer) for an EngineConfig."""
    if torch.device(device).type == "cpu":
        kernels.available()  # build and check the fused kernels now, never inside a round
    codecs = parse_codecs(cfg.codec, cfg.param_codec, cfg.group_size, cfg.scale_dtype)
    grads = PlainGrads() if codecs.grad is None else CompressedGrads(
        codecs.grad, padded, world, cfg.group_size, cfg.scale_dtype, cfg.loco_beta, cfg.reset_period,
        cfg.error_storage, device, cfg.stochastic_rounding, seed=cfg.seed * 65537 + rank,
        after_skip=resolve_error_after_skip(cfg.error_after_skip, torch.device(device).type == "cuda"))
    if codecs.param_deltas:
        return grads, DeltaParams(cfg.param_codec, world, cfg.group_size, cfg.scale_dtype)
    wire = compute_dtype if cfg.param_codec == "auto" else getattr(torch, cfg.param_codec)
    return grads, CastParams(wire)
