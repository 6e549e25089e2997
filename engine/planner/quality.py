"""Loss per sample against synchronous AdamW (torch DDP), from the project's own measurements.

Each figure is a benchmark JSON's ``loss_vs_ref_pct``: the held-out loss at equal samples
against torch DDP's (AdamW, the same lr sweep and data order), median over the seeds both ran
(recipes/benchmark.py, docs/testbed.md, "Like for like"). Caveats, which travel with every figure: a
4.87M-parameter GPT-2 on byte-level Shakespeare, 2 or 3 workers, 768-3072 samples (a few hundred
steps at most), 1-3 seeds; runs of one mode differ by a few tenths of a percent between seeds.
They say whether a mode keeps AdamW's loss per sample at that scale, not what it does at 1B-70B.
The synchronous sharded round is AdamW itself (the same update, float32 summation order aside);
the delayed update has no matched-batch measurement (its one-step-stale update is not AdamW's).
The figures come from the folder the caller names (``python -m engine.plan --results``, by default
./docs/results), never from the source tree: an installed engine has none.

``samples_factor`` turns the same runs into what a user pays for: the samples a mode needs to
reach AdamW's loss, over AdamW's own (docs/planning.md, "Samples to AdamW's loss, and the soonest mode"). Per seed, against that
seed's torch DDP run: where the mode reaches DDP's final held-out loss, the samples at which it
does (linear between eval points) over the samples at which DDP did; where it does not, its
whole budget over the samples at which DDP had the mode's final loss (what the mode's run was
worth in AdamW's samples). Both read 1.0 for a mode that tracks AdamW's curve, and neither
counts a seed that lands 0.01% short of DDP's last point as never arriving."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .modes import Mode

RESULT_FILES = ("plancheck_100mbit_b16_2seeds.json", "plancheck_1gbit_b16_2seeds.json",
                "bench_20mbit_b16_seeds3.json", "bench_100mbit_b16_3seeds.json", "bench_100mbit_b16_s0_local.json",
                "bench_100mbit_b64_3seeds.json", "bench_1gbit_b16_3seeds.json", "bench_1gbit_b16_loss_3seeds.json",
                "bench_hetero_b96_3seeds.json", "acco_headline_100mbit_b16_3seeds.json")
CAVEAT = ("4.87M GPT-2, byte-level Shakespeare, 2-3 workers, 768-3072 samples, 1-3 seeds; held-out loss at "
          "equal samples vs torch DDP (AdamW)")


@dataclass(frozen=True)
class Quality:
    loss_vs_adamw_pct: float | None  # median over the sources; + = worse
    sources: tuple[str, ...]  # "file: +x.x% (n seeds)"
    note: str = ""


@lru_cache(maxsize=None)  # a plan reads every file once per mode; the JSONs do not change under a process
def results_doc(results: Path | None, name: str) -> dict | None:
    """A benchmark JSON of the ``results`` folder (the repository's docs/results), parsed; None
    when there is no folder or no such file. Read-only."""
    if results is None:
        return None
    path = Path(results) / name
    return json.loads(path.read_text()) if path.exists() else None


def scored_like_ddp(doc: dict, row: dict) -> bool:
    """Whether ``row``'s held-out loss is on DDP's held-out sequences: JSONs made before the
    benchmark fixed the eval batches (no ``eval_micro_batch`` in their config) scored each mode on
    batches of its own micro-batch, so a row at another micro-batch than the command's (ACCO's
    half) saw a different set (docs/results.md, the held-out correction)."""
    cfg = doc.get("config", {})
    return "eval_micro_batch" in cfg or row.get("micro_batch") in (None, cfg.get("micro_batch"))


def bench_name(mode: Mode) -> str | None:
    """The benchmark's name for the measured counterpart of ``mode`` (benchmarks/modes.py spells
    the strategy with dashes; the exchange and model sharding do not change the update up to
    where the compression applies, and have no measurement of their own yet)."""
    if mode.is_ddp:
        return "torch-ddp"
    name = mode.strategy.replace("_", "-")
    if mode.local_steps:
        return f"{name}-h{mode.inner_steps}" + ("+overlap" if mode.outer_overlap else "")
    name += "" if mode.codec == "none" else f"+{mode.codec}"
    return name + (f"+{mode.param_codec}params" if mode.param_codec in ("int8", "int4") else "")


def proxy_of(mode: Mode) -> Mode | None:
    """The measured mode whose loss stands in for ``mode``'s: its spec's ``quality_proxy`` (the
    same codecs and error feedback, or a subset of them: int8 deltas and full-precision parameters
    lose less than int4 deltas) for a codec variant of a strategy that names one."""
    proxy = None if mode.is_ddp else mode.spec.quality_proxy
    if proxy is None or (mode.codec, mode.param_codec) == ("none", "auto") or mode.codec not in ("none", proxy[1]):
        return None
    return Mode(*proxy, exchange=mode.exchange, sharding=mode.sharding)


def quality(mode: Mode, results: Path | None = None, files=RESULT_FILES) -> Quality:
    name = bench_name(mode)
    found, sources, seen = [], [], set()
    for f in files:
        doc = results_doc(results, f)
        if doc is None:
            continue
        for o in doc["modes"]:
            key = (o.get("loss_vs_ref_pct"), o.get("loss_vs_ref_samples"))
            if not scored_like_ddp(doc, o):
                continue
            if o["mode"] == name and key[0] is not None and key not in seen:  # merged JSONs repeat runs
                seen.add(key)
                found.append(o["loss_vs_ref_pct"])
                sources.append(f"{f}: {o['loss_vs_ref_pct']:+.2f}% ({len(o.get('seeds', []))} seeds, "
                               f"{o.get('loss_vs_ref_samples'):.0f} samples)")
    if mode.is_ddp and mode.ddp_dtype == "float32":
        return Quality(0.0, ("the reference",))
    if found:
        return Quality(statistics.median(found), tuple(sources))
    if mode.is_ddp:  # a bf16 all-reduce of the gradients: AdamW with bf16-rounded gradients
        return Quality(None, (), "bf16 gradient all-reduce: not measured here")
    proxy = proxy_of(mode)
    if proxy is not None and proxy != mode:
        base = quality(proxy, results, files)
        if base.loss_vs_adamw_pct is not None:
            own, plain = (Mode(m.strategy, exchange=m.exchange, sharding=m.sharding) for m in (mode, proxy))
            q_own, q_plain = quality(own, results, files), quality(plain, results, files)
            if own != plain and None not in (q_own.loss_vs_adamw_pct, q_plain.loss_vs_adamw_pct):
                # the proxy runs another strategy (its delay, if any, is not this one's): carry over
                # only its codecs' cost, measured against the same strategy without them (never a gain)
                cost = max(0.0, base.loss_vs_adamw_pct - q_plain.loss_vs_adamw_pct)
                return Quality(q_own.loss_vs_adamw_pct + cost, q_own.sources + base.sources + q_plain.sources,
                               f"inferred: {bench_name(own)}'s loss plus the codecs' cost on {bench_name(proxy)} "
                               f"over {bench_name(plain)} ({cost:+.2f}%)")
            return Quality(base.loss_vs_adamw_pct, base.sources,
                           f"inferred from {bench_name(proxy)} (the same or fewer lossy codecs)")
    if results is None:
        return Quality(None, (), "no results folder given (--results)")
    return Quality(None, (), "not measured at a matched batch")


@dataclass(frozen=True)
class SampleFactor:
    factor: float | None  # median over the runs: samples to AdamW's loss / AdamW's own
    runs: int
    sources: tuple[str, ...]  # "file seed s: x.xx (reached | equivalent)"
    warmup_fraction: float | None = None  # 1-bit Adam: its warmup steps over DDP's steps to the loss


def first_crossing(evals: list[dict], target: float, key: str = "samples") -> float | None:
    """``key`` (samples, time_s) at which the held-out loss first reaches ``target``, linear
    between eval points; None when it never does."""
    prev = None
    for e in evals:
        if e.get("loss") is None:
            continue
        if e["loss"] <= target:
            if prev is None or prev["loss"] == e["loss"]:
                return e[key]
            f = (prev["loss"] - target) / (prev["loss"] - e["loss"])
            return prev[key] + f * (e[key] - prev[key])
        prev = e
    return None


def run_factor(run: dict, ddp_run: dict) -> tuple[float, str] | None:
    """(samples factor, how) of one seed's run against the same seed's DDP run (see the module)."""
    if run.get("final_loss") is None or ddp_run.get("final_loss") is None:
        return None
    own = first_crossing(ddp_run["evals"], ddp_run["final_loss"])
    reached = first_crossing(run["evals"], ddp_run["final_loss"])
    if reached is not None and own:
        return reached / own, "reached"
    worth = first_crossing(ddp_run["evals"], run["final_loss"])
    budget = max((e["samples"] for e in run["evals"] if e.get("loss") is not None), default=None)
    if worth and budget:
        return budget / worth, "equivalent"
    return None


def samples_factor(mode: Mode, results: Path | None = None, files=RESULT_FILES,
                   steps: int | None = None) -> SampleFactor:
    """The median factor over the runs; with ``steps`` (the planned run's optimizer steps) only
    over runs whose DDP reference took between 2/3 and 3/2 of that many (all of them when none
    did): a one-step delay costs a 96-step run more than a 192-step one (1.23 against 0.98 for
    the two-round overlapped strategy)."""
    if steps is not None:
        near = _samples_factor(mode, results, files, steps)
        if near.factor is not None:
            return near
    return _samples_factor(mode, results, files, None)


@lru_cache(maxsize=None)  # a plan asks for every mode; the JSONs do not change under a process
def _samples_factor(mode: Mode, results: Path | None, files, within: int | None) -> SampleFactor:
    name = bench_name(mode)
    if mode.is_ddp:  # fp32 DDP is AdamW; the bf16 all-reduce was never measured here
        return SampleFactor(1.0, 0, ("AdamW",)) if mode.ddp_dtype == "float32" else SampleFactor(None, 0, ())
    xs, sources, warm, seen = [], [], [], set()
    for f in files:
        doc = results_doc(results, f)
        if doc is None:
            continue
        rows = {o["mode"]: o for o in doc["modes"]}
        if name not in rows or "torch-ddp" not in rows or not scored_like_ddp(doc, rows[name]):
            continue
        ddp, o = rows["torch-ddp"], rows[name]
        ddp_runs = {r["seed"]: r for r in ddp["runs"] if r["lr"] == ddp["lr"]}
        for r in o["runs"]:
            key = (r["seed"], r.get("final_loss"))
            if r["lr"] != o["lr"] or r["seed"] not in ddp_runs or key in seen:  # merged JSONs repeat runs
                continue
            if within is not None and not within / 1.5 <= ddp_runs[r["seed"]]["steps"] <= within * 1.5:
                continue
            got = run_factor(r, ddp_runs[r["seed"]])
            if got is None:
                continue
            seen.add(key)
            xs.append(got[0])
            sources.append(f"{f} seed {r['seed']}: {got[0]:.2f} ({got[1]})")
            frozen = (r.get("strategy_facts") or {}).get("frozen_step")
            if frozen:
                ddp_steps = first_crossing(ddp_runs[r["seed"]]["evals"], ddp_runs[r["seed"]]["final_loss"], "step")
                warm.append(frozen / ddp_steps)
    proxy = proxy_of(mode)
    if not xs and proxy is not None and files == RESULT_FILES and mode != proxy:
        # as quality(): the measured proxy has the same or more lossy codecs
        base = _samples_factor(proxy, results, files, within)
        return SampleFactor(base.factor, base.runs, base.sources + (f"inferred from {bench_name(proxy)}",))
    if not xs:
        return SampleFactor(None, 0, (), None)
    return SampleFactor(statistics.median(xs), len(xs), tuple(sources), statistics.median(warm) if warm else None)
