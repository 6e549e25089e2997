"""benchmarks/loss_grid_fit.py: the least-squares line and its interval against a hand computation,
and the committed fits (docs/results/loss_grid_fit.json, quoted by docs/acco_delay.md) against the
committed grid JSONs, so the doc's figures are the grid's."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.loss_grid_fit import fit_line, grid_fits
from benchmarks.plan_validate import RESULTS


def test_the_line_and_its_interval_match_a_hand_computation():
    # x mean 1.5, Sxx 5, Sxy 5.5: slope 1.1, intercept 1.1; residuals -0.1, 0.8, -1.3, 0.6 (SS 2.7, 2 dof)
    fit = fit_line([0, 1, 2, 3], [1, 3, 2, 5])
    assert fit["slope"] == pytest.approx(1.1) and fit["intercept"] == pytest.approx(1.1)
    se = math.sqrt(2.7 / 2) / math.sqrt(5)
    assert fit["slope_se"] == pytest.approx(se)
    assert fit["slope_95"] == pytest.approx([1.1 - 4.303 * se, 1.1 + 4.303 * se])
    exact = fit_line([4, 5, 6, 7, 8], [1 + 2 * x for x in (4, 5, 6, 7, 8)])
    assert exact["slope"] == pytest.approx(2) and exact["slope_se"] == pytest.approx(0, abs=1e-12)


@pytest.mark.parametrize("xs,ys", [([1, 2], [0, 1]), ([3, 3, 3], [0, 1, 2])])
def test_too_few_points_or_one_batch_are_refused(xs, ys):
    with pytest.raises(ValueError, match="need >= 3 observations"):
        fit_line(xs, ys)


def test_the_committed_fits_are_the_committed_grids():
    committed = json.loads((RESULTS / "loss_grid_fit.json").read_text())["fits"]
    now = grid_fits(RESULTS)
    assert [(f["mode"], f["samples"]) for f in committed] == [(f["mode"], f["samples"]) for f in now]
    for old, new in zip(committed, now):
        assert old["slope"] == pytest.approx(new["slope"]) and old["n"] == new["n"], (old["mode"], old["samples"])
        assert old["slope_95"] == pytest.approx(new["slope_95"])
