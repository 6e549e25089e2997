"""1-bit Adam's math (acco_loco/onebit.py, docs/onebit_adam.md) without process groups: one
compressed step of N workers against a float64 reference of its equations, the error-feedback
sum property, the mask of unused values, the rows on the wire, and the freeze rule."""

from __future__ import annotations

import math

import pytest
import torch

from acco_loco import onebit
from acco_loco.optim import OptimizerSpec
from acco_loco.registry import WIRE_CODECS

G = 8  # values per sign1 group


def sign_rms_f64(h: torch.Tensor, group: int = G) -> torch.Tensor:
    """deQ(Q(h)) of sign1 in float64: per group sign(h) (sign(0) = +1) x sqrt(mean(h^2))."""
    hg = h.double().view(-1, group)
    scale = hg.square().mean(dim=1, keepdim=True).sqrt()
    return (torch.where(hg >= 0, 1.0, -1.0) * scale).view(-1)


def simulate_step(momentum, contributions, worker_errors, server_error, mask, beta1, codec):
    """One compressed step of len(contributions) workers with the pure functions, the all-to-all
    and the all-gather done by hand. Returns (new momentum, new worker errors, new server error)."""
    n, size = len(contributions), momentum.numel() // len(contributions)
    rows, new_worker_errors = [], []
    for u, e in zip(contributions, worker_errors):
        h = onebit.worker_message(momentum, u.clone(), e, beta1)
        payload, scales, err = onebit.compress_with_error(h, codec, mask)
        rows.append(onebit.split_rows(payload, scales, n))
        new_worker_errors.append(err)
    owner_rows, new_server_error = [], []
    for j in range(n):
        received = torch.stack([r[j] for r in rows])  # row j of every worker: what owner j gets
        mine = onebit.server_average(received, codec, size).add_(server_error[j * size:(j + 1) * size])
        payload, scales, err = onebit.compress_with_error(mine, codec, mask[j * size:(j + 1) * size])
        owner_rows.append(onebit.split_rows(payload, scales, 1)[0])
        new_server_error.append(err)
    out = torch.empty_like(momentum)
    m = onebit.decode_rows(torch.stack(owner_rows), codec, size, mask, out=out)
    return m, new_worker_errors, torch.cat(new_server_error)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_step_matches_the_float64_equations(world):
    gen = torch.Generator().manual_seed(world)
    size, beta1 = 4 * G, 0.9
    numel = world * size
    codec = WIRE_CODECS["sign1"](G, "float32")
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[3] = True  # an unused value
    mask[-5:] = True  # a tail of padding
    momentum = torch.randn(numel, generator=gen).masked_fill_(mask, 0)
    us = [torch.randn(numel, generator=gen).masked_fill_(mask, 0) for _ in range(world)]
    errs = [0.1 * torch.randn(numel, generator=gen).masked_fill_(mask, 0) for _ in range(world)]
    server = 0.1 * torch.randn(numel, generator=gen).masked_fill_(mask, 0)
    m, new_errs, new_server = simulate_step(momentum, us, errs, server, mask, beta1, codec)

    # the equations in float64
    hs = [beta1 * momentum.double() + (1 - beta1) * u.double() + e.double() for u, e in zip(us, errs)]
    sent = [sign_rms_f64(h) for h in hs]
    want_errs = [(h - s).masked_fill(mask, 0) for h, s in zip(hs, sent)]
    hs_server = sum(sent) / world + server.double()
    want_m = sign_rms_f64(hs_server).masked_fill(mask, 0)
    want_server = (hs_server - sign_rms_f64(hs_server)).masked_fill(mask, 0)
    assert torch.allclose(m.double(), want_m, rtol=1e-6, atol=1e-7)
    assert torch.allclose(new_server.double(), want_server, rtol=1e-5, atol=1e-6)
    for got, want in zip(new_errs, want_errs):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not m[mask].any() and not new_server[mask].any() and all(not e[mask].any() for e in new_errs)
    assert (m[~mask] != 0).all()  # a real 1-bit message: every other value is +-scale


def test_error_feedback_sums_what_was_meant():
    """sum over steps of what was sent + the final error == sum of the inputs, at the worker and at
    the server (both are classic error feedback: e = h - deQ(Q(h)))."""
    gen = torch.Generator().manual_seed(0)
    codec = WIRE_CODECS["sign1"](G, "float32")
    numel, steps = 8 * G, 30
    none = torch.zeros(numel, dtype=torch.bool)
    error = torch.zeros(numel)
    sent_sum, meant_sum = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for _ in range(steps):
        x = torch.randn(numel, generator=gen)
        payload, scales, error = onebit.compress_with_error(x + error, codec, none)
        sent_sum += codec.decode(payload, scales).double()
        meant_sum += x.double()
    assert torch.allclose(sent_sum + error.double(), meant_sum, atol=1e-4)
    assert (sent_sum - meant_sum).abs().max() > 1e-2  # the error is not trivially 0: the check can fail

    # the worker side through worker_message: with beta1 = 0 the message is u_w + e_w
    error, sent_sum, meant_sum = torch.zeros(numel), sent_sum.zero_(), meant_sum.zero_()
    for _ in range(steps):
        u = torch.randn(numel, generator=gen)
        meant_sum += u.double()
        h = onebit.worker_message(torch.zeros(numel), u, error, beta1=0.0)
        payload, scales, error = onebit.compress_with_error(h, codec, none)
        sent_sum += codec.decode(payload, scales).double()
    assert torch.allclose(sent_sum + error.double(), meant_sum, atol=1e-4)


def test_the_mask_keeps_unused_values_still():
    codec = WIRE_CODECS["sign1"](G, "float32")
    spec = OptimizerSpec(weight_decay=0.1)
    numel = 2 * G
    v = torch.rand(numel) + 0.5
    v[[2, 11]] = 0.0  # never had a gradient
    mask = onebit.unused_mask(v)
    assert mask.tolist() == [i in (2, 11) for i in range(numel)]
    # sign(0) = +1: an unmasked zero decodes to +scale and would move; masked, it stays 0
    h = torch.randn(numel).masked_fill_(mask, 0.0)
    payload, scales, err = onebit.compress_with_error(h, codec, mask)
    assert codec.decode(payload, scales)[mask].gt(0).all()
    assert not err[mask].any()
    m = onebit.decode_rows(onebit.split_rows(payload, scales, 2), codec, G, mask, out=torch.empty(numel))
    assert not m[mask].any()
    master = torch.randn(numel)
    d = onebit.frozen_denominator(v, 7, spec)
    new = onebit.apply_update(master, torch.ones(numel), d, mask, 0.1, 8, spec, out=torch.empty(numel))
    assert torch.equal(new[mask], master[mask])  # not even weight decay moves them
    assert (new[~mask] != master[~mask]).all()


def test_update_and_denominator_follow_adamw_formulas():
    gen = torch.Generator().manual_seed(1)
    spec = OptimizerSpec(betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
    numel, lr, frozen, step = 3 * G, 0.02, 5, 9
    v, m, master = torch.rand(numel, generator=gen), torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    d = onebit.frozen_denominator(v, frozen, spec)
    want_d = v.double().sqrt() / math.sqrt(1 - 0.99**frozen) + 1e-6
    assert torch.allclose(d.double(), want_d, rtol=1e-6)
    none = torch.zeros(numel, dtype=torch.bool)
    new = onebit.apply_update(master, m, d, none, lr, step, spec, out=torch.empty(numel))
    want = master.double() * (1 - lr * 0.05) - lr / (1 - 0.9**step) * m.double() / want_d
    assert torch.allclose(new.double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_rows_carry_each_shard_and_its_scales(scale_dtype):
    """A shard of one group puts its scales at byte offset 1 (not a multiple of 4): still exact."""
    codec = WIRE_CODECS["sign1"](G, scale_dtype)
    x = torch.randn(3 * G)
    payload, scales = codec.encode(x)
    rows = onebit.split_rows(payload, scales, 3)
    assert rows.shape == (3, codec.wire_bytes(G))
    for j in range(3):
        p, s = onebit.row_parts(rows[j], codec, G)
        assert torch.equal(codec.decode(p, s), codec.decode(payload, scales)[j * G:(j + 1) * G])


def test_variance_rule():
    # a norm that settles: 100, 50, 25, 20, 19.5, 19.4, ...
    norms = [100.0, 50.0, 25.0, 20.0, 19.5, 19.4, 19.35]
    due = [onebit.variance_settled(k + 1, norms[:k + 1], window=2, tolerance=0.05, min_steps=1) for k in range(7)]
    # step 5: |19.5 - 25| / 25 = 0.22; step 6: |19.4 - 20| / 20 = 0.03 <= 0.05
    assert due == [False, False, False, False, False, True, True]
    assert not onebit.variance_settled(6, norms[:6], window=2, tolerance=0.05, min_steps=7)  # too early
    assert not onebit.variance_settled(6, norms[:6], window=2, tolerance=0.02, min_steps=1)  # too strict
    assert not onebit.variance_settled(3, [1.0, 1.0], window=2, tolerance=0.5, min_steps=1)  # not a window yet
    v = torch.tensor([1.0, 3.0, 0.0])
    assert float(onebit.corrected_l1(v, 2, 0.9)) == pytest.approx(4.0 / (1 - 0.81))
