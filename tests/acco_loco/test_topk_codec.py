"""The top-k codec (acco_loco/topk_codec.py) and the outer step (acco_loco/outer.py) against plain
references written out with sorts and loops."""

from __future__ import annotations

import math

import pytest
import torch

from acco_loco.outer import (accumulate_error, merge_delayed, outer_sgd_spec, outer_sgd_step,
                             pseudo_gradient, sample_shares, sparse_outer_step)
from acco_loco.shard_state import ShardState
from acco_loco.topk_codec import TopKCodec, aggregate


def ref_select(x: torch.Tensor, chunk: int, k: int) -> list[list[int]]:
    """Per chunk, the k positions of largest |x|, lower index first among equals, ascending."""
    out = []
    values = x.tolist() + [0.0] * (-len(x) % chunk)
    for start in range(0, len(values), chunk):
        part = values[start:start + chunk]
        order = sorted(range(chunk), key=lambda j: (-abs(part[j]), j))
        out.append(sorted(order[:k]))
    return out


def ref_dequantize(v: float, lo: float, hi: float, bits: int) -> float:
    levels = 2 ** (bits - 1)
    step = (hi - lo) / levels
    q = 0 if step == 0 else min(levels - 1, max(0, math.floor((abs(v) - lo) / step)))
    mag = lo + (q + 0.5) * step
    return -mag if v < 0 else mag


def _values(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 10.0 ** torch.empty(n).uniform_(-2, 2, generator=g)


@pytest.mark.parametrize("chunk, density, numel", [(32, 0.25, 100), (4096, 0.02, 3 * 4096 + 17),
                                                   (100, 0.1, 250), (2, 0.5, 7)])
def test_selection_matches_sorted_reference(chunk, density, numel):
    codec = TopKCodec(chunk, density, 2)
    x = _values(numel)
    idx, values = codec.select(x)
    want = ref_select(x, chunk, codec.k)
    assert idx.tolist() == want
    padded = torch.cat([x, torch.zeros(-numel % chunk)]).view(-1, chunk)
    assert torch.equal(values, torch.gather(padded, 1, idx))


def test_ties_are_broken_by_the_lower_index():
    x = torch.tensor([0.5, -2.0, 2.0, 1.0, -2.0, 2.0, 0.0, -0.0])
    codec = TopKCodec(8, 0.375, 2)  # k = 3 of four values with |x| = 2
    assert codec.k == 3
    assert codec.select(x)[0].tolist() == [[1, 2, 4]]
    zeros = torch.tensor([0.0, -0.0, 0.0, 0.0])  # all equal: the first k
    assert TopKCodec(4, 0.5, 2).select(zeros)[0].tolist() == [[0, 1]]
    # the result depends on the values only, not on how the tensor was built
    assert torch.equal(codec.encode(x), codec.encode(x.clone().flip(0).flip(0)))


def test_k_is_the_ceiling_of_density_times_chunk():
    assert TopKCodec(4096, 0.02, 2).k == 82  # ceil(81.92)
    assert TopKCodec(30, 0.1, 2).k == 3  # 0.1 * 30 is 3.0000000000000004 in floats
    assert TopKCodec(4096, 1e-9, 2).k == 1
    assert TopKCodec(16, 1.0, 2).k == 16


@pytest.mark.parametrize("chunk", [2, 5, 32, 100, 4096, 2**16])
def test_index_packing_round_trips(chunk):
    codec = TopKCodec(chunk, 0.3, 4)
    x = _values(3 * chunk + 1, seed=chunk)
    idx, _ = codec.select(x)
    pos, _ = codec.decode_sparse(codec.encode(x), x.numel())
    offsets = torch.arange(idx.shape[0])[:, None] * chunk
    want = (idx + offsets).reshape(-1)
    assert torch.equal(pos, want[want < x.numel()])
    assert codec.index_bits == math.ceil(math.log2(chunk))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quantization_error_bound_and_exact_levels(bits):
    codec = TopKCodec(64, 0.25, bits)
    x = _values(64 * 20 + 5, seed=bits)
    payload, dense = codec.encode_with_decoded(x)
    idx, values = codec.select(x)
    lo, hi = values.abs().min(1).values, values.abs().max(1).values
    bound = (hi - lo) / 2 ** bits
    offsets = torch.arange(idx.shape[0])[:, None] * 64
    for m in range(idx.shape[0]):
        for j, v in zip(idx[m].tolist(), values[m].tolist()):
            p = offsets[m, 0].item() + j
            if p >= x.numel():
                continue
            got = dense[p].item()
            assert abs(got - v) <= bound[m].item() + hi[m].item() * 2**-21, (m, j)  # + fp32 rounding of the level
            assert got == pytest.approx(ref_dequantize(v, lo[m].item(), hi[m].item(), bits), rel=1e-6, abs=1e-12)
            assert (got < 0) == (v < 0)
    kept = torch.zeros(x.numel(), dtype=torch.bool)
    pos, _ = codec.decode_sparse(payload, x.numel())
    kept[pos] = True
    assert torch.all(dense[~kept] == 0)  # nothing where nothing was sent
    assert torch.equal(codec.decode(payload, x.numel()), dense)  # the receiver sees what the sender counted


def test_bytes_formula():
    codec = TopKCodec(4096, 0.02, 2)  # k = 82, 12-bit indices
    numel = 10 * 4096
    assert codec.payload_bytes(numel) == 10 * 82 * 12 // 8 + 10 * 82 * 2 // 8 + 8 * 10  # 1230 + 205 + 80
    assert codec.encode(_values(numel)).numel() == 1515
    odd = TopKCodec(100, 0.05, 1)  # k = 5, 7-bit indices, 3 chunks for 201 values
    assert odd.payload_bytes(201) == math.ceil(3 * 5 * 7 / 8) + math.ceil(3 * 5 / 8) + 24
    assert odd.encode(_values(201)).numel() == odd.payload_bytes(201)


def test_aggregate_mean_and_contributors():
    codec = TopKCodec(16, 0.25, 8)
    rows = [_values(40, seed=s) for s in range(3)]
    payloads = torch.stack([codec.encode(r) for r in rows])
    decoded = [codec.decode(p, 40).double() for p in payloads]
    weights = [0.5, 0.25, 0.25]
    mean = aggregate(codec, payloads, weights, 40, "mean")
    assert torch.allclose(mean.double(), sum(w * d for w, d in zip(weights, decoded)), rtol=1e-6, atol=1e-9)
    contrib = aggregate(codec, payloads, weights, 40, "contributors")
    senders = sum(w * (d != 0).double() for w, d in zip(weights, decoded))
    want = torch.where(senders > 0, sum(w * d for w, d in zip(weights, decoded)) / senders.clamp_min(1e-30),
                       torch.zeros_like(senders))
    assert torch.allclose(contrib.double(), want, rtol=1e-6, atol=1e-9)
    assert not torch.allclose(mean, contrib)  # the two rules really differ
    skipped = aggregate(codec, payloads, [1.0, 0.0, 0.0], 40, "mean")
    assert torch.equal(skipped, decoded[0].float())


def test_refusals():
    with pytest.raises(ValueError, match="NaN/Inf"):
        TopKCodec(8, 0.5, 2).encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="chunk must be an integer in"):
        TopKCodec(1, 0.5, 2)
    with pytest.raises(ValueError, match="density must be a finite number in"):
        TopKCodec(8, 0.0, 2)
    with pytest.raises(ValueError, match="bits must be one of"):
        TopKCodec(8, 0.5, 3)
    with pytest.raises(ValueError, match="1-D uint8 tensor of"):
        TopKCodec(8, 0.5, 2).decode(torch.zeros(3, dtype=torch.uint8), 8)


def test_outer_sgd_matches_torch_nesterov_and_the_other_pieces():
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(50, generator=g, dtype=torch.float64)
    deltas = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(3)]
    ref = theta0.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    state = ShardState(master=theta0.float(), exp_avg=torch.zeros(50))
    spec = outer_sgd_spec(0.9, True)
    for d in deltas:
        ref.grad = d
        opt.step()
        before = state.master.clone()
        state = outer_sgd_step(state, d.float(), 0.7, spec)
        assert not torch.equal(before, state.master)
    assert float((state.master.double() - ref.detach()).norm() / ref.detach().norm()) < 1e-6
    theta_sync, theta_local = torch.randn(50, generator=g), torch.randn(50, generator=g)
    assert torch.equal(pseudo_gradient(theta_sync, theta_local), theta_sync - theta_local)
    e = torch.ones(50)
    assert torch.allclose(accumulate_error(e, deltas[0].float(), 0.95), 0.95 + deltas[0].float())
    assert torch.allclose(sparse_outer_step(theta_sync, deltas[0].float(), 0.5), theta_sync - 0.5 * deltas[0].float())
    local, submitted, new = torch.randn(50, generator=g), torch.randn(50, generator=g), torch.randn(50, generator=g)
    want = local + (new - submitted)
    assert torch.allclose(merge_delayed(local, new, submitted), want)
    assert sample_shares([32, 16, 16]) == [0.5, 0.25, 0.25] and sample_shares([0, 0]) == [0.0, 0.0]
