"""acco_loco/topk_codec.py ``segment_sums``: the median clip's per-tensor sums of squares in a fixed
order on every device (CUDA's ``index_add_`` adds with atomics, in no fixed order): against a
float64 reference within fp32 rounding, bit for bit what ``index_add_`` gives on a CPU (the sums
the clip took before, added one after the other), and a running total carried over pieces."""

from __future__ import annotations

import pytest
import torch

from acco_loco.topk_codec import segment_sums


def _case(values: int, segments: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    segment_of = torch.randint(0, segments, (values,), generator=g)
    scale = torch.logspace(-4, 4, values)[torch.randperm(values, generator=g)]  # magnitudes far apart
    squares = (torch.randn(values, generator=g) * scale) ** 2
    return segment_of, squares


@pytest.mark.parametrize("values,segments", [(0, 3), (1, 1), (17, 5), (100_000, 37), (4096, 4096)])
def test_equal_to_index_add_on_cpu_and_to_float64_within_rounding(values, segments):
    segment_of, squares = _case(values, segments)
    got = segment_sums(segment_of, squares, torch.zeros(segments))
    before = torch.zeros(segments).index_add_(0, segment_of, squares)  # what the clip summed with
    assert torch.equal(got, before)
    exact = torch.zeros(segments, dtype=torch.float64).index_add_(0, segment_of, squares.double())
    counts = torch.bincount(segment_of, minlength=segments).double()
    # a sequential fp32 sum of n non-negative terms is within (n - 1) eps of the exact sum
    bound = counts.clamp(min=1) * torch.finfo(torch.float32).eps * exact
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_sums_from_running_totals_in_pieces_equal_the_whole():
    segment_of, squares = _case(50_000, 11, seed=1)
    whole = segment_sums(segment_of, squares, torch.zeros(11))
    total = torch.zeros(11)
    for a in range(0, 50_000, 7_000):  # pieces in order, each added to the totals so far
        total = segment_sums(segment_of[a:a + 7_000], squares[a:a + 7_000], total)
    assert torch.equal(total, whole)
    assert torch.equal(total, torch.zeros(11).index_add_(0, segment_of, squares))


def test_the_order_given_is_the_order_added():
    """Two values that round differently in the two orders: the sum follows the order given."""
    big, small = torch.tensor(1.0), torch.tensor(2.0 ** -24)
    forward = segment_sums(torch.zeros(3, dtype=torch.int64), torch.stack([big, small, small]), torch.zeros(1))
    backward = segment_sums(torch.zeros(3, dtype=torch.int64), torch.stack([small, small, big]), torch.zeros(1))
    assert forward.item() == 1.0 and backward.item() == 1.0 + 2.0 ** -23


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same dtype"):
        segment_sums(torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.float64), torch.zeros(1))
    with pytest.raises(ValueError, match="one segment each"):
        segment_sums(torch.zeros(3, dtype=torch.int64), torch.ones(2), torch.zeros(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_sums_are_the_same_bits_every_time():
    segment_of, squares = _case(1 << 20, 7, seed=2)
    dev_ids, dev_squares = segment_of.cuda(), squares.cuda()
    first = segment_sums(dev_ids, dev_squares, torch.zeros(7, device="cuda"))
    for _ in range(10):
        assert torch.equal(segment_sums(dev_ids, dev_squares, torch.zeros(7, device="cuda")), first)
    exact = torch.zeros(7, dtype=torch.float64).index_add_(0, segment_of, squares.double())
    assert torch.allclose(first.cpu().double(), exact, rtol=1e-5, atol=0)
