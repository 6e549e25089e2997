"""Group-wise low-bit quantizers for communication (pure tensor math).

A codec turns a flat 1-D fp32 tensor ``x`` whose length is a multiple of ``group_size`` into

* ``payload``: a 1-D ``uint8`` tensor of ``numel * bits / 8`` bytes (the packed codes), and
* ``scales``: a 1-D tensor of ``numel / group_size`` per-group scales (fp32 or bf16),

and back.  Groups are contiguous blocks of ``group_size`` values of the flat buffer.

Symmetric integer codecs (``int8``, ``int4``, ``int2``; B bits), per group::

    qmax  = 2**(B-1) - 1
    scale = max(absmax(group) / qmax, 2**-126)    (0 for an all-zero group)
    q     = clamp(round(h / scale), -qmax-1, qmax)  (round half to even; or stochastic)
    deQ   = q * scale                               (exactly zero where scale == 0)

so ``|h - deQ(Q(h))| <= scale / 2`` per element with deterministic rounding and
``< scale`` with stochastic rounding, for the scale that is actually sent.  With bf16 scales
the fp32 scale is rounded *up* to the next bf16 value before quantizing, so the bound holds
for the bf16 scale on the wire and ``|h / scale| <= qmax`` still (no clamping of the absmax
element).

1-bit codec (``sign1``), per group, as in 1-bit Adam (Tang et al., ICML 2021)::

    scale = rms(group) = sqrt(mean(h**2))
    deQ   = sign(h) * scale        with sign(0) = sign(-0.0) = +1

Wire format (little-endian within a byte, element order preserved):

* every value becomes an unsigned B-bit code ``u``: ``u = q + 2**(B-1)`` (offset binary) for
  the integer codecs, ``u = 1 if h >= 0 else 0`` for ``sign1``;
* ``8 // B`` consecutive codes share one byte, code ``k`` of the run in bits
  ``[k*B, (k+1)*B)``.

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

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .bitpack import pack_bits, pad_to_multiple, unpack_bits

__all__ = [
    "CODEC_BITS",
    "Codec",
    "make_codec",
    "pack_bits",
    "unpack_bits",
    "pad_to_multiple",
]


#: codec name -> bits per value
CODEC_BITS: dict[str, int] = {"int8": 8, "int4": 4, "int2": 2, "sign1": 1}

_SCALE_DTYPES: dict[str, torch.dtype] = {
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


def _group_rms(xg: Tensor) -> Tensor:
    """sqrt(mean(x**2)) per row in fp32, safe against overflow/underflow of the squares."""
    g = xg.shape[1]
    if _branch_free(xg):
        # no host sync, no graph break: always scale by absmax; fuses into one read
        amax = xg.abs().amax(dim=1, keepdim=True)
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        return amax.squeeze(1) * torch.linalg.vector_norm(xg / safe, dim=1) * (1.0 / math.sqrt(g))
    rms = torch.linalg.vector_norm(xg, dim=1) * (1.0 / math.sqrt(g))
    # Squares overflow above ~1.8e19 and lose precision below ~1e-19: redo those rows
    # (rare: diverging values, exact-zero groups, denormal-scale values) scaled by absmax.
    redo = ~(rms >= 1e-18) | ~(rms <= 1e18)  # also catches NaN
    if bool(redo.any()):
        idx = redo.nonzero().squeeze(1)
        sub = xg.index_select(0, idx)
        amax = sub.abs().amax(dim=1)
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        sub_rms = amax * torch.linalg.vector_norm(sub / safe[:, None], dim=1) * (1.0 / math.sqrt(g))
        rms = rms.index_copy(0, idx, sub_rms)
    return rms


# ----------------------------------------------------------------------------------------
# codec
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Codec:
    """One quantizer configuration.  Build with :func:`make_codec`.

    ``encode(x) -> (payload, scales)`` and ``decode(payload, scales) -> fp32``; see the module
    docstring for the exact math and wire format.
    """

    name: str  # "int8" | "int4" | "int2" | "sign1"
    bits: int
    group_size: int = 128
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.name not in CODEC_BITS:
            raise ValueError(f"unknown codec {self.name!r}; valid codecs: {', '.join(CODEC_BITS)}")
        if self.bits != CODEC_BITS[self.name]:
            raise ValueError(f"codec {self.name!r} has {CODEC_BITS[self.name]} bits, not {self.bits}")
        if not isinstance(self.group_size, int) or self.group_size < 8 or self.group_size % 8:
            raise ValueError(f"group_size must be a positive multiple of 8 (got {self.group_size!r})")
        if self.scale_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"scale_dtype must be torch.float32 or torch.bfloat16 (got {self.scale_dtype})")

    # -- sizes -----------------------------------------------------------------------------

    @property
    def qmax(self) -> int:
        """Largest positive code value (``2**(bits-1) - 1``; 1 for sign1, unused)."""
        return max(1, (1 << (self.bits - 1)) - 1)

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
        return self._encode(x, generator, check_finite, keep_decoded=False)

    def encode_with_decoded(
        self, x: Tensor, generator: torch.Generator | None = None, *, check_finite: bool = True
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``encode`` plus ``decode(payload, scales)`` (fp32, bit-identical to it), for error
        feedback: the integer codecs rescale the rounded values they already hold instead of
        unpacking the payload again (one pass instead of three)."""
        return self._encode(x, generator, check_finite, keep_decoded=True)

    def _encode(self, x: Tensor, generator: torch.Generator | None, check_finite: bool, keep_decoded: bool):
        if x.dim() != 1:
            raise ValueError(f"{self.name}.encode expects a flat 1-D tensor (got shape {tuple(x.shape)})")
        if not x.is_floating_point():
            raise ValueError(f"{self.name}.encode expects a floating tensor (got {x.dtype})")
        groups = self._groups(x.numel())
        if generator is not None and generator.device.type != x.device.type:
            raise ValueError(f"generator is on {generator.device} but the tensor is on {x.device}")
        xg = x.to(torch.float32).reshape(groups, self.group_size)  # copies only if strided
        if self.bits == 1:
            payload, scales = self._encode_sign(xg, check_finite)
            return (payload, scales, self.decode(payload, scales)) if keep_decoded else (payload, scales)
        return self._encode_int(xg, generator, check_finite, keep_decoded)

    def _encode_int(self, xg: Tensor, generator: torch.Generator | None, check_finite: bool,
                    keep_decoded: bool = False):
        qmax = self.qmax
        amax = torch.maximum(xg.amax(dim=1), xg.amin(dim=1).neg())  # NaN propagates
        if check_finite and xg.numel() and not bool(torch.isfinite(amax).all()):
            raise _nonfinite_error(f"{self.name}.encode input")
        # absmax / qmax, kept >= the smallest normal fp32 for non-zero groups (a subnormal
        # quotient would lose precision and let h / scale exceed qmax); 0 for zero groups
        scale = torch.where(amax > 0, (amax / qmax).clamp_min_(_FP32_TINY), 0.0)
        if self.scale_dtype == torch.bfloat16:
            scales = _ceil_to_bf16(scale)
            scale = scales.to(torch.float32)
        else:
            scales = scale
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero groups: h == 0
        y = xg / safe[:, None]
        if generator is None:
            # |h / scale| <= qmax * (1 + 2**-23) because scale >= fl(absmax / qmax) is normal,
            # so round() already lands in [-qmax, qmax]: no clamp pass needed
            y.round_()
        else:
            noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
            y.add_(noise).floor_().clamp_(-qmax - 1, qmax)
        # q as int8 (two's complement); flipping bit B-1 of the B-bit field gives the
        # offset-binary code q + 2**(B-1) (cheaper on bytes than an fp32 add).
        codes = y.view(-1).to(torch.int8).view(torch.uint8)
        codes ^= 1 << (self.bits - 1)
        if keep_decoded:
            # q * scale with q exact in fp32 and the scale decode() reads: the same product
            decoded = y.mul_(scale[:, None]).view(-1)
            return pack_bits(codes, self.bits), scales, decoded
        return pack_bits(codes, self.bits), scales

    def _encode_sign(self, xg: Tensor, check_finite: bool) -> tuple[Tensor, Tensor]:
        rms = _group_rms(xg)
        if check_finite and xg.numel() and not bool(torch.isfinite(rms).all()):
            raise _nonfinite_error(f"{self.name}.encode input")
        codes = torch.ge(xg, 0).view(-1).view(torch.uint8)  # sign(0) = sign(-0.0) = +1
        return pack_bits(codes, 1), rms.to(self.scale_dtype)

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

        s = scales.to(torch.float32)[:, None]
        # Exact small integers q as int8, then one type-promoting multiply: q * scale in fp32.
        if self.bits == 8:
            q = torch.bitwise_xor(payload, 0x80).view(torch.int8)  # offset binary -> two's complement
        else:
            q = unpack_bits(payload, self.bits).view(torch.int8)  # a fresh tensor: edit in place
            if self.bits == 1:
                q.mul_(2).sub_(1)  # {0, 1} -> {-1, +1}
            else:
                q.sub_(1 << (self.bits - 1))
        q = q.view(groups, self.group_size)
        if out is None:
            return torch.mul(q, s).view(numel)
        og = out.view(groups, self.group_size)
        if accumulate:
            og.addcmul_(q, s)  # one pass, no temporary; fused multiply-add where available
        else:
            torch.mul(q, s, out=og)
        return out


def make_codec(name: str, group_size: int = 128, scale_dtype: torch.dtype | str = torch.float32) -> Codec:
    """Build a :class:`Codec` by name (``int8``, ``int4``, ``int2``, ``sign1``).

    ``scale_dtype`` is ``torch.float32``/``torch.bfloat16`` or one of the strings
    ``"fp32"``, ``"float32"``, ``"bf16"``, ``"bfloat16"``.
    """
    if name not in CODEC_BITS:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODEC_BITS)}")
    if isinstance(scale_dtype, str):
        if scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"unknown scale dtype {scale_dtype!r}; valid: {', '.join(_SCALE_DTYPES)}")
        scale_dtype = _SCALE_DTYPES[scale_dtype]
    return Codec(name=name, bits=CODEC_BITS[name], group_size=group_size, scale_dtype=scale_dtype)
