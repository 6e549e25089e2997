"""A half-precision cast as a wire codec: 2 bytes a value, no scales. The smallest codec that
speaks the codec interface (encode -> payload bytes + scales, decode, bytes per value); it shows
what a new codec needs and nothing more. ``CastCodec`` is any such cast (``wire_dtype``)."""

from __future__ import annotations

import torch
from torch import Tensor


class CastCodec:
    """Each value cast to ``wire_dtype`` (round to nearest even) and sent as its bytes."""

    name = "fp16"
    bits = 16
    wire_dtype = torch.float16
    group_size = 1  # no groups: any length, no alignment

    def __init__(self) -> None:
        self.scale_dtype = torch.float32

    def payload_bytes(self, numel: int) -> int:
        return self.bits // 8 * numel

    def scale_bytes(self, numel: int) -> int:
        return 0

    def wire_bytes(self, numel: int) -> int:
        return self.payload_bytes(numel)

    def encode(self, x: Tensor, generator: torch.Generator | None = None, *,
               check_finite: bool = True) -> tuple[Tensor, Tensor]:
        """(payload: the cast values as bytes, scales: empty). Values beyond the wire dtype's range
        overflow to Inf, which the engine's finiteness checks then see."""
        if check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{self.name}.encode input holds NaN or Inf")
        payload = x.to(self.wire_dtype).view(torch.uint8)
        return payload, torch.empty(0, dtype=self.scale_dtype, device=x.device)

    def encode_with_decoded(self, x: Tensor, generator: torch.Generator | None = None, *,
                            check_finite: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        payload, scales = self.encode(x, generator, check_finite=check_finite)
        return payload, scales, self.decode(payload, scales)

    def decode(self, payload: Tensor, scales: Tensor, out: Tensor | None = None,
               accumulate: bool = False) -> Tensor:
        values = payload.contiguous().view(self.wire_dtype)
        if out is None:
            return values.to(torch.float32)
        return out.add_(values) if accumulate else out.copy_(values)


class Fp16Codec(CastCodec):
    """The built-in ``fp16`` wire codec."""
