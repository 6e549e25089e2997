"""The received rows of a compressed collective are decoded a block of rows at a time (one decode
call per block, not per row) on the torch path: the same values as decoding each row alone, for
every wire codec, with blocks of one row, of several and of all rows."""

from __future__ import annotations

import pytest
import torch

from acco_loco.registry import WIRE_CODECS
from engine.parallel import wire_rows
from engine.parallel.wire_rows import _bytes_as, _decoded_rows, _scale_bytes


def _rows(codec, n: int, numel: int) -> tuple[torch.Tensor, int, int]:
    """n rows laid out as the collectives send them: payload bytes, then the scales' bytes."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        payload, scales = codec.encode(torch.randn(numel, generator=g))
        rows.append(torch.cat([payload, _scale_bytes(scales)]))
    p = payload.numel()
    return torch.stack(rows), p, rows[0].numel() - p


@pytest.mark.parametrize("name", sorted(WIRE_CODECS))
@pytest.mark.parametrize("block_values", [64, 200, 1 << 24])  # one row, three rows, every row per block
def test_blocks_of_rows_decode_to_each_rows_own_values(name, block_values, monkeypatch):
    codec = WIRE_CODECS[name](64, "float32")
    n, numel = 7, 64 * 3
    rows, p, s = _rows(codec, n, numel)
    monkeypatch.setattr(wire_rows, "DECODE_BLOCK_VALUES", block_values)
    blocks = list(_decoded_rows(codec, rows, p, s, numel))
    assert len(blocks) == -(-n // max(1, block_values // numel))
    got = torch.cat([values for _, _, values in blocks])
    for j in range(n):
        alone = codec.decode(rows[j, :p].contiguous(), _bytes_as(rows[j, p:p + s], codec.scale_dtype))
        assert torch.equal(got[j], alone), (name, j)
