"""The measured loss per sample behind every loss figure the planner and ``strategy="auto"`` use:
which benchmark rows a mode has, at which global batch and run length, on how many seeds
(docs/planning.md, "The evidence").

A *point* is one mode's row in one JSON of the results folder: its held-out loss against torch
DDP's (AdamW) at equal samples, seed against seed (median over the seeds), the samples it needs to
reach DDP's loss over DDP's own (median over the seeds, quality.run_factor), the global batch B
(samples per optimizer step) and the run length (samples) it was measured at. Two sources:

- the benchmark JSONs of ``RESULT_FILES`` (recipes/benchmark.py, the matched-batch protocol): a row
  counts only where it was scored on DDP's held-out sequences (quality.scored_like_ddp);
- the loss grid, ``loss_grid/b{B}_n{samples}.json`` (benchmarks/loss_grid.py): every mode on DDP's
  held-out set at its own swept lr, per seed against DDP's run of that seed; ``..._2x2.json``: the
  gradient-codec modes on the two-level exchange at 2 nodes x 2 ranks, against DDP at 4 ranks.

A point *qualifies* with at least ``MIN_SEEDS`` seeds (3, for a benchmark JSON and for the grid's
points alike); only qualifying points of a mode's own make a figure, so a
mode with none is "not measured" and never chosen (engine/planner/decide.py). Nothing is carried
from one mode to another: the benchmark's names map to the planner's modes by what they run
(quality.bench_mode: the benchmark's LoCo names without ``+int4params`` send int8 parameter
deltas, benchmarks/modes.py). The exchange does not change an uncompressed mode's update (a mean of the same
gradients, summation order aside), so the rows of an uncompressed mode serve its flat, two-level and
node-sharded rows; under a gradient codec the two-level exchange compresses the node's sum instead
of each rank's gradient, and a local-step strategy's replica becomes the node, so those modes need
rows measured at that exchange.

``estimate`` interpolates a mode's qualifying points in log B and log length (linear between the
measured points around the run's, exactly the measured value at a measured point) and never
beyond them: outside, it takes the nearest measured point and says so ("beyond the evidence")."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .modes import Mode
from .quality import (
    bench_mode,
    first_crossing,
    results_doc,
    run_factor,
    scored_like_ddp,
)

RESULT_FILES = ("plancheck_100mbit_b16_2seeds.json", "plancheck_1gbit_b16_2seeds.json",
                "bench_20mbit_b16_seeds3.json", "bench_100mbit_b16_3seeds.json", "bench_100mbit_b16_s0_local.json",
                "bench_100mbit_b64_3seeds.json", "bench_1gbit_b16_3seeds.json", "bench_1gbit_b16_loss_3seeds.json",
                "bench_hetero_b96_3seeds.json", "acco_headline_100mbit_b16_3seeds.json",
                "acco_attribution_1gbit_b16_s0.json", "nodes_100mbit_b16_2x2_2seeds.json",
                # with optimizer="muon" (torch DDP + Muon the reference): docs/acco_delay.md
                "muon_sweep_1gbit_b16.json", "muon_protocol_1gbit_b16_3seeds.json", "muon_long_1gbit_b16_n12288.json")
GRID_DIR = "loss_grid"
GRID_FILE = re.compile(r"b(\d+)_n(\d+)(_\d+x\d+)?\.json$")  # the suffix: nodes x ranks per node, 2 x 1 without
MIN_SEEDS = {"benchmark": 3, "grid": 3}
REFERENCE = "torch-ddp"

def evidence_key(mode: Mode) -> str | None:
    """The name under which a mode's measured rows are kept: what it runs, with the exchange only
    where the exchange changes the update (a gradient codec compresses the node's sum on the
    two-level reduction; a local-step strategy's replica is then the node, not the rank; node
    sharding reduces as two-level does). None for torch DDP (the reference)."""
    if mode.is_ddp:
        return None
    pc = mode.param_codec if mode.param_codec in ("int8", "int4") else "full"
    name = f"{mode.strategy}|{mode.codec}|{pc}"
    if mode.local_steps:
        name += f"|h{mode.inner_steps}" + ("+overlap" if mode.outer_overlap else "")
    if (mode.codec != "none" or mode.local_steps) and mode.exchange != "flat":
        name += "|two-level"
    return name


@dataclass(frozen=True)
class Point:
    """One mode's measured row in one JSON."""

    key: str  # evidence_key of the mode it ran
    bench: str  # the mode's benchmark name
    source: str  # the JSON, relative to the results folder
    kind: str  # "benchmark" or "grid"
    global_batch: int  # samples per optimizer step
    samples: float  # the run length (samples) the gap is taken at
    gap_pct: float  # held-out loss vs DDP's at equal samples, median over the seeds (+ = worse)
    seeds: tuple  # the seeds compared with DDP's
    per_seed: tuple  # their gaps, in seed order
    factor: float | None = None  # samples to DDP's final loss / DDP's own, median over the seeds
    factor_runs: int = 0
    warmup_fraction: float | None = None  # 1-bit Adam: its warmup's share of DDP's steps to the loss
    workload: str = ""
    optimizer: str = "adamw"  # the optimizer every mode of its JSON ran, torch DDP's with it the reference

    @property
    def qualifies(self) -> bool:
        return len(self.seeds) >= MIN_SEEDS[self.kind]

    def describe(self) -> str:
        spread = (f", seeds {min(self.per_seed):+.2f}..{max(self.per_seed):+.2f}%" if len(self.per_seed) > 1 else "")
        return (f"{self.source} ({self.bench}, B = {self.global_batch}, {self.samples:.0f} samples, "
                f"{len(self.seeds)} seed{'s' if len(self.seeds) != 1 else ''}: {self.gap_pct:+.2f}%{spread}"
                + (f"; {self.workload}" if self.workload else "") + ")")


def _workload(cfg: dict) -> str:
    """The model, sequence length and workers a benchmark JSON ran (its config)."""
    shape = f" {cfg['n_layer']}x{cfg.get('n_embd')}" if cfg.get("n_layer") else ""
    return f"{cfg.get('model') or 'tiny-gpt2'}{shape}, seq {cfg.get('seq_len')}, {cfg.get('workers')} workers"


def _bench_points(results: Path, name: str) -> list[Point]:
    doc = results_doc(results, name)
    if doc is None:
        return []
    cfg = doc.get("config", {})
    rows = {o["mode"]: o for o in doc["modes"]}
    ddp = rows.get(REFERENCE)
    out = []
    for o in doc["modes"]:
        mode = bench_mode(o["mode"])
        per_seed = o.get("loss_vs_ref_pct_per_seed") or {}
        if mode is None or ddp is None or o.get("loss_vs_ref_pct") is None or not per_seed or \
                not scored_like_ddp(doc, o):
            continue
        seeds = tuple(sorted(int(s) for s in per_seed))
        factors, warm = _bench_factors(o, ddp)
        out.append(Point(evidence_key(mode), o["mode"], name, "benchmark", int(cfg["global_batch"]),
                         float(o["loss_vs_ref_samples"]), float(o["loss_vs_ref_pct"]), seeds,
                         tuple(per_seed[str(s)] for s in seeds),
                         statistics.median(factors) if factors else None, len(factors),
                         statistics.median(warm) if warm else None, _workload(cfg), cfg.get("optimizer") or "adamw"))
    return out


def _bench_factors(o: dict, ddp: dict) -> tuple[list[float], list[float]]:
    """Per seed, the mode's samples to DDP's final loss over DDP's (its best lr against DDP's),
    and 1-bit Adam's warmup share of DDP's steps to that loss."""
    ddp_runs = {r["seed"]: r for r in ddp["runs"] if r["lr"] == ddp["lr"]}
    factors, warm = [], []
    for r in o["runs"]:
        if r["lr"] != o["lr"] or r["seed"] not in ddp_runs:
            continue
        got = run_factor(r, ddp_runs[r["seed"]])
        if got is None:
            continue
        factors.append(got[0])
        frozen = (r.get("strategy_facts") or {}).get("frozen_step")
        if frozen:
            ref = ddp_runs[r["seed"]]
            warm.append(frozen / first_crossing(ref["evals"], ref["final_loss"], "step"))
    return factors, warm


def _grid_points(results: Path, name: str) -> list[Point]:
    doc = results_doc(results, name)
    if doc is None:
        return []
    w = doc.get("workload", {})
    g = w.get("ranks_per_node", 1)
    workers = f"{w.get('workers')} workers" if g == 1 else f"{w.get('workers') // g} nodes x {g} ranks"
    workload = f"GPT-2 {w.get('n_layer')}x{w.get('n_embd')}, seq {w.get('seq_len')}, {workers}"
    ddp_best = (doc.get("summary", {}).get(REFERENCE) or {}).get("best_lr")
    out = []
    for bench, s in doc.get("summary", {}).items():
        mode = bench_mode(bench)
        gaps = s.get("gap_vs_ddp_pct") or {}
        if mode is None or not gaps or ddp_best is None:
            continue
        seeds = tuple(sorted(int(k) for k in gaps))
        per_seed = tuple(float(gaps[str(k)]) for k in seeds)
        runs = {r["seed"]: r for r in doc["runs"] if r["mode"] == bench and _same_lr(r["lr"], s["best_lr"])}
        ref = {r["seed"]: r for r in doc["runs"] if r["mode"] == REFERENCE and _same_lr(r["lr"], ddp_best)}
        factors = [f[0] for k in seeds if k in runs and k in ref and (f := run_factor(runs[k], ref[k])) is not None]
        out.append(Point(evidence_key(mode), bench, name, "grid",
                         int(doc["global_batch"]), float(doc["samples"]), statistics.median(per_seed), seeds,
                         per_seed, statistics.median(factors) if factors else None, len(factors), None, workload,
                         w.get("optimizer", "adamw")))
    return out


def _same_lr(a: float, b: float) -> bool:
    return float(f"{a:.6g}") == float(f"{b:.6g}")


@cache  # the JSONs do not change under a process
def all_points(results: Path | None, files: tuple[str, ...] = RESULT_FILES) -> tuple[Point, ...]:
    """Every point of the results folder: the benchmark JSONs' rows, then the grid's, each row
    once (merged JSONs repeat rows: the same mode, gap, length and seeds count once)."""
    if results is None:
        return ()
    found: list[Point] = []
    for name in files:
        found += _bench_points(Path(results), name)
    grid = Path(results) / GRID_DIR
    if grid.is_dir():
        for path in sorted(grid.iterdir(), key=lambda p: p.name):
            if GRID_FILE.fullmatch(path.name):
                found += _grid_points(Path(results), f"{GRID_DIR}/{path.name}")
    seen, out = set(), []
    for p in found:
        sig = (p.key, p.optimizer, p.global_batch, p.samples, p.seeds, tuple(round(x, 9) for x in p.per_seed))
        if sig not in seen:
            seen.add(sig)
            out.append(p)
    return tuple(out)


def points_of(mode: Mode, results: Path | None, files: tuple[str, ...] = RESULT_FILES,
              optimizer: str = "adamw") -> tuple[Point, ...]:
    """The mode's points measured with ``optimizer`` (each against torch DDP with the same one)."""
    key = evidence_key(mode)
    return tuple(p for p in all_points(results, files) if p.key == key and p.optimizer == optimizer)


# ------------------------------------------------------------------ the figure at a batch and length
@dataclass(frozen=True)
class Estimate:
    """A loss-per-sample figure (or a samples factor) at a run's B and length, from the mode's
    qualifying points; ``value`` None: not measured (``unqualified`` lists its rows that have too
    few seeds)."""

    value: float | None
    basis: tuple[Point, ...] = ()  # the qualifying points it interpolates between (or took)
    reach: tuple[int, float] | None = None  # the largest B and length among the qualifying points
    beyond: str = ""  # "" inside the evidence; else how the run lies outside it
    unqualified: tuple[Point, ...] = ()
    reference: bool = False  # torch DDP itself
    note: str = ""

    @property
    def measured(self) -> bool:
        return self.value is not None

    def evidence(self) -> str:
        """The B and length the figure stands on, e.g. "B 16-96, 3072 samples"."""
        if self.reference:
            return "the reference"
        if not self.basis:
            return "not measured"
        bs = sorted({p.global_batch for p in self.basis})
        ns = sorted({p.samples for p in self.basis})
        b = f"B {bs[0]}" if len(bs) == 1 else f"B {bs[0]}-{bs[-1]}"
        n = f"{ns[0]:.0f}" if len(ns) == 1 else f"{ns[0]:.0f}-{ns[-1]:.0f}"
        return f"{b}, {n} samples" + ("; beyond" if self.beyond else "")

    def sources(self) -> str:
        return "; ".join(p.describe() for p in self.basis)

    def not_measured(self) -> str:
        if self.reference or self.measured:
            return ""
        if self.note:
            return self.note
        if not self.unqualified:
            return "not measured (no rows of its own on DDP's held-out set)"
        return ("not measured (too few seeds: " + "; ".join(
            f"{p.source} {len(p.seeds)} seed{'s' if len(p.seeds) != 1 else ''} < {MIN_SEEDS[p.kind]}"
            for p in self.unqualified) + ")")


def _interp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    if x1 == x0:
        return y0
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)


def _bracket(xs: list[float], x: float) -> tuple[float, float, str]:
    """The measured values around ``x`` (equal when x is one of them or outside them) and
    "below" / "above" when x lies outside."""
    if x < xs[0]:
        return xs[0], xs[0], "below"
    if x > xs[-1]:
        return xs[-1], xs[-1], "above"
    lo = max(v for v in xs if v <= x)
    hi = min(v for v in xs if v >= x)
    return lo, hi, ""


def interpolate(points: list[Point], global_batch: int, samples: float | None, quantity: str = "gap_pct",
                label: str = "the run") -> Estimate:
    """The figure at (global_batch, samples) from ``points`` (already the qualifying ones of one
    mode with a ``quantity``): at each measured B, linear in log length between the lengths
    measured there (without a length, the longest measured there); then linear in log B between
    the measured B around the run's. Outside the measured B or lengths: the nearest, and
    ``beyond`` says so. Points at the same (B, length) count by their median."""
    pts = [p for p in points if getattr(p, quantity) is not None]
    if not pts:
        return Estimate(None)
    cells: dict[tuple[int, float], list[Point]] = {}
    for p in pts:
        cells.setdefault((p.global_batch, p.samples), []).append(p)
    value_at = {c: statistics.median(getattr(p, quantity) for p in ps) for c, ps in cells.items()}
    bs = sorted({b for b, _ in cells})
    reach = (bs[-1], max(n for b, n in cells if b == bs[-1]))
    b0, b1, b_side = _bracket(bs, global_batch)
    basis, vals = [], []
    length_side = ""
    for b in dict.fromkeys((b0, b1)):
        ns = sorted(n for bb, n in cells if bb == b)
        if samples is None:
            n0 = n1 = ns[-1]
        else:
            n0, n1, side = _bracket(ns, samples)
            length_side = length_side or side
        v = _interp(samples, n0, n1, value_at[b, n0], value_at[b, n1]) if samples is not None else value_at[b, n0]
        vals.append((b, v))
        for n in dict.fromkeys((n0, n1)):
            basis += cells[b, n]
    value = _interp(global_batch, vals[0][0], vals[-1][0], vals[0][1], vals[-1][1])
    notes = []
    if b_side == "above":
        notes.append(f"evidence reaches B = {bs[-1]}, length {reach[1]:.0f} samples; {label} at B = {global_batch} "
                     "is beyond it (the figure at the largest measured B, not extrapolated)")
    elif b_side == "below":
        notes.append(f"evidence starts at B = {bs[0]}; {label} at B = {global_batch} is below it (the figure at "
                     "the smallest measured B)")
    if length_side:
        used = sorted({n for (b, n) in cells if b in (b0, b1)})
        notes.append(f"{label}'s {samples:.0f} samples are " + (f"beyond the longest measured run there ({used[-1]:.0f})"
                     if length_side == "above" else f"short of the shortest measured run there ({used[0]:.0f})"))
    note = ("no run length given: the longest measured run at each B"
            if samples is None and len({n for _, n in cells}) > 1 else "")
    return Estimate(value, tuple(basis), reach, ("beyond the evidence: " + "; ".join(notes)) if notes else "", note=note)


def estimate(mode: Mode, results: Path | None, global_batch: int, samples: float | None,
             quantity: str = "gap_pct", label: str = "the run", files: tuple[str, ...] = RESULT_FILES,
             optimizer: str = "adamw") -> Estimate:
    """The mode's loss per sample (``gap_pct``) or samples factor (``factor``) at the run's B and
    length, from its own qualifying points with ``optimizer`` only; torch DDP fp32 with the same
    optimizer is the reference (0%, 1x), its bf16 ring was never measured."""
    if mode.is_ddp:
        if mode.ddp_dtype == "float32":
            return Estimate(0.0 if quantity == "gap_pct" else 1.0, reference=True)
        return Estimate(None, note="not measured (bf16 gradient all-reduce)")
    if results is None:
        return Estimate(None, note="not measured here (no results folder given: --results)")
    own = points_of(mode, results, files, optimizer)
    good = [p for p in own if p.qualifies and getattr(p, quantity) is not None]
    bad = tuple(p for p in own if not p.qualifies)
    if not good:
        return Estimate(None, unqualified=bad)
    got = interpolate(good, global_batch, samples, quantity, label)
    return Estimate(got.value, got.basis, got.reach, got.beyond, bad, note=got.note)


def warmup_fraction(est: Estimate) -> float | None:
    """1-bit Adam's warmup share of DDP's steps to the loss, median over the points used."""
    w = [p.warmup_fraction for p in est.basis if p.warmup_fraction is not None]
    return statistics.median(w) if w else None
