"""Low-bit export: the group-wise quantizer against a float64 reference, the packed format, and
recipes/export.py end to end on a tiny random Llama (export, reload through transformers +
peft, logits match; EoRA lowers the calibration-weighted output error)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from acco_loco.weight_quant import (
    MIN_SCALE,
    QuantSpec,
    dequantize,
    pack_codes,
    quantize_codes,
    quantize_weight,
    unpack_codes,
)

# ------------------------------------------------------------------ quantizer


def _reference(w: torch.Tensor, spec: QuantSpec):
    """One group at a time, in float64 with Python scalars where it matters."""
    out, cols = w.shape
    n_groups = math.ceil(cols / spec.group_size)
    padded = torch.zeros(out, n_groups * spec.group_size, dtype=torch.float64)
    padded[:, :cols] = w.double()
    codes = torch.zeros(out, n_groups, spec.group_size, dtype=torch.uint8)
    scales = torch.zeros(out, n_groups, dtype=torch.float16)
    zeros = torch.zeros(out, n_groups, dtype=torch.uint8)
    for r, g in itertools.product(range(out), range(n_groups)):
        group = padded[r, g * spec.group_size:(g + 1) * spec.group_size]
        if spec.symmetric:
            raw = float(group.abs().max()) / (2 ** (spec.bits - 1) - 1)
        else:
            raw = (max(float(group.max()), 0.0) - min(float(group.min()), 0.0)) / (2**spec.bits - 1)
        s16 = np.float16(max(raw, MIN_SCALE))
        if float(s16) < max(raw, MIN_SCALE):  # round up: the next float16
            s16 = np.nextafter(s16, np.float16(np.inf))
        s = float(s16)
        if spec.symmetric:
            z = 2 ** (spec.bits - 1)
        else:
            z = min(max(round(-min(float(group.min()), 0.0) / s), 0), 2**spec.bits - 1)
        q = torch.clamp(torch.round(group / s) + z, 0, 2**spec.bits - 1)
        codes[r, g], scales[r, g], zeros[r, g] = q.to(torch.uint8), float(s16), z
    return codes, scales, zeros


@pytest.mark.parametrize("bits,symmetric,cols", [(4, False, 96), (3, False, 80), (4, True, 64),
                                                 (3, True, 72), (2, False, 64), (8, False, 40)])
def test_quantizer_matches_float64_reference_and_half_step_bound(bits, symmetric, cols):
    g = torch.Generator().manual_seed(bits + cols)
    w = torch.randn(12, cols, generator=g) * torch.logspace(-3, 0, 12)[:, None]  # rows of all scales
    w[0, :16] = 0.0  # an all-zero group
    w[1] = w[1].abs()  # an all-positive row: 0 stays representable
    spec = QuantSpec(bits=bits, group_size=16, symmetric=symmetric)
    codes, scales, zeros = quantize_codes(w, spec)
    ref_codes, ref_scales, ref_zeros = _reference(w, spec)
    assert scales.dtype == torch.float16 and zeros.dtype == codes.dtype == torch.uint8
    assert torch.equal(scales, ref_scales) and torch.equal(zeros, ref_zeros)
    assert torch.equal(codes, ref_codes)
    assert int(codes.max()) < 2**bits

    qw = quantize_weight(w, spec)
    deq = dequantize(qw)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    step = scales.float().repeat_interleave(16, dim=1)[:, :cols]
    err = (w.double() - deq.double()).abs()
    assert torch.all(err <= step.double() / 2 * (1 + 1e-9)), float((err / step).max())
    assert torch.all(deq[0, :16] == 0)
    # packed size: bits per weight (of the padded row) + one float16 scale and one zero per group
    n_groups = math.ceil(cols / 16)
    assert qw.qweight.shape == (12, n_groups * 16 * bits // 8)
    assert qw.nbytes == 12 * (n_groups * 16 * bits // 8 + 3 * n_groups)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_packing_round_trip_and_bit_order(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (5, 48), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 48 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)
    # little-endian bit stream: code k sits at stream bits [k*bits, (k+1)*bits)
    stream = int.from_bytes(bytes(packed[0].tolist()), "little")
    assert [(stream >> (k * bits)) & (2**bits - 1) for k in range(48)] == codes[0].tolist()
    if bits == 4:  # two codes per byte, low nibble first
        assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 1]) << 4


def test_quantizer_input_checks():
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=1)
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantSpec(group_size=12)
    with pytest.raises(ValueError, match="NaN"):
        quantize_codes(torch.tensor([[math.nan] * 8]), QuantSpec(group_size=8))
    with pytest.raises(ValueError, match="whole bytes"):
        pack_codes(torch.zeros(2, 3, dtype=torch.uint8), 3)
