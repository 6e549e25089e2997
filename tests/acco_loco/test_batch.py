"""acco_loco/batch.py: a global batch split over rounds and workers sums to the target exactly."""

from __future__ import annotations

import math
import random

import pytest

from acco_loco.batch import SpeedEstimate, equal_shares, round_targets, speed_shares


@pytest.mark.parametrize("total", range(1, 40))
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_round_targets_sum_to_the_global_batch(total, rounds):
    targets = round_targets(total, rounds)
    assert sum(targets) == total and len(targets) == rounds
    assert max(targets) - min(targets) <= 1
    assert list(targets) == sorted(targets)  # the later rounds take the remainder


def test_acco_halves():
    assert round_targets(16, 2) == (8, 8)
    assert round_targets(7, 2) == (3, 4)  # estimate, commit


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_equal_shares_rotate_the_remainder(world):
    for total in range(world, 4 * world + 3):
        per_round = [equal_shares(total, world, r) for r in range(world)]
        assert all(sum(s) == total and max(s) - min(s) <= 1 and min(s) >= 1 for s in per_round)
        # over `world` consecutive rounds every rank gets the same number
        assert len({sum(s[w] for s in per_round) for w in range(world)}) == 1


def test_speed_shares_follow_speed_and_keep_the_total():
    rng = random.Random(0)
    for _ in range(500):
        world = rng.randint(1, 6)
        t = [rng.uniform(0.01, 1.0) for _ in range(world)]
        total = rng.randint(world, 60)
        shares = speed_shares(total, t)
        assert sum(shares) == total and min(shares) >= 1
        # Hamilton's method: each share is the floor or ceiling of its exact quota, where every
        # quota is at least one
        speeds = [1 / x for x in t]
        quotas = [total * s / sum(speeds) for s in speeds]
        if min(quotas) >= 1:
            assert all(math.floor(q) <= sh <= math.ceil(q) for q, sh in zip(quotas, shares))
        assert all(sh <= max(1, math.ceil(q)) for q, sh in zip(quotas, shares))
        # a faster worker never gets fewer than a slower one
        order = sorted(range(world), key=lambda w: t[w])
        assert all(shares[a] >= shares[b] for a, b in zip(order, order[1:]))


def test_speed_shares_examples():
    assert speed_shares(8, [0.1, 0.1]) == [4, 4]
    assert speed_shares(12, [0.01, 0.01, 0.05]) == [6, 5, 1]  # quotas 5.45, 5.45, 1.09
    assert speed_shares(5, [0.1, 0.1]) == [3, 2]  # a tie goes to the lower rank
    assert speed_shares(3, [0.01, 0.01, 10.0]) == [1, 1, 1]  # at least one each
    assert speed_shares(4, [0.01, 1.0, 1.0, 1.0]) == [1, 1, 1, 1]
    assert speed_shares(5, [0.001, 1.0, 1.0]) == [3, 1, 1]  # quotas 4.99, 0.005, 0.005
    with pytest.raises(ValueError, match="cannot give each of 3 workers one"):
        speed_shares(2, [0.1, 0.1, 0.1])


def test_speed_estimate_smooths_and_waits_for_every_worker():
    est = SpeedEstimate(world=2, alpha=0.5)
    assert est.shares(6, round_index=1) == equal_shares(6, 2, 1)  # nothing measured
    est.update([0.1, 0.0])  # rank 1 ran nothing: still not every worker measured
    assert est.seconds is None
    est.update([0.1, 0.3])
    assert est.seconds == [0.1, 0.3]
    est.update([0.1, 0.1])
    assert est.seconds == pytest.approx([0.1, 0.2])
    est.update([0.0, float("nan")])  # nothing new: kept
    assert est.seconds == pytest.approx([0.1, 0.2])
    assert est.shares(8, round_index=0) == speed_shares(8, [0.1, 0.2])
    copy = SpeedEstimate(world=2)
    copy.load_state_dict(est.state_dict())
    assert copy.seconds == est.seconds
    with pytest.raises(ValueError, match="expected 2 measurements"):
        est.update([0.1])
