"""acco_loco/topk_pieces.py: the top-k round a piece of whole chunks at a time gives the whole round's
bits (TopKCodec.encode_with_decoded's payload and decoded values, aggregate's result under every rule
and the median clip), on sizes that end inside a chunk and inside a piece."""

from __future__ import annotations

import pytest
import torch

from acco_loco.tiled_topk import tensor_segments
from acco_loco.topk_codec import TopKCodec, aggregate
from acco_loco.topk_pieces import (
    PieceAggregate,
    PieceEncoder,
    chunk_pieces,
    decode_piece,
)


@pytest.mark.parametrize("numel,chunk,density,bits,piece", [
    (10_000, 64, 0.05, 2, 1024),   # pieces of 16 chunks, the last piece and chunk partial
    (4_099, 64, 0.1, 4, 100),      # a piece below 8 chunks rounds up to 8
    (3_000, 30, 0.1, 1, 480),      # chunk not a power of two: 5-bit indices
    (512, 64, 0.02, 8, 1 << 22),   # one piece
])
def test_pieces_encode_and_combine_as_the_whole(numel, chunk, density, bits, piece):
    codec, gen = TopKCodec(chunk, density, bits), torch.Generator().manual_seed(numel)
    pieces = chunk_pieces(numel, chunk, piece)
    assert pieces[0][0] == 0 and pieces[-1][1] == numel
    assert all(b - a == pieces[0][1] for a, b in pieces[:-1]) and pieces[0][1] % (8 * chunk) == 0
    payloads = []
    for _ in range(3):
        x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen)
        payload, decoded = codec.encode_with_decoded(x)
        enc = PieceEncoder(codec)
        dense = torch.cat([enc.add(x[a:b]) for a, b in pieces])
        assert torch.equal(enc.payload(), payload) and torch.equal(dense, decoded)
        for a, b in pieces:
            pos, values = decode_piece(codec, payload, numel, a, b)
            want_pos, want_values = codec.decode_sparse(payload, numel)
            inside = (want_pos >= a) & (want_pos < b)
            assert torch.equal(pos + a, want_pos[inside]) and torch.equal(values, want_values[inside])
        payloads.append(payload)
    gathered = torch.stack(payloads)
    shapes = [(numel // 3,), (numel // 3 - 7,)]
    clip = tensor_segments(shapes, numel)
    for rule in ("mean", "contributors"):
        for weights in ([0.5, 0.25, 0.25], [0.5, 0.0, 0.5]):
            for cut in (None, clip):
                whole = aggregate(codec, gathered, weights, numel, rule, cut)
                agg = PieceAggregate(codec, gathered, weights, numel, rule, cut, piece)
                got = torch.cat([agg.piece(a, b) for a, b in pieces])
                assert torch.equal(got, whole), (rule, weights, cut is not None)
                if cut is not None:  # the clip acted: some row was scaled down
                    assert not torch.equal(whole, aggregate(codec, gathered, weights, numel, rule)), rule


def test_no_row_with_weight_gives_zeros():
    codec = TopKCodec(64, 0.1, 2)
    payload = codec.encode(torch.randn(1000))
    agg = PieceAggregate(codec, torch.stack([payload, payload]), [0.0, 0.0], 1000, "mean", None, 512)
    assert torch.equal(agg.piece(0, 512), torch.zeros(512))
    with pytest.raises(ValueError, match="aggregation rule"):
        PieceAggregate(codec, payload[None], [1.0], 1000, "median")
