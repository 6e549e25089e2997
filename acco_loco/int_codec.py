"""Symmetric integer codecs ``int8``, ``int4``, ``int2`` (B bits), per group::

    qmax  = 2**(B-1) - 1
    scale = max(absmax(group) / qmax, 2**-126)    (0 for an all-zero group)
    q     = clamp(round(h / scale), -qmax-1, qmax)  (round half to even; or stochastic)
    deQ   = q * scale                               (exactly zero where scale == 0)

so ``|h - deQ(Q(h))| <= scale / 2`` per element with deterministic rounding and
``< scale`` with stochastic rounding, for the scale that is actually sent.  With bf16 scales
the fp32 scale is rounded *up* to the next bf16 value before quantizing, so the bound holds
for the bf16 scale on the wire and ``|h / scale| <= qmax`` still (no clamping of the absmax
element).

On the wire each value is the B-bit offset-binary code ``u = q + 2**(B-1)``; the shared wire
format and the :class:`~acco_loco.codecs.Codec` base are in ``codecs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .bitpack import pack_bits, unpack_bits
from .codecs import _FP32_TINY, Codec, _ceil_to_bf16, _nonfinite_error


@dataclass(frozen=True)
class IntCodec(Codec):
    """Group-wise symmetric integer quantizer (``int8``, ``int4``, ``int2``)."""

    widths: ClassVar[tuple[int, ...]] = (8, 4, 2)

    @property
    def qmax(self) -> int:
        """Largest positive code value, ``2**(bits-1) - 1``."""
        return (1 << (self.bits - 1)) - 1

    def _encode_groups(self, xg: Tensor, generator: torch.Generator | None, check_finite: bool,
                       keep_decoded: bool) -> tuple[Tensor, ...]:
        amax = torch.maximum(xg.amax(dim=1), xg.amin(dim=1).neg())  # NaN propagates
        if check_finite and xg.numel() and not bool(torch.isfinite(amax).all()):
            raise _nonfinite_error(f"{self.name}.encode input")
        scale, scales = self._scales(amax)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero groups: h == 0
        y = self._round(xg / safe[:, None], generator)
        # q as int8 (two's complement); flipping bit B-1 of the B-bit field gives the
        # offset-binary code q + 2**(B-1) (cheaper on bytes than an fp32 add).
        codes = y.view(-1).to(torch.int8).view(torch.uint8)
        codes ^= 1 << (self.bits - 1)
        if keep_decoded:
            # q * scale with q exact in fp32 and the scale decode() reads: the same product
            decoded = y.mul_(scale[:, None]).view(-1)
            return pack_bits(codes, self.bits), scales, decoded
        return pack_bits(codes, self.bits), scales

    def _scales(self, amax: Tensor) -> tuple[Tensor, Tensor]:
        """Per-group ``(scale to quantize with in fp32, scale on the wire)`` from the absmax."""
        # absmax / qmax, kept >= the smallest normal fp32 for non-zero groups (a subnormal
        # quotient would lose precision and let h / scale exceed qmax); 0 for zero groups
        # divided by a device tensor, not a Python number: CUDA turns ``tensor / number`` into a
        # multiply by its rounded reciprocal (a last-bit difference from the CPU's quotient)
        qmax = torch.full((), float(self.qmax), dtype=amax.dtype, device=amax.device)
        scale = torch.where(amax > 0, (amax / qmax).clamp_min_(_FP32_TINY), 0.0)
        if self.scale_dtype == torch.bfloat16:
            scales = _ceil_to_bf16(scale)
            return scales.to(torch.float32), scales
        return scale, scale

    def _round(self, y: Tensor, generator: torch.Generator | None) -> Tensor:
        """``y = h / scale`` rounded in place to the integer codes (as fp32)."""
        if generator is None:
            # |h / scale| <= qmax * (1 + 2**-23) because scale >= fl(absmax / qmax) is normal,
            # so round() already lands in [-qmax, qmax]: no clamp pass needed
            return y.round_()
        noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
        return y.add_(noise).floor_().clamp_(-self.qmax - 1, self.qmax)

    def _codes(self, payload: Tensor) -> Tensor:
        if self.bits == 8:
            return torch.bitwise_xor(payload, 0x80).view(torch.int8)  # offset binary -> two's complement
        q = unpack_bits(payload, self.bits).view(torch.int8)  # a fresh tensor: edit in place
        return q.sub_(1 << (self.bits - 1))
