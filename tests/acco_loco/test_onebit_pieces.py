"""1-bit Adam's round a piece at a time (acco_loco/onebit.py ``encode_rows``, ``server_round``,
``decode_rows`` with ``piece``) against the whole-buffer functions (``compress_with_error``,
``split_rows``, ``server_average``): the same rows byte for byte and the same errors and decoded
values bit for bit, for pieces of one group, of several, of a shard and past it, and scales whose
bytes start at an odd offset (bf16 scales, one-group rows)."""

from __future__ import annotations

import pytest
import torch

from acco_loco import onebit
from acco_loco.registry import WIRE_CODECS

G = 8  # values per sign1 group


def _case(world: int, size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    numel = world * size
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[[1, numel - 3]] = True
    h = (torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(4)).masked_fill_(mask, 0.0)
    h[G:2 * G] = 0.0  # a group of zeros: sign(0) = +1 with a zero scale
    return h, mask, gen


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world,groups", [(1, 5), (2, 1), (3, 4)])
@pytest.mark.parametrize("piece", [1, G, 2 * G + 3, 3 * G, 1 << 20])
def test_a_round_in_pieces_is_the_whole_buffers_round(scale_dtype, world, groups, piece):
    codec = WIRE_CODECS["sign1"](G, scale_dtype)
    size = groups * G
    h, mask, gen = _case(world, size, seed=world * 100 + groups)
    assert [b - a for a, b in onebit.pieces(size, piece, G)][0] == min(size, max(G, piece // G * G))

    # the worker: its rows and its new error
    payload, scales, want_error = onebit.compress_with_error(h, codec, mask)
    want_rows = onebit.split_rows(payload, scales, world)
    rows = torch.full_like(want_rows, 0xAB)  # every byte must be written
    error = torch.full_like(h, float("nan"))
    onebit.encode_rows(h, codec, mask, rows, error, piece)
    assert torch.equal(rows, want_rows)
    assert torch.equal(error, want_error)

    # an owner: the received rows (here the same worker's rows from `world` senders, each different)
    senders = [onebit.split_rows(*codec.encode(torch.randn(size, generator=gen))[:2], 1)[0] for _ in range(world)]
    received = torch.stack(senders)
    server_error = 0.1 * torch.randn(size, generator=gen)
    own_mask = mask[:size]
    mine = onebit.server_average(received, codec, size).add_(server_error)
    p, s, want_server_error = onebit.compress_with_error(mine, codec, own_mask)
    want_row = onebit.split_rows(p, s, 1)[0]
    row = torch.full_like(want_row, 0xCD)
    new_server_error = torch.full_like(server_error, float("nan"))
    onebit.server_round(received, codec, server_error, own_mask, row, new_server_error, piece)
    assert torch.equal(row, want_row)
    assert torch.equal(new_server_error, want_server_error)

    # every replica: the owners' rows decoded
    want = onebit.decode_rows(want_rows, codec, size, mask, out=torch.empty_like(h), piece=1 << 30)
    got = onebit.decode_rows(want_rows, codec, size, mask, out=torch.full_like(h, float("nan")), piece=piece)
    assert torch.equal(got, want)
    assert not got[mask].any()


def test_the_frozen_denominator_in_place_is_the_new_tensors():
    from acco_loco.optim import OptimizerSpec

    spec = OptimizerSpec(betas=(0.9, 0.999), eps=1e-8)
    v = torch.rand(4 * G)
    want = onebit.frozen_denominator(v, 7, spec)
    got = onebit.frozen_denominator(v, 7, spec, out=v)
    assert got.data_ptr() == v.data_ptr() and torch.equal(got, want)
