"""1-bit codec ``sign1``, per group, as in 1-bit Adam (Tang et al., ICML 2021)::

    scale = rms(group) = sqrt(mean(h**2))
    deQ   = sign(h) * scale        with sign(0) = sign(-0.0) = +1

On the wire each value is one bit, ``u = 1 if h >= 0 else 0``; the shared wire format and the
:class:`~acco_loco.codecs.Codec` base are in ``codecs.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from . import codecs
from .bitpack import pack_bits, unpack_bits
from .codecs import Codec, _nonfinite_error


def _group_rms(xg: Tensor) -> Tensor:
    """sqrt(mean(x**2)) per row in fp32, safe against overflow/underflow of the squares."""
    g = xg.shape[1]
    # looked up on the module, so that a test can force the accelerator's path on CPU
    if codecs._branch_free(xg):
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


@dataclass(frozen=True)
class SignCodec(Codec):
    """Group-wise sign x RMS quantizer (``sign1``); ignores the rounding generator."""

    widths: ClassVar[tuple[int, ...]] = (1,)

    def _encode_groups(self, xg: Tensor, generator: torch.Generator | None, check_finite: bool,
                       keep_decoded: bool) -> tuple[Tensor, ...]:
        rms = _group_rms(xg)
        if check_finite and xg.numel() and not bool(torch.isfinite(rms).all()):
            raise _nonfinite_error(f"{self.name}.encode input")
        # sign(0) = sign(-0.0) = +1; converted, not viewed: Inductor's CUDA lowering cannot bitcast bool
        codes = torch.ge(xg, 0).view(-1).to(torch.uint8)
        payload, scales = pack_bits(codes, 1), rms.to(self.scale_dtype)
        # nothing cheaper to reuse than the payload: decode it
        return (payload, scales, self.decode(payload, scales)) if keep_decoded else (payload, scales)

    def _codes(self, payload: Tensor) -> Tensor:
        q = unpack_bits(payload, 1).view(torch.int8)  # a fresh tensor: edit in place
        return q.mul_(2).sub_(1)  # {0, 1} -> {-1, +1}
