"""Two options of SparseLoCo's pseudo-gradient codec that the public templar code has (tplr-ai/templar,
src/tplr/compress.py; docs/sparseloco.md lists every difference), as pure tensor math:

* **tiles per tensor** (:class:`TiledTopK`): instead of cutting the flat buffer into chunks that
  run across tensors, every tensor of 2 or more dims is viewed as a matrix (its first dim by the
  product of the others) and cut into ``t x t`` tiles (``t^2`` = the chunk, 64 x 64 for 4096;
  edge tiles padded with zeros, which are never sent); each tile is one chunk of
  :class:`~acco_loco.topk_codec.TopKCodec` (its values row by row). 1-D tensors (norms, biases)
  are sent whole, as fp32. Payload: the top-k payload of the tiles, then the 1-D values::

      payload_bytes = TopKCodec(t^2).payload_bytes(tiles x t^2) + 4 x (values of 1-D tensors)

* **median-norm clip** (:func:`~acco_loco.topk_codec.clip_to_median`, with :func:`tensor_segments`): before the contributions are combined, each
  peer's decoded values on each tensor are scaled by ``min(1, median_r ||v_r|| / (||v_r|| + 1e-8))``,
  the median over the peers that take part (``torch.median``: the lower of the two middle values
  for an even count, as templar's), so no single peer moves a tensor further than the median peer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .topk_codec import TopKCodec

class TiledTopK:
    """Top-k over ``t x t`` tiles of each tensor of a flat buffer of ``numel`` values holding
    tensors of ``shapes`` in order from offset 0 (positions after them are padding, never sent).
    The same ``encode_with_decoded`` / ``decode_sparse`` / ``decode`` / ``payload_bytes`` as
    TopKCodec, so :func:`~acco_loco.topk_codec.aggregate` combines its payloads alike."""

    def __init__(self, shapes: list[tuple[int, ...]], numel: int, tile: int, density: float, bits: int):
        if sum(math.prod(s) for s in shapes) > numel:
            raise ValueError(f"the tensors hold {sum(math.prod(s) for s in shapes)} values, more than the "
                             f"buffer's {numel}")
        self.codec = TopKCodec(tile * tile, density, bits)
        self.numel = numel
        tiles, whole, offset = [], [], 0
        for shape in shapes:
            n = math.prod(shape)
            if len(shape) >= 2 and n > 0:
                rows, cols = shape[0], n // shape[0]
                grid = torch.full((-(-rows // tile) * tile, -(-cols // tile) * tile), -1, dtype=torch.int64)
                grid[:rows, :cols] = torch.arange(offset, offset + n).view(rows, cols)
                r, c = grid.shape[0] // tile, grid.shape[1] // tile
                tiles.append(grid.view(r, tile, c, tile).permute(0, 2, 1, 3).reshape(-1))  # tile by tile
            else:
                whole.append(torch.arange(offset, offset + n))
            offset += n
        empty = torch.zeros(0, dtype=torch.int64)
        self.gather = torch.cat(tiles) if tiles else empty  # flat position of each tile slot; -1 = padding
        self.whole = torch.cat(whole) if whole else empty  # flat positions sent as fp32

    def to(self, device) -> "TiledTopK":
        self.gather, self.whole = self.gather.to(device), self.whole.to(device)
        return self

    def payload_bytes(self, numel: int | None = None) -> int:
        return self.codec.payload_bytes(self.gather.numel()) + 4 * self.whole.numel()

    def _tiles(self, x: Tensor) -> Tensor:
        return torch.where(self.gather >= 0, x[self.gather.clamp(min=0)], torch.zeros((), dtype=x.dtype,
                                                                                        device=x.device))

    def encode_with_decoded(self, x: Tensor, check_finite: bool = True) -> tuple[Tensor, Tensor]:
        """(payload, what a receiver decodes from it as a dense fp32 tensor like ``x``)."""
        if x.numel() != self.numel:
            raise ValueError(f"this layout encodes {self.numel} values, got {x.numel()}")
        payload, tiles = self.codec.encode_with_decoded(self._tiles(x.to(torch.float32)), check_finite)
        out = torch.zeros(self.numel, dtype=torch.float32, device=x.device)
        real = self.gather >= 0
        out[self.gather[real]] = tiles[real]
        whole = x[self.whole].to(torch.float32)
        out[self.whole] = whole
        return torch.cat([payload, whole.contiguous().view(torch.uint8)]), out

    def decode_sparse(self, payload: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        """(flat positions, fp32 values) the payload carries; positions unique and below ``numel``."""
        if payload.numel() != self.payload_bytes():
            raise ValueError(f"a tiled top-k payload is {self.payload_bytes()} bytes, got {payload.numel()}")
        split = self.codec.payload_bytes(self.gather.numel())
        slots, values = self.codec.decode_sparse(payload[:split], self.gather.numel())
        pos = self.gather[slots]
        real = pos >= 0
        whole = payload[split:].clone().view(torch.float32)
        return torch.cat([pos[real], self.whole]), torch.cat([values[real], whole])

    def decode(self, payload: Tensor, numel: int) -> Tensor:
        pos, values = self.decode_sparse(payload, numel)
        return torch.zeros(numel, dtype=torch.float32, device=payload.device).index_put_((pos,), values)


def tensor_segments(shapes: list[tuple[int, ...]], numel: int, device=None) -> tuple[Tensor, int]:
    """(the tensor index of every flat position, the number of segments): tensor i's values are
    segment i; the buffer's padding after them is one more segment."""
    sizes = [math.prod(s) for s in shapes]
    ids = torch.repeat_interleave(torch.arange(len(sizes) + 1), torch.tensor(sizes + [numel - sum(sizes)]))
    return ids.to(device), len(sizes) + 1
