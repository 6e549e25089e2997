"""SparseLoCo's templar options as math (acco_loco/tiled_topk.py, topk_codec.clip_to_median) against
float64 references written out with plain loops: tiles per tensor with 1-D tensors whole, and the
median-norm clip of each peer's contribution."""

from __future__ import annotations

import math

import pytest
import torch

from acco_loco.outer import accumulate_error
from acco_loco.tiled_topk import TiledTopK, tensor_segments
from acco_loco.topk_codec import TopKCodec, aggregate

SHAPES = [(10, 7), (5,), (3, 2, 6), (9, 4), (1,)]
PAD = 3  # the flat buffer's padding after the tensors


def _reference_chunk(values: list[float], k: int, bits: int) -> list[float]:
    """One chunk in float64: the k largest |x| (lower index first among equals), sign x the middle of
    one of 2^(bits-1) uniform magnitude levels over [lo, hi] of the kept values; 0 elsewhere."""
    keep = sorted(range(len(values)), key=lambda j: (-abs(values[j]), j))[:k]
    lo, hi = min(abs(values[j]) for j in keep), max(abs(values[j]) for j in keep)
    levels = 2 ** (bits - 1)
    step = (hi - lo) / levels
    out = [0.0] * len(values)
    for j in keep:
        q = 0 if step == 0 else min(levels - 1, max(0, math.floor((abs(values[j]) - lo) / step)))
        out[j] = (-1 if values[j] < 0 else 1) * (lo + (q + 0.5) * step)
    return out


def reference_tiles(x: torch.Tensor, shapes, tile: int, k: int, bits: int) -> torch.Tensor:
    """What the tiled codec sends of x, decoded, in float64: each tensor of 2+ dims as a matrix (first
    dim x the rest) in tile x tile tiles (zero-padded at the edges, the padding dropped after), 1-D
    tensors as they are, the buffer's padding never."""
    x = x.double()
    out = torch.zeros_like(x)
    offset = 0
    for shape in shapes:
        n = math.prod(shape)
        if len(shape) == 1:
            out[offset:offset + n] = x[offset:offset + n]
        else:
            rows, cols = shape[0], n // shape[0]
            matrix = x[offset:offset + n].view(rows, cols)
            target = out[offset:offset + n].view(rows, cols)
            for r0 in range(0, rows, tile):
                for c0 in range(0, cols, tile):
                    cells = [(r, c) for r in range(r0, r0 + tile) for c in range(c0, c0 + tile)]  # row by row
                    values = [matrix[r, c].item() if r < rows and c < cols else 0.0 for r, c in cells]
                    for (r, c), v in zip(cells, _reference_chunk(values, k, bits)):
                        if r < rows and c < cols:
                            target[r, c] = v
        offset += n
    return out


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_tiles_per_tensor_match_the_float64_reference(bits, seed):
    numel = sum(math.prod(s) for s in SHAPES) + PAD
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    x[3] = x[4] = -x[5]  # equal magnitudes inside one tile: the lower index wins
    x[-PAD:] = 0.0
    codec = TiledTopK(SHAPES, numel, tile=4, density=0.25, bits=bits)  # k = 4 of each 16-value tile
    payload, sent = codec.encode_with_decoded(x)
    want = reference_tiles(x, SHAPES, 4, 4, bits)
    assert torch.equal(sent != 0, want != 0)  # the same positions
    assert torch.allclose(sent.double(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(codec.decode(payload, numel), sent)  # what a receiver decodes
    tiles = 3 * 2 + 1 * 3 + 3 * 1  # (10,7): 3x2 tiles; (3,2,6) as 3x12: 1x3; (9,4): 3x1
    assert payload.numel() == codec.payload_bytes() == TopKCodec(16, 0.25, bits).payload_bytes(tiles * 16) + 4 * 6
    whole = [i for i, v in enumerate(sent.tolist()) if i in range(70, 75) or i == numel - PAD - 1]
    assert torch.equal(sent[whole], x[whole])  # 1-D tensors (5 values, 1 value) sent whole


def test_tiles_differ_from_flat_chunks_and_respect_tensor_edges():
    numel = sum(math.prod(s) for s in SHAPES) + PAD
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    tiled = TiledTopK(SHAPES, numel, tile=4, density=0.25, bits=2).encode_with_decoded(x)[1]
    flat = TopKCodec(16, 0.25, 2).encode_with_decoded(x)[1]
    assert not torch.equal(tiled != 0, flat != 0)
    assert torch.equal(tiled[-PAD:], torch.zeros(PAD))  # the buffer's padding is never sent
    with pytest.raises(ValueError, match="more than the buffer"):
        TiledTopK([(100, 100)], 50, 4, 0.25, 2)


def _reference_clipped_mean(dense: list[torch.Tensor], weights, shapes, numel) -> torch.Tensor:
    """Float64: each peer's decoded values scaled per tensor by min(1, median norm / (norm + 1e-8))
    (the lower median for an even count, as torch.median), then sum_r w_r v_r."""
    bounds, offset = [], 0
    for s in shapes:
        bounds.append((offset, offset + math.prod(s)))
        offset += math.prod(s)
    bounds.append((offset, numel))
    out = torch.zeros(numel, dtype=torch.float64)
    scaled = [d.double().clone() for d in dense]
    for a, b in bounds:
        norms = [math.sqrt(sum(v * v for v in d[a:b].double().tolist())) for d in dense]
        median = sorted(norms)[(len(norms) - 1) // 2]
        for r, n in enumerate(norms):
            scaled[r][a:b] *= min(1.0, median / (n + 1e-8))
    for w, v in zip(weights, scaled):
        out += w * v
    return out


@pytest.mark.parametrize("peers", [3, 4])
@pytest.mark.parametrize("layout", ["flat", "tensor"])
def test_median_clip_matches_the_float64_reference(peers, layout):
    numel = sum(math.prod(s) for s in SHAPES) + PAD
    g = torch.Generator().manual_seed(peers)
    codec = TopKCodec(16, 0.25, 2) if layout == "flat" else TiledTopK(SHAPES, numel, 4, 0.25, 2)
    # peers of very different sizes: the large ones are pulled down to the median
    payloads = [codec.encode_with_decoded(torch.randn(numel, generator=g) * (1 + 9 * (r == 0)))[0]
                for r in range(peers)]
    weights = [1 / peers] * peers
    segment = tensor_segments(SHAPES, numel)
    got = aggregate(codec, torch.stack(payloads), weights, numel, "mean", segment)
    want = _reference_clipped_mean([codec.decode(p, numel) for p in payloads], weights, SHAPES, numel)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-7)
    plain = aggregate(codec, torch.stack(payloads), weights, numel, "mean")
    assert (got - plain).abs().max() > 1e-3  # the clip acted (peer 0 is ten times the others)
    # a peer of weight 0 takes no part in the median either
    skipped = aggregate(codec, torch.stack(payloads), [0.0] + [1 / (peers - 1)] * (peers - 1), numel, "mean", segment)
    want_skipped = _reference_clipped_mean([codec.decode(p, numel) for p in payloads[1:]], [1 / (peers - 1)] * (peers - 1),
                                           SHAPES, numel)
    assert torch.allclose(skipped.double(), want_skipped, rtol=1e-5, atol=1e-7)


def test_error_feedback_scale():
    e, d = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    assert torch.equal(accumulate_error(e.clone(), d, 0.9), 0.9 * e + d)
    assert torch.allclose(accumulate_error(e.clone(), d, 0.9, 0.7), 0.9 * e + 0.7 * d, rtol=1e-15)
