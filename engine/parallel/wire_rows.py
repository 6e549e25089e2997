"""The rows a compressed collective sends (engine/parallel/collectives.py's reducers,
engine/parallel/gatherers.py's delta gather): each piece of a row a segment [payload | scales],
the pieces of a shard starting on codec groups, and their decode in blocks."""

from __future__ import annotations

import torch

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
