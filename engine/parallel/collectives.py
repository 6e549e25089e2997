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

The parameter gatherers (the all-gather of the new shards, plain or as low-bit deltas) are in
engine/parallel/gatherers.py; make_collectives builds one of each.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from acco_loco import compiled, kernel_policy, kernels
from acco_loco.feedback import ErrorFeedback
from acco_loco.registry import GradCodecSpec, parse_codecs

from ..core.rounds import Reduced
from ..runtime.host import nonfinite_flag
from ..strategies.spec import resolve_error_after_skip
from .comm import Comm
from .gatherers import CastParams, DeltaParams
from .wire_rows import _bytes_as, _decoded_rows, _scale_bytes, _segments


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

    def drop_buffers(self) -> None:
        """Free the kept output (its next ``reduce`` makes it again)."""
        self._output = _Output()

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
