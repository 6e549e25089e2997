"""Bit packing for the low-bit codecs: ``8 // B`` consecutive B-bit codes share one byte, code
``k`` of the run in bits ``[k*B, (k+1)*B)`` (little-endian within a byte, element order kept)."""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

if sys.byteorder != "little":  # pragma: no cover - every torch target is little-endian
    raise ImportError("acco_loco.bitpack packs bits through integer views and needs a little-endian host")

# Integer word that holds the 8 // bits codes packed into one byte, one code per byte.
_WORD_DTYPE: dict[int, torch.dtype] = {1: torch.int64, 2: torch.int32, 4: torch.int16}


def _check_bits(bits: int) -> int:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be one of 1, 2, 4, 8 (got {bits!r})")
    return bits


def _spread_masks(bits: int) -> list[int]:
    """Masks for the in-register (SWAR) pack/unpack of ``8 // bits`` codes in one word.

    ``masks[s]`` keeps, in every block of ``2**s`` bytes of the word, the low
    ``bits * 2**s`` bits of the block.  ``masks[0]`` keeps the low ``bits`` bits of each byte
    (one code per byte); unpacking runs the doubling steps of :func:`pack_bits` backwards and
    applies ``masks[s]`` after step ``s``.
    """
    per = 8 // bits
    masks = []
    for s in range(int(math.log2(per))):
        block = 1 << s  # bytes per block at this level
        keep = (1 << (bits * block)) - 1
        m = 0
        for j in range(per // block):
            m |= keep << (8 * block * j)
        masks.append(m)
    return masks


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack unsigned ``bits``-bit codes, one per ``uint8``, into ``8 // bits`` codes per byte.

    ``codes`` is a 1-D ``uint8`` tensor whose length is a multiple of ``8 // bits``; only the
    low ``bits`` bits of each byte are kept.  Code ``k`` of each run of ``8 // bits`` lands in
    bits ``[k*bits, (k+1)*bits)`` of its byte, so element order is preserved.  ``bits == 8``
    returns ``codes`` itself.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise ValueError(f"pack_bits expects a 1-D uint8 tensor (got {codes.dtype}, shape {tuple(codes.shape)})")
    if bits == 8:
        return codes
    per = 8 // bits
    if codes.numel() % per:
        raise ValueError(f"pack_bits({bits}): length {codes.numel()} is not a multiple of {per}")
    if torch.compiler.is_compiling():
        codes = codes.contiguous()  # storage_offset() would break the graph
    elif not codes.is_contiguous() or codes.storage_offset() % per:
        codes = codes.clone()  # the word view below needs an aligned start
    # One word per output byte holding its `per` codes in consecutive bytes (little-endian).
    # Doubling steps move the codes of byte k+2**s next to those of byte k:
    # after step s every byte k holds 2**(s+1) codes in its low bits (no bit collides,
    # all words stay non-negative, so the arithmetic shift is a logical one).
    word = codes.view(_WORD_DTYPE[bits]) & _spread_masks(bits)[0]
    shift = 8 - bits
    for s in range(int(math.log2(per))):
        word |= word >> (shift << s)
    return word.to(torch.uint8)  # the low byte of each word; conversion truncates mod 256


def unpack_bits(packed: Tensor, bits: int, numel: int | None = None) -> Tensor:
    """Inverse of :func:`pack_bits`: one ``uint8`` code (in ``[0, 2**bits)``) per value.

    ``numel`` (optional) keeps only the first ``numel`` codes; by default all
    ``packed.numel() * 8 // bits`` codes are returned.  For ``bits == 8`` the result is a
    view of ``packed``.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(
            f"unpack_bits expects a 1-D uint8 tensor (got {packed.dtype}, shape {tuple(packed.shape)})"
        )
    per = 8 // bits
    total = packed.numel() * per
    if numel is None:
        numel = total
    if not 0 <= numel <= total:
        raise ValueError(f"unpack_bits({bits}): numel={numel} but the payload holds {total} codes")
    if bits == 8:
        return packed[:numel]
    word = packed.to(_WORD_DTYPE[bits])
    shift = 8 - bits
    masks = _spread_masks(bits)
    for s in reversed(range(len(masks))):
        word |= word << (shift << s)
        word &= masks[s]
    codes = word.view(torch.uint8)
    return codes if numel == total else codes[:numel]


def pad_to_multiple(x: Tensor, multiple: int, value: float = 0.0) -> Tensor:
    """Return 1-D ``x`` padded at the end with ``value`` to a length that is a multiple of
    ``multiple`` (``x`` itself when it already is).  Zero padding forms all-zero tails of
    groups, which cost nothing in accuracy and decode to exact zeros."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1 (got {multiple})")
    if x.dim() != 1:
        raise ValueError(f"pad_to_multiple expects a 1-D tensor (got shape {tuple(x.shape)})")
    rem = x.numel() % multiple
    if rem == 0:
        return x
    return torch.nn.functional.pad(x, (0, multiple - rem), value=value)
