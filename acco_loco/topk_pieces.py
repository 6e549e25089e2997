"""SparseLoCo's top-k round a piece of whole chunks at a time, with the same bits as the whole
(acco_loco/topk_codec.py ``TopKCodec.encode_with_decoded`` and ``aggregate``): for an outer state
in host memory, where a full-size temporary per step of the round would not fit (issue 41; the
strategy side is engine/strategies/sparseloco.py, docs/local_steps.md).

Why the pieces give the same bits: the codec's chunks are independent (selection, lo / hi and the
codes of a chunk depend on its values alone), a piece is a whole number of chunks and, but for the
last, a multiple of 8 chunks, so each piece's index and value bit streams end on a byte and the
whole payload's three sections are the pieces' sections joined. Decoding a piece reads its bytes
out of each section. Combining adds the rows in the same order per value as ``aggregate``; the
median clip's per-tensor norms are summed over the pieces in position order (the order
``segment_sums`` takes them in the whole, each piece's added to the running totals) in a first
pass and applied in a second.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .topk_codec import CLIP_EPS, TopKCodec, segment_sums


def chunk_pieces(numel: int, chunk: int, piece: int) -> list[tuple[int, int]]:
    """[a, b) ranges covering ``numel`` values, each a multiple of 8 chunks of ``chunk`` values
    (the last one shorter), about ``piece`` values long (at least 8 chunks)."""
    step = 8 * chunk * max(1, piece // (8 * chunk))
    return [(a, min(numel, a + step)) for a in range(0, numel, step)]


def _sections(codec: TopKCodec, numel: int, a: int, b: int) -> list[tuple[int, int]]:
    """The byte ranges of a whole payload (for ``numel`` values) that hold values [a, b): its indices,
    its value codes, its lo / hi (``a`` a multiple of 8 chunks)."""
    first, n = a // codec.chunk, b - a
    idx0 = first * codec.k * codec.index_bits // 8
    val0 = codec.index_bytes(numel) + first * codec.k * codec.bits // 8
    scale0 = codec.index_bytes(numel) + codec.value_bytes(numel) + 8 * first
    return [(idx0, idx0 + codec.index_bytes(n)), (val0, val0 + codec.value_bytes(n)),
            (scale0, scale0 + codec.scale_bytes(n))]


class PieceEncoder:
    """Encodes a flat tensor piece by piece (:func:`chunk_pieces` order): ``add`` each piece, then
    ``payload`` is the whole tensor's ``TopKCodec.encode`` payload, byte for byte."""

    def __init__(self, codec: TopKCodec):
        self.codec = codec
        self.parts: list[list[Tensor]] = [[], [], []]  # indices, value codes, lo / hi: payload-sized

    def add(self, x: Tensor) -> Tensor:
        """Encode piece ``x`` (fp32, finite); returns what a receiver decodes of it (dense, like ``x``)."""
        c = self.codec
        idx, values = c.select(x, check_finite=False)
        codes, lo, hi = c.quantize(values)
        dense = c._scatter(x.numel(), idx, c.dequantize(codes, lo, hi), x.device)
        packed = c._pack(idx, codes, lo, hi)  # this piece's own payload: its three sections in turn
        for part, (s0, s1) in zip(self.parts, _sections(c, x.numel(), 0, x.numel())):
            part.append(packed[s0:s1].clone())
        return dense

    def payload(self) -> Tensor:
        """The joined payload; the pieces' own are let go (the encoder starts again empty)."""
        joined = torch.cat([t for part in self.parts for t in part])
        self.parts = [[], [], []]
        return joined


def decode_piece(codec: TopKCodec, payload: Tensor, numel: int, a: int, b: int) -> tuple[Tensor, Tensor]:
    """(positions relative to ``a``, fp32 values) that a payload for ``numel`` values carries in
    [a, b) (a piece of :func:`chunk_pieces`): ``codec.decode_sparse``'s, restricted to the piece."""
    own = torch.cat([payload[s0:s1] for s0, s1 in _sections(codec, numel, a, b)])
    return codec.decode_sparse(own, b - a)


class PieceAggregate:
    """``aggregate(codec, payloads, weights, numel, rule, clip)`` a piece at a time: ``piece(a, b)``
    is its values [a, b), the same bits. With the median clip the per-tensor norms of every row are
    summed over all pieces when this is made (a first pass over the payloads)."""

    def __init__(self, codec: TopKCodec, payloads: Tensor, weights: list[float], numel: int,
                 rule: str = "mean", clip: tuple[Tensor, int] | None = None, piece: int = 1 << 22):
        if rule not in ("mean", "contributors"):
            raise ValueError(f"unknown aggregation rule {rule!r}: choose 'mean' or 'contributors'")
        self.codec, self.numel, self.rule, self.clip, self.device = codec, numel, rule, clip, payloads.device
        self.rows = [(row, w) for row, w in zip(payloads, weights) if w != 0]  # aggregate skips weight 0
        self.factor = None
        if clip is not None and self.rows:
            segment, segments = clip
            squares = torch.zeros(len(self.rows), segments, dtype=torch.float32, device=payloads.device)
            for a, b in chunk_pieces(numel, codec.chunk, piece):
                for r, (row, _) in enumerate(self.rows):
                    pos, v = decode_piece(codec, row, numel, a, b)
                    squares[r] = segment_sums(segment[a:b][pos], v * v, squares[r])
            norms = squares.sqrt()
            self.factor = (norms.median(dim=0).values / (norms + CLIP_EPS)).clamp(max=1.0)

    def piece(self, a: int, b: int) -> Tensor:
        out = torch.zeros(b - a, dtype=torch.float32, device=self.device)
        senders = torch.zeros_like(out) if self.rule == "contributors" else None
        for r, (row, weight) in enumerate(self.rows):
            pos, values = decode_piece(self.codec, row, self.numel, a, b)
            if self.factor is not None:
                values = values * self.factor[r][self.clip[0][a:b][pos]]
            out.index_add_(0, pos, values * weight)  # unique positions: one plain add each, any order
            if senders is not None:
                senders.index_add_(0, pos, torch.full_like(values, weight))
        if senders is not None:
            out = torch.where(senders > 0, out / torch.where(senders > 0, senders, torch.ones_like(senders)), out)
        return out
