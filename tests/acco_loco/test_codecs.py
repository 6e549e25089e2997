"""Unit tests for acco_loco.codecs against plain float64 references (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from acco_loco.codecs import Codec, pack_bits, pad_to_multiple, unpack_bits
from acco_loco.int_codec import IntCodec
from acco_loco.registry import CODEC_BITS, make_codec

INT_CODECS = ["int8", "int4", "int2"]
ALL_CODECS = [*INT_CODECS, "sign1"]
SCALE_DTYPES = [torch.float32, torch.bfloat16]


def _rand_groups(groups: int, group_size: int, seed: int = 0, zero_groups: int = 2) -> torch.Tensor:
    """Random fp32 values whose magnitude varies by 6 decades from group to group, with a few
    all-zero groups and a few exact zeros / negative zeros inside groups."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** torch.empty(groups, 1).uniform_(-3, 3, generator=g)
    x = torch.randn(groups, group_size, generator=g) * mag
    x[torch.randperm(groups, generator=g)[:zero_groups]] = 0.0
    x.view(-1)[torch.randperm(x.numel(), generator=g)[:5]] = 0.0
    x.view(-1)[torch.randperm(x.numel(), generator=g)[:5]] = -0.0
    return x.view(-1)


def _ref_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Plain reference: sum of code_k << (k*bits) over each run of 8 // bits codes."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return ((codes.view(-1, per).to(torch.int64) & ((1 << bits) - 1)) << shifts).sum(1).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# error bounds and exact values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", INT_CODECS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group_size", [8, 128])
def test_int_error_bound_and_reference(name, scale_dtype, group_size):
    codec = make_codec(name, group_size=group_size, scale_dtype=scale_dtype)
    bits = CODEC_BITS[name]
    qmax = 2 ** (bits - 1) - 1
    x = _rand_groups(4096 // group_size * 4, group_size, seed=bits + group_size)
    payload, scales = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == x.numel() * bits // 8
    assert scales.dtype == scale_dtype and scales.numel() == x.numel() // group_size
    y = codec.decode(payload, scales)
    assert y.dtype == torch.float32 and y.shape == x.shape

    x64 = x.double().view(-1, group_size)
    s64 = scales.double()[:, None]
    amax = x64.abs().amax(1, keepdim=True)
    if scale_dtype == torch.float32:
        # the scale is absmax / qmax computed in fp32
        assert torch.equal(scales, (x.view(-1, group_size).abs().amax(1) / qmax))
    else:
        # the scale is the smallest bf16 >= absmax / qmax (rounded up before quantizing)
        exact = (x.view(-1, group_size).abs().amax(1) / qmax).double()[:, None]
        assert (s64 >= exact).all()
        below = torch.nextafter(scales, torch.zeros_like(scales)).double()[:, None]  # previous bf16
        assert ((below < exact) | (s64 == 0)).all()

    # per element |h - deQ(Q(h))| <= scale / 2, with the scale actually sent
    err = (x64 - y.double().view(-1, group_size)).abs()
    tol = 1e-6 * s64 + 1e-30
    assert (err <= s64 / 2 + tol).all(), (err - s64 / 2).max()

    # decode equals the plain reference q * scale with q = clamp(round(h / scale))
    safe = torch.where(s64 > 0, s64, torch.ones_like(s64))
    q_ref = torch.clamp(torch.round(x64 / safe), -qmax - 1, qmax)
    assert torch.equal(y.double().view(-1, group_size), (q_ref * s64).float().double())
    # the absmax element of each non-zero group uses the full range +-qmax (bf16 scales are
    # rounded up by at most 2**-7 relative, which can cost int8 one code: 127 / 1.0078 -> 126)
    top = (x64.abs() == amax) & (amax > 0)
    lowest = qmax if scale_dtype == torch.float32 else round(qmax / (1 + 2.0**-7))
    assert (q_ref[top].abs() >= lowest).all() and (q_ref.abs() <= qmax).all()
    # zero groups decode to exact zeros (no NaN from 0/0)
    zero = (amax == 0).squeeze(1)
    assert zero.any() and (y.view(-1, group_size)[zero] == 0).all()
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_sign1_decodes_to_sign_times_rms(scale_dtype):
    codec = make_codec("sign1", group_size=64, scale_dtype=scale_dtype)
    x = _rand_groups(64, 64, seed=7)
    x[:3] = 0.0  # an exact zero and a negative zero at the start of a non-zero group
    x[3] = -0.0
    x[64 * 5 : 64 * 6] = 0.0  # whole zero group somewhere in the middle
    payload, scales = codec.encode(x)
    assert payload.numel() == x.numel() // 8
    y = codec.decode(payload, scales)
    s = scales.float()[:, None]
    sign = torch.where(x.view(-1, 64) >= 0, 1.0, -1.0)  # sign(0) = sign(-0.0) = +1
    assert torch.equal(y.view(-1, 64), sign * s)
    assert (y[:4] == scales[0].float()).all()  # zeros decode to +rms
    rms64 = x.double().view(-1, 64).pow(2).mean(1).sqrt()
    rtol = 1e-6 if scale_dtype == torch.float32 else 2.0**-8
    assert ((scales.double() - rms64).abs() <= rtol * rms64).all()


def test_sign1_rms_no_overflow_or_underflow():
    codec = make_codec("sign1", group_size=8)
    x = torch.tensor([3e30, -1e30, 2e30, 0, 0, 0, 0, 1e30] + [1e-30, -2e-30, 0, 0, 0, 0, 0, 5e-31])
    payload, scales = codec.encode(x)
    rms64 = x.double().view(-1, 8).pow(2).mean(1).sqrt()
    assert ((scales.double() - rms64).abs() <= 1e-6 * rms64).all()


def test_bf16_scale_rounding_direction_matters():
    """A group whose absmax/qmax rounds *down* to nearest bf16: nearest rounding would clamp
    the absmax element and break the bound; rounding up keeps it."""
    codec = make_codec("int8", group_size=8, scale_dtype=torch.bfloat16)
    # 127 * (1 + 2**-8 + 2**-20): absmax/127 sits just above a bf16 value -> nearest rounds down
    a = 127.0 * (1 + 2**-8 * 0.9)
    x = torch.tensor([a, -a / 3, 0.5, 0, 0, 0, 0, 1.0])
    assert torch.tensor(a / 127).to(torch.bfloat16).float() < a / 127  # nearest is below
    payload, scales = codec.encode(x)
    y = codec.decode(payload, scales)
    assert ((x - y).abs() <= scales.float() / 2).all()
    assert scales.float() >= a / 127


@pytest.mark.parametrize("name", INT_CODECS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_subnormal_groups_keep_the_bound(name, scale_dtype):
    """absmax/qmax below the smallest normal fp32 would be a subnormal scale with few
    significant bits, letting h/scale overshoot qmax; the scale is floored at 2**-126."""
    codec = make_codec(name, group_size=8, scale_dtype=scale_dtype)
    tiny = torch.finfo(torch.float32).tiny
    x = torch.tensor([3e-39, -1e-40, 7e-45, 0, 0, 0, 2e-39, -3e-39] + [1.0, -0.5, 0.25, 0, 0, 0, 0, 0.125])
    payload, scales = codec.encode(x)
    y = codec.decode(payload, scales)
    s = scales.float().repeat_interleave(8).double()
    assert scales[0].float() == tiny
    assert ((x.double() - y.double()).abs() <= s / 2 * (1 + 1e-6)).all()


def test_accepts_lower_precision_input():
    codec = make_codec("int8", group_size=16)
    x = torch.randn(64).to(torch.bfloat16)
    p1, s1 = codec.encode(x)
    p2, s2 = codec.encode(x.float())
    assert torch.equal(p1, p2) and torch.equal(s1, s2)


# ---------------------------------------------------------------------------------------------
# packing, padding, slices
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (8 * 1000,), dtype=torch.uint8, generator=g)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == codes.numel() * bits // 8
    assert torch.equal(packed, _ref_pack(codes, bits))  # element order, little-endian in a byte
    assert torch.equal(unpack_bits(packed, bits), codes)
    assert torch.equal(unpack_bits(packed, bits, numel=13), codes[:13])
    # high bits beyond `bits` are ignored
    noisy = codes | (torch.randint(0, 256, codes.shape, dtype=torch.uint8, generator=g) << bits if bits < 8 else 0)
    assert torch.equal(pack_bits(noisy.to(torch.uint8), bits), packed)
    # a view that starts at an odd offset packs the same as a copy
    sub = codes[1 : 1 + 8 * 50]
    assert torch.equal(pack_bits(sub, bits), _ref_pack(sub.clone(), bits))


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_bits(torch.zeros(6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="uint8"):
        pack_bits(torch.zeros(8, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="holds 4 codes"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 4, numel=9)


@pytest.mark.parametrize("name", ALL_CODECS)
def test_pad_to_multiple_odd_sizes(name):
    codec = make_codec(name, group_size=32)
    x = torch.randn(1000)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        codec.encode(x)
    xp = pad_to_multiple(x, 32)
    assert xp.numel() == 1024 and torch.equal(xp[:1000], x) and (xp[1000:] == 0).all()
    assert pad_to_multiple(xp, 32) is xp
    y = codec.decode(*codec.encode(xp))[:1000]
    if name != "sign1":
        s = codec.encode(xp)[1].float().repeat_interleave(32)[:1000]
        assert ((x - y).abs() <= s / 2 * (1 + 1e-6)).all()
    assert pad_to_multiple(torch.ones(5), 4, value=7.0).tolist() == [1, 1, 1, 1, 1, 7, 7, 7]
    with pytest.raises(ValueError):
        pad_to_multiple(torch.ones(5), 0)


@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_shard_slices_decode_independently(name, scale_dtype):
    group, shards, per_shard = 64, 4, 3  # 3 groups per shard
    codec = make_codec(name, group_size=group, scale_dtype=scale_dtype)
    bits = codec.bits
    x = _rand_groups(shards * per_shard, group, seed=11, zero_groups=1)
    payload, scales = codec.encode(x)
    full = codec.decode(payload, scales)
    S = per_shard * group
    out = torch.randn(S)
    start = out.clone()
    acc64 = start.double()
    for i in range(shards):
        a, b = i * S, (i + 1) * S
        p_i = payload[a * bits // 8 : b * bits // 8]
        s_i = scales[a // group : b // group]
        assert p_i.numel() == payload.numel() // shards and s_i.numel() == scales.numel() // shards
        assert torch.equal(codec.decode(p_i, s_i), full[a:b])  # slice of payload/scales == slice of decode
        dst = torch.empty(S)
        assert codec.decode(p_i, s_i, out=dst) is dst and torch.equal(dst, full[a:b])
        codec.decode(p_i, s_i, out=out, accumulate=True)  # the owner's sum over N slices
        acc64 += full[a:b].double()
    # accumulate sums in fp32 (possibly with a fused multiply-add): within fp32 rounding
    bound = 4 * shards * torch.finfo(torch.float32).eps * (start.abs().double() + full.abs().double().view(shards, S).sum(0))
    assert ((out.double() - acc64).abs() <= bound + 1e-30).all()


def test_wire_bytes():
    c = make_codec("int4", group_size=128)
    assert (c.payload_bytes(1024), c.scale_bytes(1024), c.wire_bytes(1024)) == (512, 32, 544)
    c = make_codec("sign1", group_size=128, scale_dtype="bf16")
    assert (c.payload_bytes(1024), c.scale_bytes(1024), c.wire_bytes(1024)) == (128, 16, 144)
    c = make_codec("int2", group_size=256)
    p, s = c.encode(torch.randn(2048))
    assert p.numel() + s.numel() * 4 == c.wire_bytes(2048)
    with pytest.raises(ValueError, match="multiple of group_size"):
        c.wire_bytes(1000)


# ---------------------------------------------------------------------------------------------
# stochastic rounding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", INT_CODECS)
def test_stochastic_rounding_unbiased_and_within_one_step(name):
    group, draws = 32, 4000
    codec = make_codec(name, group_size=group)
    h = _rand_groups(4, group, seed=3, zero_groups=1)
    # `draws` copies of the same groups in one call: identical scales, independent uniforms
    x = h.repeat(draws)
    gen = torch.Generator().manual_seed(1234)
    payload, scales = codec.encode(x, generator=gen)
    y = codec.decode(payload, scales).view(draws, -1).double()
    s = scales.view(draws, -1)[0].double().repeat_interleave(group)
    assert torch.equal(scales.view(draws, -1), scales.view(draws, -1)[:1].expand(draws, -1))
    # every draw is one of the two neighbouring grid points: within one step
    assert ((y - h.double()).abs() <= s * (1 + 1e-6)).all()
    # unbiased: E[deQ(Q(h))] = h; the std of one draw is <= scale/2
    mean = y.mean(0)
    assert ((mean - h.double()).abs() <= 5 * s / (2 * math.sqrt(draws)) + 1e-30).all()
    # ... while round-to-nearest is biased by more than that bound somewhere
    det = codec.decode(*codec.encode(h)).double()
    assert ((det - h.double()).abs() > 5 * s / (2 * math.sqrt(draws))).any()
    # reproducible from the generator seed
    again = codec.encode(x, generator=torch.Generator().manual_seed(1234))[0]
    assert torch.equal(again, payload)


# ---------------------------------------------------------------------------------------------
# zeros, NaN / Inf, bad configuration
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_all_zero_input(name, scale_dtype):
    codec = make_codec(name, group_size=16, scale_dtype=scale_dtype)
    payload, scales = codec.encode(torch.zeros(64))
    assert (scales == 0).all()
    y = codec.decode(payload, scales)
    assert torch.equal(y, torch.zeros(64))
    empty_p, empty_s = codec.encode(torch.zeros(0))
    assert empty_p.numel() == 0 and empty_s.numel() == 0 and codec.decode(empty_p, empty_s).numel() == 0


@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_raises(name, bad):
    codec = make_codec(name, group_size=16)
    x = torch.randn(64)
    x[37] = bad
    with pytest.raises(ValueError, match="NaN/Inf.*diverged loss.*nan policy"):
        codec.encode(x)
    codec.encode(x, check_finite=False)  # the caller may opt out (its own policy)


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match="valid codecs: int8, int4, int2, sign1"):
        make_codec("int3")
    with pytest.raises(ValueError, match="multiple of 8"):
        make_codec("int4", group_size=12)
    with pytest.raises(ValueError, match="multiple of 8"):
        make_codec("int4", group_size=0)
    with pytest.raises(ValueError, match="scale_dtype"):
        make_codec("int4", scale_dtype=torch.float16)
    with pytest.raises(ValueError, match="valid: fp32"):
        make_codec("int4", scale_dtype="fp8")
    # names and widths meet in acco_loco/registry.py; a family checks only the widths it packs
    with pytest.raises(ValueError, match="no codec family"):
        Codec("int4", bits=4)
    with pytest.raises(ValueError, match="packs 8, 4, 2 bits"):
        IntCodec("int4", bits=3)
    c = make_codec("int4", group_size=16)
    with pytest.raises(ValueError, match="flat 1-D"):
        c.encode(torch.randn(4, 16))
    with pytest.raises(ValueError, match="floating"):
        c.encode(torch.ones(16, dtype=torch.int32))
    p, s = c.encode(torch.randn(64))
    with pytest.raises(ValueError, match="payload bytes"):
        c.decode(p[:-1], s)
    with pytest.raises(ValueError, match="needs an out"):
        c.decode(p, s, accumulate=True)
    with pytest.raises(ValueError, match="out must be"):
        c.decode(p, s, out=torch.empty(64, dtype=torch.float64))
    assert make_codec("int8", scale_dtype="bf16").scale_dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ALL_CODECS)
def test_cuda_matches_cpu(name):
    codec = make_codec(name, group_size=128, scale_dtype=torch.bfloat16)
    x = _rand_groups(64, 128, seed=5)
    p_cpu, s_cpu = codec.encode(x)
    p_gpu, s_gpu = codec.encode(x.cuda())
    assert p_gpu.is_cuda and s_gpu.is_cuda
    assert torch.equal(p_gpu.cpu(), p_cpu)
    if name == "sign1":  # rms reduction order may differ by an ulp
        assert torch.allclose(s_gpu.cpu().float(), s_cpu.float(), rtol=1e-2)
    else:
        assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(codec.decode(p_gpu, s_gpu).cpu(), codec.decode(p_cpu, s_gpu.cpu()))
    gen = torch.Generator(device="cuda").manual_seed(0)
    codec.encode(x.cuda(), generator=gen)
    with pytest.raises(ValueError, match="generator is on"):
        codec.encode(x.cuda(), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "sign1"])
@pytest.mark.parametrize("scale_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_encode_with_decoded_equals_encode_then_decode(name, scale_dtype, stochastic):
    # values over 40 orders of magnitude, zero groups included
    x = torch.randn(8192, generator=torch.Generator().manual_seed(3)) * torch.logspace(-30, 10, 8192)
    x[1024:1152] = 0.0
    codec = make_codec(name, scale_dtype=scale_dtype)
    gen = (lambda: torch.Generator().manual_seed(7)) if stochastic else (lambda: None)
    payload, scales, decoded = codec.encode_with_decoded(x, gen())
    payload2, scales2 = codec.encode(x, gen())
    assert torch.equal(payload, payload2) and torch.equal(scales, scales2)
    assert decoded.dtype == torch.float32 and torch.equal(decoded, codec.decode(payload, scales))
