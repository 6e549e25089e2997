"""A half-precision cast as a wire codec: 2 bytes a value, no scales. The smallest codec that
speaks the codec interface (encode -> payload bytes + scales, decode, bytes per value); it shows
what a new codec needs and nothing more."""

from __future__ import annotations

import torch
from torch import Tensor


class Fp16Codec:
    name = "fp16"
    bits = 16
    group_size = 1  # no groups: any length, no alignment

    def __init__(self) -> None:
        self.scale_dtype = torch.float32

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel

    def scale_bytes(self, numel: int) -> int:
        return 0

    def wire_bytes(self, numel: int) -> int:
        return self.payload_bytes(numel)

    def encode(self, x: Tensor, generator: torch.Generator | None = None, *,
               check_finite: bool = True) -> tuple[Tensor, Tensor]:
        """(payload: the fp16 values as bytes, scales: empty). Values beyond fp16's range overflow
        to Inf, which the engine's finiteness checks then see."""
        if check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError("fp16.encode input holds NaN or Inf")
        payload = x.to(torch.float16).view(torch.uint8)
        return payload, torch.empty(0, dtype=self.scale_dtype, device=x.device)

    def encode_with_decoded(self, x: Tensor, generator: torch.Generator | None = None, *,
                            check_finite: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        payload, scales = self.encode(x, generator, check_finite=check_finite)
        return payload, scales, self.decode(payload, scales)

    def decode(self, payload: Tensor, scales: Tensor, out: Tensor | None = None,
               accumulate: bool = False) -> Tensor:
        values = payload.contiguous().view(torch.float16)
        if out is None:
            return values.to(torch.float32)
        return out.add_(values) if accumulate else out.copy_(values)
