"""Group-wise low-bit quantizers for communication (pure tensor math): what every family shares.

A codec turns a flat 1-D fp32 tensor ``x`` whose length is a multiple of ``group_size`` into

* ``payload``: a 1-D ``uint8`` tensor of ``numel * bits / 8`` bytes (the packed codes), and
* ``scales``: a 1-D tensor of ``numel / group_size`` per-group scales (fp32 or bf16),

and back.  Groups are contiguous blocks of ``group_size`` values of the flat buffer.  One file
per family holds its math: ``int_codec.py`` (symmetric integers ``int8``, ``int4``, ``int2``)
and ``sign_codec.py`` (1-bit ``sign1``, sign x group RMS).  This file holds the :class:`Codec`
base they extend (configuration, argument checks, sizes, scaling codes back to fp32); names,
widths and families meet in one table, acco_loco/registry.py, whose ``make_codec`` builds one.

Wire format (little-endian within a byte, element order preserved):

* every value becomes an unsigned B-bit code ``u`` (the family defines which);
* ``8 // B`` consecutive codes share one byte, code ``k`` of the run in bits
  ``[k*B, (k+1)*B)``.

Decoding reads each code as the small signed integer it stands for and multiplies it by its
group's scale.

Because ``group_size`` is a multiple of 8, the element range ``[a, b)`` with ``a`` and ``b``
multiples of ``group_size`` is exactly the payload byte range ``[a*B/8, b*B/8)`` and the
scale range ``[a/group_size, b/group_size)``; the engine can split both into equal shard
slices for an ``all_to_all`` and each receiver decodes its slices independently.

Everything here is vectorized torch and runs on the device of its input (CPU or CUDA).
``encode`` checks for NaN/Inf (one host synchronization on CUDA, on a tensor of
``numel / group_size`` values); pass ``check_finite=False`` to skip the check when the caller
has its own policy.  Nothing here calls ``torch.compile``; with ``check_finite=False``,
``encode`` and ``decode`` trace without graph breaks (scales are tensors, no host reads), so a
caller may wrap them in ``torch.compile`` (see ``benchmarks/codec_bench.py --compile``).

Eager cost on CPU: a handful of elementwise passes each way.  On Linux, glibc hands large
freed blocks back to the kernel, so every fresh temporary page-faults; that, not arithmetic,
dominates at 2**24 values (``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` change it).
CUDA's caching allocator has no such cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .bitpack import pack_bits, pad_to_multiple, unpack_bits

__all__ = [
    "Codec",
    "pack_bits",
    "unpack_bits",
    "pad_to_multiple",
]


SCALE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def _nonfinite_error(what: str) -> ValueError:
    return ValueError(
        f"{what} contains NaN/Inf values; refusing to encode them: "
        "check for a diverged loss or use the engine's nan policy"
    )


# ----------------------------------------------------------------------------------------
# scales
# ----------------------------------------------------------------------------------------

_BF16_MAX_BITS = 0x7F7F0000  # largest finite bf16, as fp32 bits
_FP32_TINY = torch.finfo(torch.float32).tiny  # 2**-126, smallest normal (also a bf16 value)


def _ceil_to_bf16(s: Tensor) -> Tensor:
    """Smallest bf16 >= s for finite s >= 0 (saturating at the largest finite bf16)."""
    bits = s.contiguous().view(torch.int32)
    bits = ((bits + 0xFFFF) & ~0xFFFF).clamp_max_(_BF16_MAX_BITS)
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: low 16 bits are zero


def _branch_free(x: Tensor) -> bool:
    """Under torch.compile or on an accelerator, where reading a value on the host would stall
    the device, take the path that needs no host read."""
    return torch.compiler.is_compiling() or x.device.type != "cpu"


def _scale_codes(q: Tensor, scales: Tensor, out: Tensor | None, accumulate: bool) -> Tensor:
    """``q * scale`` in fp32 for int8 codes ``q`` (groups x group_size), returned flat, written
    into ``out`` or (``accumulate``) added into it."""
    s = scales.to(torch.float32)[:, None]
    # Exact small integers q as int8, then one type-promoting multiply: q * scale in fp32.
    if out is None:
        return torch.mul(q, s).view(q.numel())
    og = out.view(q.shape)
    if accumulate:
        og.addcmul_(q, s)  # one pass, no temporary; fused multiply-add where available
    else:
        torch.mul(q, s, out=og)
    return out


# ----------------------------------------------------------------------------------------
# codec
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Codec:
    """One quantizer configuration.  Build with ``make_codec`` (acco_loco/registry.py).

    ``encode(x) -> (payload, scales)`` and ``decode(payload, scales) -> fp32``; see the module
    docstring for the wire format and the family files for the math.  A family subclass names
    the bit widths its math packs in ``widths`` and fills in :meth:`_encode_groups` (quantize the
    grouped values) and :meth:`_codes` (the payload's codes as signed integers); the checks,
    sizes and the final multiply by the scales are shared.
    """

    name: str  # "int8" | "int4" | "int2" | "sign1"
    bits: int
    group_size: int = 128
    scale_dtype: torch.dtype = torch.float32

    widths: ClassVar[tuple[int, ...]] = ()  # bits per value the family's math packs (none: no family)

    def __post_init__(self) -> None:
        if not self.widths:
            raise ValueError(f"{type(self).__name__} is no codec family: build codecs with make_codec "
                             "(acco_loco/registry.py)")
        if self.bits not in self.widths:
            raise ValueError(f"{type(self).__name__} {self.name!r}: {self.bits} bits; the family packs "
                             f"{', '.join(map(str, self.widths))} bits a value")
        if not isinstance(self.group_size, int) or self.group_size < 8 or self.group_size % 8:
            raise ValueError(f"group_size must be a positive multiple of 8 (got {self.group_size!r})")
        if self.scale_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"scale_dtype must be torch.float32 or torch.bfloat16 (got {self.scale_dtype})")

    # -- sizes -----------------------------------------------------------------------------

    def _groups(self, numel: int) -> int:
        if numel < 0 or numel % self.group_size:
            raise ValueError(
                f"{self.name}: numel {numel} is not a multiple of group_size {self.group_size}; "
                "pad the buffer (see pad_to_multiple)"
            )
        return numel // self.group_size

    def payload_bytes(self, numel: int) -> int:
        return self._groups(numel) * self.group_size * self.bits // 8

    def scale_bytes(self, numel: int) -> int:
        return self._groups(numel) * torch.empty((), dtype=self.scale_dtype).element_size()

    def wire_bytes(self, numel: int) -> int:
        """Payload plus scales for ``numel`` values."""
        return self.payload_bytes(numel) + self.scale_bytes(numel)

    # -- encode ----------------------------------------------------------------------------

    def encode(
        self, x: Tensor, generator: torch.Generator | None = None, *, check_finite: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Quantize 1-D ``x`` (numel a multiple of ``group_size``) to ``(payload, scales)``.

        ``x`` is read as fp32 (other float dtypes are upcast).  Rounding is to nearest (half
        to even) unless ``generator`` is given: then stochastic rounding
        ``floor(h/scale + U[0,1))`` with uniforms drawn from ``generator`` (which must live on
        ``x``'s device), unbiased for the integer codecs.  ``sign1`` ignores ``generator``.
        Raises ``ValueError`` on NaN/Inf input unless ``check_finite=False``.
        """
        return self._encode_groups(self._grouped(x, generator), generator, check_finite, keep_decoded=False)

    def encode_with_decoded(
        self, x: Tensor, generator: torch.Generator | None = None, *, check_finite: bool = True
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``encode`` plus ``decode(payload, scales)`` (fp32, bit-identical to it), for error
        feedback: the integer codecs rescale the rounded values they already hold instead of
        unpacking the payload again (one pass instead of three)."""
        return self._encode_groups(self._grouped(x, generator), generator, check_finite, keep_decoded=True)

    def _grouped(self, x: Tensor, generator: torch.Generator | None) -> Tensor:
        """``x`` checked and viewed as fp32 (groups x group_size)."""
        if x.dim() != 1:
            raise ValueError(f"{self.name}.encode expects a flat 1-D tensor (got shape {tuple(x.shape)})")
        if not x.is_floating_point():
            raise ValueError(f"{self.name}.encode expects a floating tensor (got {x.dtype})")
        groups = self._groups(x.numel())
        if generator is not None and generator.device.type != x.device.type:
            raise ValueError(f"generator is on {generator.device} but the tensor is on {x.device}")
        return x.to(torch.float32).reshape(groups, self.group_size)  # copies only if strided

    def _encode_groups(self, xg: Tensor, generator: torch.Generator | None, check_finite: bool,
                       keep_decoded: bool) -> tuple[Tensor, ...]:
        """The family's quantizer on ``xg`` (groups x group_size, fp32): ``(payload, scales)``,
        plus the flat decoded values when ``keep_decoded``."""
        raise NotImplementedError(f"{type(self).__name__} has no family: build codecs with make_codec")

    # -- decode ----------------------------------------------------------------------------

    def decode(
        self,
        payload: Tensor,
        scales: Tensor,
        out: Tensor | None = None,
        accumulate: bool = False,
    ) -> Tensor:
        """Dequantize ``(payload, scales)`` to fp32, ``numel = scales.numel() * group_size``.

        Works on any group-aligned slice of an encoded buffer.  With ``out`` the result is
        written there (1-D fp32, ``numel`` values, same device) and returned; with
        ``accumulate=True`` it is added into ``out`` instead (``out += q * scale``), which is
        how a shard owner sums the N slices it receives.  The accumulate path uses
        ``addcmul_``, which backends may compute with a fused multiply-add: the result can
        differ from ``out + decode(...)`` in the last bit (it is the more accurate of the
        two), but it is deterministic for a given device type.
        """
        self._check_decode(payload, scales, out, accumulate)
        q = self._codes(payload).view(scales.numel(), self.group_size)
        return _scale_codes(q, scales, out, accumulate)

    def _codes(self, payload: Tensor) -> Tensor:
        """The payload's codes as the int8 values they stand for, one per value (flat)."""
        raise NotImplementedError(f"{type(self).__name__} has no family: build codecs with make_codec")

    def _check_decode(self, payload: Tensor, scales: Tensor, out: Tensor | None, accumulate: bool) -> None:
        groups = scales.numel()
        numel = groups * self.group_size
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"{self.name}.decode: payload must be 1-D uint8 (got {payload.dtype}, {tuple(payload.shape)})")
        if scales.dim() != 1:
            raise ValueError(f"{self.name}.decode: scales must be 1-D (got shape {tuple(scales.shape)})")
        if payload.numel() != numel * self.bits // 8:
            raise ValueError(
                f"{self.name}.decode: {groups} scales need {numel * self.bits // 8} payload bytes, "
                f"got {payload.numel()}"
            )
        if out is not None:
            if (
                out.dtype != torch.float32
                or out.shape != (numel,)
                or out.device != payload.device
                or not out.is_contiguous()
            ):
                raise ValueError(
                    f"{self.name}.decode: out must be a contiguous 1-D float32 tensor of {numel} values on "
                    f"{payload.device} (got {out.dtype}, {tuple(out.shape)}, {out.device})"
                )
        elif accumulate:
            raise ValueError(f"{self.name}.decode: accumulate=True needs an out tensor")
