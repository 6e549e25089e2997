"""Group-wise round-to-nearest (RTN) weight quantization and its packed storage format.

A linear weight ``W`` of shape ``(out, in)`` is cut, row by row, into groups of ``group_size``
consecutive input columns (rows are first padded with zeros to a multiple of ``group_size``;
the padding is stored but never read back). Each group gets one scale ``s`` and one integer
zero point ``z``; every weight becomes an unsigned ``bits``-bit code ``q``::

    asymmetric (default), qmax = 2**bits - 1:
        lo = min(min(group), 0)      hi = max(max(group), 0)     (0 is always representable)
        s  = (hi - lo) / qmax        z  = round(-lo / s)
        q  = clamp(round(w / s) + z, 0, qmax)
    symmetric, half = 2**(bits - 1):
        s  = absmax(group) / (half - 1)                          z  = half
        q  = clamp(round(w / s), -half, half - 1) + z
    deQ(q) = (q - z) * s

``round`` is round-half-to-even. The scale is stored as float16: it is raised to at least
``2**-14`` (the smallest normal float16, so an all-zero group still has a usable scale) and
then rounded *up* to a float16 value, and the codes are computed with that stored scale.
Rounding up keeps the whole group inside the code range, so ``|w - deQ(q)| <= s / 2`` for
every element, for the scale actually stored (the asymmetric clamp never cuts more than half
a step because ``z`` is rounded from ``-lo / s``). ``(q - z) * s`` is exact in float32.

Packed format, per quantized weight (what :func:`pack_weight` returns; safetensors stores
these tensors under ``<module>.qweight``, ``<module>.scales`` and ``<module>.zeros``):

* ``qweight``: ``uint8``, shape ``(out, padded_in * bits / 8)``. Each row is a little-endian
  bit stream of the row's codes: code ``k`` occupies stream bits ``[k*bits, (k+1)*bits)``
  and stream bit ``b`` is bit ``b % 8`` of byte ``b // 8``. For 4 bits that is two codes per
  byte, low nibble first; for 3 bits, 8 codes per 3 bytes. ``padded_in`` is ``in`` rounded
  up to a multiple of ``group_size`` (a multiple of 8, so rows end on a byte boundary).
* ``scales``: ``float16``, shape ``(out, padded_in / group_size)``.
* ``zeros``: ``uint8``, shape ``(out, padded_in / group_size)``, the zero-point codes ``z``
  (constant ``2**(bits-1)`` when symmetric).

Pure tensor math: no files, no modules. ``lm/quantized_files.py`` writes the files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "MIN_SCALE",
    "QuantSpec",
    "QuantizedWeight",
    "dequantize",
    "pack_codes",
    "pack_weight",
    "quantize_codes",
    "quantize_weight",
    "unpack_codes",
]

MIN_SCALE = 2.0**-14  # smallest normal float16


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize: ``bits`` in 2..8, ``group_size`` a positive multiple of 8."""

    bits: int = 4
    group_size: int = 64
    symmetric: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer in 2..8, got {self.bits!r}")
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 8 or g % 8:
            raise ValueError(f"group_size must be a positive multiple of 8, got {g!r}")

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1


@dataclass(frozen=True)
class QuantizedWeight:
    """One packed weight: see the module docstring for the layout."""

    qweight: Tensor  # uint8 (out, padded_in * bits / 8)
    scales: Tensor  # float16 (out, n_groups)
    zeros: Tensor  # uint8 (out, n_groups)
    shape: tuple[int, int]  # (out, in) of the original weight
    spec: QuantSpec

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


# --------------------------------------------------------------------------------------------
# Scales and codes
# --------------------------------------------------------------------------------------------


def _round_up_to_fp16(s: Tensor) -> Tensor:
    """Smallest float16 >= ``s`` (positive, finite), as float16."""
    h = s.to(torch.float16)
    low = h.to(s.dtype) < s
    if low.any():  # positive float16 values are ordered like their bit patterns
        h = torch.where(low, (h.view(torch.int16) + 1).view(torch.float16), h)
    if not torch.isfinite(h).all():
        raise ValueError("a group's scale overflows float16 (|weight| > ~1e6): weights not finite?")
    return h


def _grouped(w: Tensor, group_size: int) -> Tensor:
    """``(out, in)`` -> float64 ``(out, n_groups, group_size)``, zero-padded at the end of rows."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight (out, in), got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("weight has NaN/Inf values; quantize a finite model")
    out, cols = w.shape
    pad = -cols % group_size
    w = torch.nn.functional.pad(w.detach().to(torch.float64), (0, pad))
    return w.reshape(out, -1, group_size)


def quantize_codes(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Unpacked ``(codes, scales, zeros)``: uint8 ``(out, n_groups, group_size)``, float16 and
    uint8 ``(out, n_groups)``. Arithmetic in float64, with the stored (float16) scale."""
    wg = _grouped(w, spec.group_size)
    if spec.symmetric:
        half = 1 << (spec.bits - 1)
        raw = wg.abs().amax(-1) / (half - 1)
    else:
        lo = wg.amin(-1).clamp(max=0.0)
        raw = (wg.amax(-1).clamp(min=0.0) - lo) / spec.qmax
    scales = _round_up_to_fp16(raw.clamp(min=MIN_SCALE))
    s = scales.to(torch.float64)
    if spec.symmetric:
        zeros = torch.full_like(s, float(half))
    else:
        zeros = torch.round(-lo / s).clamp(0, spec.qmax)
    codes = (torch.round(wg / s[..., None]) + zeros[..., None]).clamp(0, spec.qmax)
    return codes.to(torch.uint8), scales, zeros.to(torch.uint8)


def _dequantize_codes(codes: Tensor, scales: Tensor, zeros: Tensor, cols: int) -> Tensor:
    levels = codes.to(torch.float32) - zeros.to(torch.float32)[..., None]
    w = levels * scales.to(torch.float32)[..., None]
    return w.reshape(w.shape[0], -1)[:, :cols].contiguous()


# --------------------------------------------------------------------------------------------
# Bit packing
# --------------------------------------------------------------------------------------------


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack a ``(rows, n)`` uint8 tensor of ``bits``-bit codes into ``(rows, n * bits / 8)``
    bytes, each row a little-endian bit stream (see the module docstring)."""
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"pack_codes expects a 2-D uint8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    rows, n = codes.shape
    if (n * bits) % 8:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole bytes; pad rows to a multiple of 8")
    shifts = torch.arange(bits, dtype=torch.uint8)
    stream = (codes[..., None] >> shifts) & 1  # (rows, n, bits): bit b of every code
    stream = stream.reshape(rows, -1, 8)  # 8 consecutive stream bits form one byte
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32)
    return (stream.to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack_codes`: ``(rows, nbytes)`` -> ``(rows, nbytes * 8 / bits)`` codes."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"unpack_codes expects a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    rows, nbytes = packed.shape
    if (nbytes * 8) % bits:
        raise ValueError(f"{nbytes} bytes per row do not hold a whole number of {bits}-bit codes")
    stream = (packed[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1
    stream = stream.reshape(rows, -1, bits).to(torch.int32)
    weights = torch.tensor([1 << i for i in range(bits)], dtype=torch.int32)
    return (stream * weights).sum(-1).to(torch.uint8)


# --------------------------------------------------------------------------------------------
# Whole weights
# --------------------------------------------------------------------------------------------


def pack_weight(codes: Tensor, scales: Tensor, zeros: Tensor, shape: tuple[int, int],
                spec: QuantSpec) -> QuantizedWeight:
    rows = codes.reshape(codes.shape[0], -1)
    return QuantizedWeight(pack_codes(rows, spec.bits), scales, zeros, tuple(shape), spec)


def quantize_weight(w: Tensor, spec: QuantSpec) -> QuantizedWeight:
    """Quantize and pack one ``(out, in)`` weight."""
    codes, scales, zeros = quantize_codes(w, spec)
    return pack_weight(codes, scales, zeros, tuple(w.shape), spec)


def dequantize(qw: QuantizedWeight) -> Tensor:
    """The float32 ``(out, in)`` weight a packed weight stands for."""
    out, cols = qw.shape
    n_groups = math.ceil(cols / qw.spec.group_size)
    if qw.scales.shape != (out, n_groups) or qw.zeros.shape != (out, n_groups):
        raise ValueError(
            f"scales/zeros have shapes {tuple(qw.scales.shape)}/{tuple(qw.zeros.shape)}, "
            f"expected {(out, n_groups)} for a {qw.shape} weight in groups of {qw.spec.group_size}"
        )
    codes = unpack_codes(qw.qweight, qw.spec.bits).reshape(out, n_groups, qw.spec.group_size)
    return _dequantize_codes(codes, qw.scales, qw.zeros, cols)
