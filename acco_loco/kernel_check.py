"""The fused kernels (acco_loco/kernels.py) against the torch code they replace, bit for bit, on
random data of every supported shape: run once when the kernels are loaded, which are kept only
if nothing differs."""

from __future__ import annotations

import torch

from .adamw import propose as torch_adamw
from .codecs import Codec
from .registry import make_codec
from .feedback import ErrorFeedback, compress
from .optimizers import OptimizerSpec
from .shard_state import ShardState


def self_check(K) -> list[str]:
    """The names of the kernels that differ from torch (empty: all agree). ``K`` is the loaded
    kernels module (acco_loco/kernels.py passes itself: this file does not import it, so that the
    kernels, which run this check, and the check are no import circle)."""
    problems: list[str] = []
    gen = torch.Generator().manual_seed(1234)
    for group in (8, 128):
        n = 32 * group
        for bits in (8, 4, 2):
            codec = make_codec(f"int{bits}", group_size=group)
            problems += _check_encode_with_feedback(K, codec, n, gen)
            problems += _check_encode_plain(K, codec, n, gen)
            problems += _check_decode_sum(K, codec, n, gen)
            if bits in (8, 4):
                problems += _check_delta(K, codec, n, gen)
    problems += _check_adamw(K, gen)
    return problems


def _sizes(codec: Codec, n: int) -> tuple[int, int]:
    """Payload bytes and scale count of n values."""
    return n * codec.bits // 8, n // codec.group_size


def _check_encode_with_feedback(K, codec: Codec, n: int, gen: torch.Generator) -> list[str]:
    """LoCo and classic error feedback over three rounds, in two rows of half the values."""
    bits, group = codec.bits, codec.group_size
    pb, sb = _sizes(codec, n)
    for beta, count in ((0.8, 1), (0.8, 3), (0.0, 2)):
        fb = ErrorFeedback("loco" if beta else "ef", n, beta=beta if beta else None, group_size=group)
        codes, scl = fb._codes.clone(), fb._scales.clone()
        for it in range(3):
            x = torch.randn(n, generator=gen) * (10.0 ** (it - 1))
            x[:group] = 0.0  # an all-zero group
            want_p, want_s, _ = compress(x / count, codec, fb, check_finite=False)
            got = torch.empty(2, (pb + sb * 4) // 2, dtype=torch.uint8)
            bad = K.encode(x.data_ptr(), 2, n // 2, n // 2, count, bits, group, got.data_ptr(), got.shape[1],
                           pb // 2, codes.data_ptr(), scl.data_ptr(), it == 0, True, beta)
            got_p = got[:, :pb // 2].reshape(-1)
            got_s = got[:, pb // 2:].contiguous().view(torch.float32).reshape(-1)
            if bad or not (torch.equal(got_p, want_p) and torch.equal(got_s, want_s)
                           and torch.equal(codes, fb._codes) and torch.equal(scl, fb._scales)):
                return [f"encode int{bits} group {group} beta {beta} count {count} round {it}"]
    return []


def _check_encode_plain(K, codec: Codec, n: int, gen: torch.Generator) -> list[str]:
    """No feedback: the NaN flag with the same scales, then the codes of finite values."""
    bits, group = codec.bits, codec.group_size
    pb, sb = _sizes(codec, n)
    x = torch.randn(n, generator=gen)
    x[5] = float("nan")
    _, want_s = codec.encode(x, check_finite=False)
    got = torch.empty(pb + sb * 4, dtype=torch.uint8)
    bad = K.encode(x.data_ptr(), 1, n, n, 1, bits, group, got.data_ptr(), got.numel(), pb)
    if not bad or not torch.equal(got[pb:].view(torch.float32), want_s):
        return [f"encode int{bits} without feedback: the NaN flag or the scales"]
    x[5] = 0.0
    want_p, want_s = codec.encode(x)
    bad = K.encode(x.data_ptr(), 1, n, n, 1, bits, group, got.data_ptr(), got.numel(), pb)
    if bad or not (torch.equal(got[:pb], want_p) and torch.equal(got[pb:].view(torch.float32), want_s)):
        return [f"encode int{bits} without feedback"]
    return []


def _check_decode_sum(K, codec: Codec, n: int, gen: torch.Generator) -> list[str]:
    """The owner's weighted sum of three rows (payload, scales, fp32 weight each)."""
    bits, group = codec.bits, codec.group_size
    pb, sb = _sizes(codec, n)
    want, part = torch.zeros(n), torch.empty(n)
    rows = torch.empty(3, pb + sb * 4 + 4, dtype=torch.uint8)
    for j, w in enumerate((1.0, 3.0, 0.5)):
        p, s = codec.encode(torch.randn(n, generator=gen))
        codec.decode(p, s, out=part)
        want.addcmul_(part, torch.tensor(w))
        rows[j, :pb], rows[j, pb:pb + 4 * sb] = p, s.view(torch.uint8)
        rows[j, pb + 4 * sb:] = torch.tensor([w]).view(torch.uint8)
    got = torch.empty(n)
    K.decode_sum(rows.data_ptr(), 3, rows.shape[1], pb, rows.data_ptr() + pb + 4 * sb, rows.shape[1], n, bits,
                 group, got.data_ptr())
    return [] if torch.equal(got, want) else [f"decode_sum int{bits} group {group}"]


def _check_delta(K, codec: Codec, n: int, gen: torch.Generator) -> list[str]:
    """The parameter delta against what every replica holds, and its install."""
    bits, group = codec.bits, codec.group_size
    pb, sb = _sizes(codec, n)
    held = torch.randn(n, generator=gen)
    new = held + 1e-3 * torch.randn(n, generator=gen)
    want_p, want_s = codec.encode(new - held, check_finite=False)
    got = torch.empty(pb + sb * 4, dtype=torch.uint8)
    bad = K.delta_encode(new.data_ptr(), held.data_ptr(), n, bits, group, got.data_ptr(), pb)
    if bad or not (torch.equal(got[:pb], want_p) and torch.equal(got[pb:].view(torch.float32), want_s)):
        return [f"delta_encode int{bits} group {group}"]
    want_h, got_h = held.clone(), held.clone()
    want_h.add_(codec.decode(want_p, want_s))
    K.decode_add(got.data_ptr(), 1, got.numel(), pb, n, bits, group, got_h.data_ptr(), n)
    return [] if torch.equal(got_h, want_h) else [f"decode_add int{bits} group {group}"]


def _check_adamw(K, gen: torch.Generator) -> list[str]:
    """AdamW's moments and parameters from a gradient sum, with and without clipping."""
    n = 4096 + 8  # a tail past the last whole vector
    problems = []
    for betas, wd, coef, count in (((0.9, 0.999), 0.0, 1.0, 1), ((0.8, 0.95), 0.1, 0.37, 3),
                                   ((0.3, 0.99), 0.01, 1.0, 2), ((0.9, 0.999), 0.0, 0.5, 8)):
        spec = OptimizerSpec(betas=betas, weight_decay=wd)
        master = torch.randn(n, generator=gen)
        state = ShardState(master, 0.01 * torch.randn(n, generator=gen), 1e-4 * torch.rand(n, generator=gen), step=4)
        gsum = torch.randn(n, generator=gen)
        grad = gsum / count
        if coef < 1.0:
            grad.mul_(coef)
        want = torch_adamw(state, grad, 1e-3, spec)
        outs = [torch.empty(n) for _ in range(3)]
        K.adamw(gsum, count, coef, state.exp_avg, state.exp_avg_sq, state.master, *outs, 1e-3, state.step + 1, spec,
                torch.empty(n))
        if not all(torch.equal(a, b) for a, b in zip(outs, (want.exp_avg, want.exp_avg_sq, want.master))):
            problems.append(f"adamw betas {betas}")
    return problems
