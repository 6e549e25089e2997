"""A toy wire codec added from outside the package: one file plus one registration line (the
last line here). It sends each value as bfloat16 (round to nearest even): 2 bytes a value, no
scales, no groups. tests/engine/test_toy_codec.py trains with it against a float64 reference."""

from __future__ import annotations

import torch
from torch import Tensor

from acco_loco.registry import register_wire_codec


class Bf16Codec:
    group_size = 1  # no groups: any length, no alignment

    def __init__(self, name: str, bits: int, group_size: int, scale_dtype: torch.dtype) -> None:
        self.name, self.bits, self.scale_dtype = name, bits, torch.float32

    def payload_bytes(self, numel: int) -> int:
        return self.bits // 8 * numel

    def scale_bytes(self, numel: int) -> int:
        return 0

    def wire_bytes(self, numel: int) -> int:
        return self.payload_bytes(numel)

    def encode(self, x: Tensor, generator: torch.Generator | None = None, *,
               check_finite: bool = True) -> tuple[Tensor, Tensor]:
        if check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{self.name}.encode input holds NaN or Inf")
        return x.to(torch.bfloat16).view(torch.uint8), torch.empty(0, dtype=self.scale_dtype, device=x.device)

    def encode_with_decoded(self, x: Tensor, generator: torch.Generator | None = None, *,
                            check_finite: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        payload, scales = self.encode(x, generator, check_finite=check_finite)
        return payload, scales, self.decode(payload, scales)

    def decode(self, payload: Tensor, scales: Tensor, out: Tensor | None = None,
               accumulate: bool = False) -> Tensor:
        values = payload.contiguous().view(torch.bfloat16)
        if out is None:
            return values.to(torch.float32)
        return out.add_(values) if accumulate else out.copy_(values)


register_wire_codec("toy_bf16", 16, Bf16Codec)  # the registry line: gradient codec 'toy_bf16'
