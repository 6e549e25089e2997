"""The benchmark's statistics and tables: per-mode medians over seeds (:func:`aggregate`), time to
the target held-out loss, the ratios and the overlap efficiency of docs/DESIGN.md section 4
(:func:`add_derived`), the markdown table and the verdict lines."""

from __future__ import annotations

import os
import shlex
import statistics
import sys

from benchmarks.modes import BENCHMARK_MODES, MODES, REFERENCE
from benchmarks.testbed import parse_rate


def time_to_target(evals: list[dict], target: float | None) -> float | None:
    """First wall time at which the held-out loss reaches ``target`` (linear between eval points)."""
    if target is None:
        return None
    prev = None
    for e in evals:
        if e["loss"] is None:
            continue
        if e["loss"] <= target:
            if prev is None or prev["loss"] == e["loss"]:
                return e["time_s"]
            f = (prev["loss"] - target) / (prev["loss"] - e["loss"])
            return prev["time_s"] + f * (e["time_s"] - prev["time_s"])
        prev = e
    return None



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
    if REFERENCE in best:
        return {r["seed"]: r["final_loss"] for r in best[REFERENCE][1] if r["final_loss"] is not None}
    return {}


def aggregate(args, runs: list[dict], compute_rates: list[float]) -> list[dict]:
    """One row per mode (table order): its best lr's runs, medians over seeds."""
    compute_rate = statistics.median(compute_rates) if compute_rates else None
    by_mode: dict[str, dict[float, list[dict]]] = {}
    for r in runs:
        by_mode.setdefault(r["mode"], {}).setdefault(r["lr"], []).append(r)
    best = best_lrs(args, by_mode)
    targets = targets_per_seed(args, runs, best)
    out = [mode_row(args, mode, best[mode], by_mode[mode], runs, targets, compute_rate)
           for mode in BENCHMARK_MODES if mode in best]  # merged runs may add modes
    add_derived(out, args.workers, args.rate, args.micro_batch)
    return out


def time_to_target_fields(rs: list[dict], targets: dict[int, float]) -> dict:
    ttt = [time_to_target(r["evals"], targets.get(r["seed"])) for r in rs]
    reached = [t for t in ttt if t is not None]
    return {
        "time_to_target_s": statistics.median(reached) if reached else None,
        "time_to_target_min_s": min(reached) if reached else None,
        "time_to_target_max_s": max(reached) if reached else None,
        "time_to_target_per_seed": ttt,
        "reached_target": f"{len(reached)}/{len(rs)}",
    }


def mode_row(args, mode: str, best: tuple[float, list[dict]], lrs: dict[float, list[dict]], runs: list[dict],
             targets: dict[int, float], compute_rate: float | None) -> dict:
    """One mode's row of the table and the JSON (``runs``: every run, all modes)."""
    lr, rs = best
    engine = MODES[mode].kind == "engine"
    med = lambda key: statistics.median(r[key] for r in rs if r[key] is not None) \
        if any(r[key] is not None for r in rs) else None  # noqa: E731
    ratios = [x for r in rs for x in r["tx_over_engine_per_rank"] if x is not None]
    sps = med("samples_per_s")
    return {
        "mode": mode, "kind": MODES[mode].kind,
        "workers": args.workers, "rate": args.rate, "hetero": args.hetero,
        "lr": lr, "lrs_tried": sorted(lrs),
        "lr_scores": {str(k): lr_score(args, v) for k, v in sorted(lrs.items())},
        "seeds": sorted(r["seed"] for r in rs),
        "samples_budget": args.samples,
        "samples": med("samples"),
        "steps": med("steps"),
        "train_s": med("train_s"),
        "startup_s": med("startup_s"),
        "step_time_median_s": med("step_time_median_s"),
        "samples_per_s": sps,
        "global_micro_batches_per_step": med("global_micro_batches_median"),
        "min_micro_batches_per_round": med("min_micro_batches_median") if engine else None,
        "comm_cpu_s_per_round": med("comm_cpu_s_per_round") if engine else None,
        "global_micro_batches_per_step_mean": med("global_micro_batches_mean"),
        "global_batch_samples": (med("global_micro_batches_mean") or 0) * args.micro_batch,
        "wire_bytes_per_step_engine": med("wire_bytes_per_step_engine"),
        "wire_bytes_per_step_tx": med("wire_bytes_per_step_tx"),
        "tx_over_engine": statistics.median(ratios) if ratios else None,
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


def add_derived(out: list[dict], workers: int, rate: str, micro_batch: int) -> None:
    """Ratios against the reference and docs/DESIGN.md section 4's overlap efficiency: the physical
    limit of a (median) step, max(its compute at the compute-only pace, its wire bytes over the
    link), over the measured median step time."""
    link = parse_rate(rate) / 8
    ref = next((o for o in out if o["mode"] == REFERENCE), None)
    for o in out:
        limit = None
        rate_c = o.get("compute_only_samples_per_s")
        if rate_c and o.get("global_micro_batches_per_step") and o.get("wire_bytes_per_step_engine") is not None:
            compute_s = o["global_micro_batches_per_step"] * micro_batch / rate_c  # workers run in parallel
            limit = max(compute_s, o["wire_bytes_per_step_engine"] / link)
        o["step_limit_s"] = limit
        o["overlap_efficiency"] = limit / o["step_time_median_s"] if limit and o.get("step_time_median_s") else None
        o["samples_per_s_vs_ref"] = (o["samples_per_s"] / ref["samples_per_s"]
                                     if ref and ref["samples_per_s"] and o["samples_per_s"] else None)
        o["time_to_target_vs_ref"] = (o["time_to_target_s"] / ref["time_to_target_s"]
                                      if ref and ref["time_to_target_s"] and o["time_to_target_s"] else None)


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ["mode", "lr", "samples", "step s (med)", "limit s", "samples/s", "vs acc1", "eff.", "overlap eff.",
            "global mb/step", "min mb/round",
            "MB/step (mode)", "MB/step (tx)", "tx/mode", "held-out loss", "time to target s", "vs acc1",
            "reached"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for o in rows:
        ttt = o["time_to_target_s"]
        spread = "" if ttt is None or o["time_to_target_min_s"] == o["time_to_target_max_s"] else \
            f" [{o['time_to_target_min_s']:.0f}-{o['time_to_target_max_s']:.0f}]"
        lines.append("| " + " | ".join([
            o["mode"], f"{o['lr']:g}", fmt(o["samples"], ".0f"), fmt(o["step_time_median_s"]),
            fmt(o.get("step_limit_s")), fmt(o["samples_per_s"]),
            fmt(o["samples_per_s_vs_ref"]), fmt(o["throughput_efficiency"]), fmt(o.get("overlap_efficiency")),
            fmt(o["global_micro_batches_per_step"], ".1f"), fmt(o["min_micro_batches_per_round"], ".0f"),
            fmt(o["wire_bytes_per_step_engine"] and o["wire_bytes_per_step_engine"] / 1e6),
            fmt(o["wire_bytes_per_step_tx"] and o["wire_bytes_per_step_tx"] / 1e6),
            fmt(o["tx_over_engine"], ".3f"), fmt(o["final_heldout_loss"], ".3f"),
            (fmt(ttt, ".0f") + spread) if ttt is not None else "not reached",
            fmt(o["time_to_target_vs_ref"]), o["reached_target"]]) + " |")
    return "\n".join(lines)


def verdict(rows: list[dict]) -> str:
    """The issue's comparisons, computed from the table (medians over seeds)."""
    by = {o["mode"]: o for o in rows}
    lines = []

    def best(prefix: str, exclude: str = "\0"):
        cands = [o for o in rows if o["mode"].startswith(prefix) and exclude not in o["mode"]
                 and o["time_to_target_s"] is not None]
        return min(cands, key=lambda o: o["time_to_target_s"]) if cands else None

    ddp, psgd = best("torch-ddp", "powersgd"), best("torch-ddp+powersgd")
    ddp_bytes = next((o["wire_bytes_per_step_engine"] for o in rows if o["mode"] == REFERENCE), None)
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
        if o["throughput_efficiency"] is not None:
            parts.append(f"efficiency {o['throughput_efficiency']:.2f};")
        if ddp_bytes and o["wire_bytes_per_step_engine"]:
            parts.append(f"wire bytes/step {o['wire_bytes_per_step_engine'] / ddp_bytes:.3f}x torch-ddp")
        lines.append(" ".join(parts))
    if "acco" in by and "zero1" in by and by["acco"]["samples_per_s"] and by["zero1"]["samples_per_s"]:
        lines.append(f"acco vs zero1: samples/s {by['acco']['samples_per_s'] / by['zero1']['samples_per_s']:.2f}x, "
                     f"final held-out loss {by['acco']['final_heldout_loss'] / by['zero1']['final_heldout_loss']:.3f}x")
    return "\n".join(f"- {x}" for x in lines)


def tables(rows: list[dict]) -> str:
    """The markdown table and the verdict lines under it."""
    return table(rows) + "\n\n" + verdict(rows)


def run_header(args, rows: list[dict], compute_rates: list[float], load0, load1, total_s: float) -> str:
    """What a finished run prints above its table: the setup, the command, the compute-only pace."""
    tgt = next((o["target_loss"] for o in rows if o["target_loss"] is not None), None)
    hetero = " (hetero: 2 on core 0, 1 on core 1)" if args.hetero else ""
    return "\n".join([
        f"## acco-loco benchmark: {args.workers} workers{hetero}, "
        f"{args.rate} links{f', {args.delay_ms:g} ms delay' if args.delay_ms else ''}, {args.samples} samples/run, "
        f"seeds {args.seeds}, lr {'sweep ' if args.lr_sweep else ''}{', '.join(f'{x:g}' for x in args.lrs)}\n",
        f"command: `{' '.join(shlex.quote(a) for a in [sys.executable] + sys.argv)}`  ",
        f"model: GPT-2 {args.n_layer}x{args.n_embd}, {args.n_head} heads, byte vocab, seq {args.seq_len}, "
        f"micro-batch {args.micro_batch}; engine modes adaptive, cap {args.max_micro_batches} micro-batches/round, "
        f"{args.comm_chunks} comm chunks  ",
        f"compute-only: {', '.join(f'{x:.2f}' for x in compute_rates)} samples/s (median used); "
        f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end on {os.cpu_count()} cores; "
        f"total {total_s:.0f} s  ",
        f"target held-out loss: {fmt(tgt, '.3f')} "
        f"({'given' if args.target_loss is not None else REFERENCE + ' at the end'})\n",
    ])


def render_header(doc: dict, rows: list[dict]) -> str:
    """What --render prints above the table of an earlier --json."""
    tgt = next((o["target_loss"] for o in rows if o["target_loss"]), None)
    return (f"command: `{doc['command']}`{'' if doc.get('complete') else ' (INCOMPLETE: the run was cut short)'}  \n"
            f"compute-only: {', '.join(f'{x:.2f}' for x in doc['compute_only_samples_per_s'])} samples/s; "
            f"target held-out loss {fmt(tgt, '.3f')}\n")
