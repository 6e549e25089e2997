"""How the loss grid's cost of each mode depends on the global batch: a least-squares line of the
gap to torch DDP (held-out loss at equal samples, %) against log2 B, per mode and run length, over
every seed of the grid's points (docs/results/loss_grid/, benchmarks/loss_grid.py; issue 44).

    python -m benchmarks.loss_grid_fit                                    # the table of docs/acco_delay.md
    python -m benchmarks.loss_grid_fit --json docs/results/loss_grid_fit.json

Each seed's gap is one observation (seeds differ in data order and initialisation, so they are the
spread the fit has to beat). The slope is in % per doubling of B, with its standard error (ordinary
least squares: s / sqrt(sum (x - mean x)^2), s the residuals' standard deviation on n - 2 degrees of
freedom) and a 95% interval from Student's t; a slope whose interval holds 0 is no measured
dependency. Only the grid's own JSONs are used, so every point is one workload (GPT-2 4 x 128, seq 64,
2 workers), each mode at its own swept lr."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from engine.planner.evidence import all_points

from .plan_validate import RESULTS

# Student's t, two-sided 95%, by degrees of freedom (scipy is not a dependency); beyond 30: 2.0
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 25: 2.060, 30: 2.042}


def t95(dof: int) -> float:
    if dof < 1:
        raise ValueError("a line through fewer than 3 observations has no interval")
    if dof > 30:
        return 2.0
    return T95[max(k for k in T95 if k <= dof)]  # between table entries: the smaller dof's, a wider interval


def fit_line(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = a + b x with b's standard error and 95% interval (n >= 3, two distinct x)."""
    n = len(xs)
    if n != len(ys) or n < 3 or len(set(xs)) < 2:
        raise ValueError(f"need >= 3 observations at >= 2 distinct x, got {n} at {sorted(set(xs))}")
    slope, intercept = statistics.linear_regression(xs, ys)
    mx = statistics.fmean(xs)
    sxx = sum((x - mx) ** 2 for x in xs)
    resid = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
    s = math.sqrt(sum(r * r for r in resid) / (n - 2))
    se = s / math.sqrt(sxx)
    half = t95(n - 2) * se
    return {"n": n, "intercept": intercept, "slope": slope, "slope_se": se, "slope_95": [slope - half, slope + half],
            "residual_sd": s}


def grid_fits(results: Path = RESULTS) -> list[dict]:
    """One fit per (mode, run length) with points at >= 2 batches: the gap (%) per doubling of B."""
    points = [p for p in all_points(results) if p.kind == "grid"]
    out = []
    for bench, samples in sorted({(p.bench, p.samples) for p in points}):
        mine = sorted((p for p in points if p.bench == bench and p.samples == samples), key=lambda p: p.global_batch)
        xs = [math.log2(p.global_batch) for p in mine for _ in p.per_seed]
        ys = [g for p in mine for g in p.per_seed]
        if len({p.global_batch for p in mine}) < 2 or len(xs) < 3:
            continue
        fit = fit_line(xs, ys)
        fit.update(mode=bench, samples=samples, batches=[p.global_batch for p in mine],
                   mean_gap_by_batch={str(p.global_batch): statistics.fmean(p.per_seed) for p in mine},
                   sources=[p.source for p in mine])
        out.append(fit)
    return out


def table(fits: list[dict]) -> str:
    lines = ["| mode | samples | B measured | mean gap by B, % | slope, % per doubling of B (95%) | residual SD, % | n |",
             "|---|---|---|---|---|---|---|"]
    for f in fits:
        lo, hi = f["slope_95"]
        means = ", ".join(f"{b}: {g:+.2f}" for b, g in f["mean_gap_by_batch"].items())
        lines.append(f"| {f['mode']} | {f['samples']:.0f} | {', '.join(map(str, f['batches']))} | {means} | "
                     f"{f['slope']:+.2f} ({lo:+.2f} .. {hi:+.2f}) | {f['residual_sd']:.2f} | {f['n']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the folder holding loss_grid/ (default docs/results)")
    ap.add_argument("--json", type=Path, default=None, help="write the fits here")
    a = ap.parse_args(argv)
    fits = grid_fits(a.results)
    print(table(fits))
    if a.json:
        a.json.write_text(json.dumps({"command": "python -m benchmarks.loss_grid_fit --json " + str(a.json),
                                      "fits": fits}, indent=1) + "\n")


if __name__ == "__main__":
    main()
