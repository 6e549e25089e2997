"""Loss per sample against torch DDP over global batch x run length (issue 44), on local processes.

The loss a mode reaches after a number of samples does not depend on the link, so this grid runs
without the testbed: each run is the benchmark's own worker (``benchmarks/worker.py``), two
processes talking gloo over 127.0.0.1, no namespaces, no root, no pinning, the benchmark's
matched-batch protocol (``recipes/benchmark.py`` parses the run, ``benchmarks/runner.py``
``train_spec`` writes what each worker is told, ``summarize_run`` reads them back). Run it in
the background at the lowest priority; it can be stopped at any time and continued later::

    cd /work/grid && nohup nice -n 19 python benchmarks/loss_grid.py run > loss_grid.log 2>&1 &
    python benchmarks/loss_grid.py status          # what is done, each mode's gap to DDP so far
    python benchmarks/loss_grid.py one --global-batch 16 --samples 256 --mode acco --lr 2e-3   # one run, printed

The grid (``run``): global batch B in 16, 32, 64, 128, 256 and two run lengths in samples
(:data:`LENGTHS`, the same for every B, so a larger batch takes fewer steps), 2 workers, the modes
of :data:`MODES`, seeds 0 and 1. Per (B, length) and mode, seed 0 sweeps the peak lr over three
values a factor 2 apart around :func:`centre_lr`; when the best of them is at an end of what was
tried, the next lr beyond it is run too (at most :data:`MAX_EXTRA_LRS` of them), so a mode's best
lr is inside its sweep or the JSON says it is not. Every mode is also run at DDP's best lr (a sweep
whose three lrs all sit on the unigram plateau stops, middle best by noise, above where DDP
learned: B = 256 at 12288 samples). The other seeds run at each mode's best seed-0
lr. Every run is scored on the same held-out sequences (``--eval-batches`` batches of DDP's
``--micro-batch``: every mode, every B, every length); the gap of a mode is its held-out loss
against torch DDP's at equal samples, seed against seed, each at its own best lr.

Results: one JSON per (B, length) under ``docs/results/loss_grid/`` (``b{B}_n{samples}.json``),
rewritten after every finished run; a run already in it (mode, lr, seed) is skipped, a run that
failed twice is not tried again. :func:`plan` orders the work so that the most useful points
finish first (:data:`ORDER`: B = 16 and 64 at the short length, both seeds, every mode; then the
other batches at the short length; then the long length).

The workload (:data:`WORKLOAD`) is smaller than the benchmark's default GPT-2 6 x 256 at seq 128
so that the grid fits on a 2-core machine; docs/acco_delay.md says what it is and how its ACCO
gap at B = 16 compares with the larger model's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

OUT_DIR = os.path.join(REPO, "docs", "results", "loss_grid")
REFERENCE = "torch-ddp"
MODES = ("torch-ddp", "acco", "acco+loco4", "acco+loco4+int4params", "zero1+loco4", "zero1+loco4+int4params")
BATCHES = (16, 32, 64, 128, 256)
LENGTHS = (3072, 12288)  # run lengths in samples (x seq_len tokens): the 4.87M runs' 3072, and 4x that
SEEDS = 2
# B and length in the order their points are run: the short length at B = 16 and 64 first
ORDER = [(16, LENGTHS[0]), (64, LENGTHS[0]), (32, LENGTHS[0]), (128, LENGTHS[0]), (256, LENGTHS[0]),
         (16, LENGTHS[1]), (64, LENGTHS[1]), (32, LENGTHS[1]), (128, LENGTHS[1]), (256, LENGTHS[1])]
BASE_LR = 2e-3  # the sweep's centre at B = 16
MAX_EXTRA_LRS = 2  # lrs beyond the first three, when the best keeps landing on an end
MAX_FAILURES = 2
# the workload every run of the grid shares (benchmark arguments)
WORKLOAD = {"model": "tiny-gpt2", "n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": 64, "micro_batch": 8,
            "eval_batches": 16, "eval_points": 8, "heldout": "hamlet", "max_grad_norm": 1.0, "comm_chunks": 1,
            "workers": 2}
RUN_TIMEOUT_S = 7200.0  # a run at nice 19 on a busy host can take many times its idle time
# The grid's second layout, 2 nodes x 2 ranks on the two-level exchange: under a gradient codec it
# compresses each node's sum instead of each rank's gradient, so those modes' loss is measured there
# too (the planner's two-level and node-sharded rows stand on it, engine/planner/evidence.py). Only
# the codec modes run (an uncompressed mode's update is the same mean on either exchange); every
# mode's sweep is centred on its own best lr of the 2 x 1 grid at the same point; B = 16 is left out
# (4 ranks of micro-batch 8 take 32 samples a step).
LAYOUTS = {"2x1": None, "2x2": {"workers": 4, "ranks_per_node": 2}}
MODES_2X2 = (REFERENCE,) + tuple(f"{m}@two_level" for m in MODES if "loco" in m)
ORDER_2X2 = [(256, LENGTHS[0]), (64, LENGTHS[0]), (32, LENGTHS[0]), (128, LENGTHS[0]), (256, LENGTHS[1])]


def workload_of(layout: str) -> dict:
    return {**WORKLOAD, **(LAYOUTS[layout] or {})}


def flat_name(mode: str) -> str:
    """The 2 x 1 grid's name of a 2 x 2 mode (its lr sweep's centre)."""
    return mode.split("@")[0]


def log(msg: str) -> None:
    print(f"[grid {time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the plan (no torch here)
def centre_lr(global_batch: int) -> float:
    """The sweep's middle lr at ``global_batch``: BASE_LR at B = 16, doubled for every 4x in B
    (AdamW's square-root rule, kept on the sweep's factor-2 grid: 16, 32 -> x1; 64, 128 -> x2;
    256 -> x4). Fixed before any run; the sweep and its extension find each mode's best."""
    return BASE_LR * 2 ** math.floor(math.log2(global_batch / 16) / 2)


def lr_key(lr: float) -> float:
    """lrs compared as numbers rounded to 6 significant digits (2e-3 * 2 and 4e-3 are one lr)."""
    return float(f"{lr:.6g}")


def finished(runs: list[dict], mode: str, seed: int) -> dict[float, float]:
    """lr -> final held-out loss of ``mode``'s finished runs at ``seed``."""
    return {lr_key(r["lr"]): r["final_loss"] for r in runs
            if r["mode"] == mode and r["seed"] == seed and r.get("final_loss") is not None}


def next_sweep_lr(tried: dict[float, float], centre: float) -> float | None:
    """The next seed-0 lr of one mode: the three of the factor-2 grid around ``centre`` first,
    then, while the best lost loss is at an end of what was tried, the next lr beyond that end
    (at most MAX_EXTRA_LRS); None once the sweep is done. ``tried``: lr -> final loss."""
    for lr in (centre, centre / 2, centre * 2):
        if lr_key(lr) not in tried:
            return lr_key(lr)
    if len(tried) >= 3 + MAX_EXTRA_LRS:
        return None
    best = min(tried, key=lambda lr: (tried[lr], lr))
    if not math.isfinite(tried[best]):
        return None
    if best == min(tried):
        return lr_key(best / 2)
    if best == max(tried):
        return lr_key(best * 2)
    return None


def best_lr(tried: dict[float, float]) -> float | None:
    """The lr of the lowest final held-out loss (a tie: the smaller lr)."""
    return min(tried, key=lambda lr: (tried[lr], lr)) if tried else None


def reference_best_lr(doc: dict) -> float | None:
    """torch DDP's best seed-0 lr once its sweep is done, else None."""
    centre = doc["lr_rule"].get("centre_by_mode", {}).get(REFERENCE, centre_lr(doc["global_batch"]))
    tried = finished(doc.get("runs", []), REFERENCE, 0)
    return lr_key(best_lr(tried)) if tried and next_sweep_lr(tried, centre) is None else None


def failures_of(doc: dict, mode: str, lr: float, seed: int) -> int:
    return sum(1 for f in doc.get("failures", []) if f["mode"] == mode and lr_key(f["lr"]) == lr_key(lr)
               and f["seed"] == seed)


def next_runs(doc: dict, modes=MODES, seeds: int = SEEDS) -> list[tuple[str, float, int]]:
    """The (mode, lr, seed) runs of one (B, length) that can start now, in order: seed 0's sweep
    (every mode at the centre lr, then every mode at its half and double, then any extension),
    then the later seeds at each mode's best seed-0 lr once its sweep is done. Runs that failed
    MAX_FAILURES times are left out."""
    runs, centres = doc.get("runs", []), doc["lr_rule"].get("centre_by_mode", {})
    out: list[tuple[str, float, int]] = []
    reference_lr = reference_best_lr(doc)
    for m in modes:
        centre = centres.get(m, centre_lr(doc["global_batch"]))
        tried = finished(runs, m, 0)
        failed = {lr_key(f["lr"]) for f in doc.get("failures", []) if f["mode"] == m and f["seed"] == 0
                  and failures_of(doc, m, f["lr"], 0) >= MAX_FAILURES}
        # a sweep whose three lrs all sit on the unigram plateau (ends within noise) stops without
        # reaching the lr where DDP learned; every mode is also run there
        if m != REFERENCE and reference_lr is not None and reference_lr not in tried and reference_lr not in failed:
            out.append((m, reference_lr, 0))
            continue
        lr = next_sweep_lr({**tried, **{x: math.inf for x in failed}}, centre)
        if lr is not None:
            out.append((m, lr, 0))
            continue
        best = best_lr(tried)
        if best is None:
            continue
        for s in range(1, seeds):
            if lr_key(best) not in finished(runs, m, s) and failures_of(doc, m, best, s) < MAX_FAILURES:
                out.append((m, best, s))
                break
    # seed 0 before later seeds; within seed 0 the centre lr first, then the rest of the sweep
    return sorted(out, key=lambda t: (t[2], lr_key(t[1]) != lr_key(centres.get(t[0], centre_lr(doc["global_batch"]))),
                                      out.index(t)))


def plan(docs: dict[tuple[int, int], dict], order=ORDER, modes=MODES, seeds: int = SEEDS):
    """The next run of the whole grid: ((B, samples), mode, lr, seed), or None when it is done."""
    for key in order:
        todo = next_runs(docs[key], modes, seeds)
        if todo:
            return key, *todo[0]
    return None


# ------------------------------------------------------------------ the JSONs
def json_path(global_batch: int, samples: int, layout: str = "2x1") -> str:
    suffix = "" if layout == "2x1" else f"_{layout}"
    return os.path.join(OUT_DIR, f"b{global_batch}_n{samples}{suffix}.json")


def flat_centres(global_batch: int, samples: int, modes) -> dict[str, float]:
    """Each 2 x 2 mode's sweep centre: its 2 x 1 best lr at the same point (the B rule where that
    point has none)."""
    path = json_path(global_batch, samples)
    summary = {}
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f).get("summary", {})
    return {m: (summary.get(flat_name(m)) or {}).get("best_lr") or centre_lr(global_batch) for m in modes}


def new_doc(global_batch: int, samples: int, layout: str = "2x1") -> dict:
    w = workload_of(layout)
    lr_rule = {"centre": centre_lr(global_batch), "grid": "x0.5, x1, x2, extended by x2 beyond an end "
               f"that is best (at most {MAX_EXTRA_LRS} more)", "seed_0_sweeps": True}
    if layout != "2x1":
        lr_rule["centre_by_mode"] = flat_centres(global_batch, samples, MODES_2X2)
    return {"about": "issue 44's loss grid: held-out loss at equal samples per mode, against torch DDP, "
                     "local gloo processes (no shaped link), benchmark matched-batch protocol",
            "command": "python benchmarks/loss_grid.py run" + ("" if layout == "2x1" else f" --layout {layout}"),
            "layout": layout, "global_batch": global_batch, "samples": samples,
            "steps": samples // global_batch, "tokens": samples * w["seq_len"], "workload": dict(w),
            "heldout": {"text": w["heldout"], "seq_len": w["seq_len"],
                        "sequences": w["eval_batches"] * w["micro_batch"]},
            "lr_rule": lr_rule, "runs": [], "failures": [], "summary": {}}


def load_doc(global_batch: int, samples: int, layout: str = "2x1") -> dict:
    path, workload = json_path(global_batch, samples, layout), workload_of(layout)
    if not os.path.exists(path):
        return new_doc(global_batch, samples, layout)
    with open(path) as f:
        doc = json.load(f)
    if doc.get("workload") != workload:
        raise SystemExit(f"{path} was run with workload {doc.get('workload')}, this runner has {workload}: "
                         "move it aside or restore the runner's WORKLOAD")
    return doc


def save_doc(doc: dict) -> None:
    doc["summary"] = summarize(doc)
    path = json_path(doc["global_batch"], doc["samples"], doc.get("layout", "2x1"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def summarize(doc: dict) -> dict:
    """Per mode: its seed-0 sweep (lr -> final loss), best lr, final loss per seed at it, and the
    gap to torch DDP (at DDP's best lr) at equal samples, seed against seed, at the end and at
    every eval point (percent)."""
    runs = doc.get("runs", [])
    modes = [m for m in MODES + MODES_2X2[1:] if any(r["mode"] == m for r in runs)]
    best = {m: best_lr(finished(runs, m, 0)) for m in modes}

    def at_best(m):
        return {r["seed"]: r for r in runs if r["mode"] == m and best[m] is not None
                and lr_key(r["lr"]) == best[m] and r.get("final_loss") is not None}

    ref = at_best(REFERENCE) if REFERENCE in best else {}
    out = {}
    for m in modes:
        sweep = dict(sorted(finished(runs, m, 0).items()))
        mine = at_best(m)
        gaps, curves = {}, {}
        for s, r in sorted(mine.items()):
            if s in ref:
                gaps[s] = 100 * (r["final_loss"] / ref[s]["final_loss"] - 1)
                ref_at = {e["samples"]: e["loss"] for e in ref[s]["evals"]}
                curves[s] = [[e["samples"], round(100 * (e["loss"] / ref_at[e["samples"]] - 1), 4)]
                             for e in r["evals"] if e["samples"] in ref_at and e.get("loss") is not None]
        lrs = sorted(sweep)
        out[m] = {"sweep_seed0": {f"{lr:g}": loss for lr, loss in sweep.items()}, "best_lr": best[m],
                  "best_lr_inside_sweep": None if best[m] is None or len(lrs) < 3 else lrs[0] < best[m] < lrs[-1],
                  "final_loss": {str(s): r["final_loss"] for s, r in sorted(mine.items())},
                  "gap_vs_ddp_pct": {str(s): round(g, 4) for s, g in gaps.items()},
                  "gap_vs_ddp_pct_mean": round(statistics.fmean(gaps.values()), 4) if gaps else None,
                  "gap_vs_ddp_pct_over_run": {str(s): c for s, c in curves.items()},
                  # the same lr as DDP's best, seed 0 (what a user who reuses DDP's lr gets)
                  "gap_vs_ddp_pct_at_ddp_lr_seed0": gap_same_lr(runs, m, best.get(REFERENCE))}
    return out


def gap_same_lr(runs: list[dict], mode: str, lr: float | None) -> float | None:
    if lr is None:
        return None
    a, b = finished(runs, mode, 0).get(lr), finished(runs, REFERENCE, 0).get(lr)
    return None if a is None or b is None else round(100 * (a / b - 1), 4)


# ------------------------------------------------------------------ one run, on local processes
def benchmark_args(global_batch: int, samples: int, mode: str, lr: float, workload: dict = WORKLOAD):
    """The benchmark's own parsed arguments for one run (its checks, batch plans and schedule)."""
    spec = importlib.util.spec_from_file_location("acl_benchmark_cli", os.path.join(REPO, "recipes", "benchmark.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    w = workload
    g = w.get("ranks_per_node", 1)
    layout = ["--workers", str(w["workers"])] if g == 1 else ["--nodes", str(w["workers"] // g), "--ranks-per-node", str(g)]
    argv = [*layout, "--global-batch", str(global_batch), "--samples", str(samples),
            "--modes", mode, "--lr", repr(lr), "--no-lr-sweep", "--seeds", "1", "--model", w["model"],
            "--n-layer", str(w["n_layer"]), "--n-embd", str(w["n_embd"]), "--n-head", str(w["n_head"]),
            "--seq-len", str(w["seq_len"]), "--micro-batch", str(w["micro_batch"]),
            "--eval-batches", str(w["eval_batches"]), "--eval-points", str(w["eval_points"]),
            "--heldout", w["heldout"], "--max-grad-norm", str(w["max_grad_norm"]),
            "--comm-chunks", str(w["comm_chunks"]), "--run-timeout", str(RUN_TIMEOUT_S)]
    return cli.parse_args(argv)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(global_batch: int, samples: int, mode: str, lr: float, seed: int, workdir: str,
              workload: dict = WORKLOAD) -> dict:
    """One training run of ``mode`` as ``workload['workers']`` local worker processes; its summary
    (``runner.summarize_run``, without the timeline). Raises runner.RunFailed."""
    from benchmarks import runner
    from benchmarks.testbed import torchrun_env

    args = benchmark_args(global_batch, samples, mode, lr, workload)
    spec = runner.train_spec(args, mode, lr, seed)
    name = f"b{global_batch}-n{samples}-{mode}-lr{lr:g}-s{seed}".replace("+", "_")
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    port = free_port()
    env = {**os.environ, **runner.worker_env(args, port), "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs, outs, logs = [], [], []
    t = time.monotonic()
    for r in range(args.workers):
        outs.append(os.path.join(workdir, f"{name}.rank{r}.json"))
        logs.append(os.path.join(workdir, f"{name}.rank{r}.log"))
        with open(logs[-1], "w") as lf:
            procs.append(subprocess.Popen([sys.executable, runner.WORKER, spec_path, outs[-1]],
                                          env={**env, **torchrun_env(r, args.nodes, args.ranks_per_node)}, cwd=REPO,
                                          stdout=lf, stderr=subprocess.STDOUT, start_new_session=True))
    codes = runner.wait_all(procs, args.run_timeout)
    if any(c != 0 for c in codes):
        raise runner.RunFailed(runner.failure_report(name, codes, logs))
    res = []
    for out in outs:
        with open(out) as f:
            res.append(json.load(f))
    run = runner.summarize_run(mode, lr, seed, res, spec)
    keep = ("mode", "lr", "seed", "steps", "samples", "global_batch", "micro_batch", "accumulation",
            "global_micro_batches", "lr_schedule", "data", "train_s", "startup_s", "step_time_median_s",
            "samples_per_s", "wire_bytes_per_step_engine", "evals", "final_loss")
    out = {k: run[k] for k in keep}
    hist = run["history"]
    tail = hist[-max(1, len(hist) // 10):]
    out["train_loss_last10pct"] = statistics.fmean(h["loss"] for h in tail) if tail else None
    out["wall_s"] = time.monotonic() - t
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    out["load_average"] = list(os.getloadavg())
    return out


def host_facts() -> dict:
    """Where the runs ran: host, torch, the commit of this checkout and which engine package the
    workers import (this checkout's, through PYTHONPATH)."""
    import torch

    import engine

    def git(*argv: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", REPO, *argv], check=False, capture_output=True,
                                  text=True).stdout.strip()
        except OSError:
            return None

    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "commit": git("rev-parse", "HEAD"),
            "uncommitted_changes": bool(git("status", "--porcelain", "--", "engine", "acco_loco", "lm", "benchmarks")),
            "engine": os.path.dirname(engine.__file__)}


# ------------------------------------------------------------------ commands
def layout_plan(layout: str) -> tuple[list, tuple]:
    """The (B, length) order and the modes of a layout's grid."""
    return (ORDER, MODES) if layout == "2x1" else (ORDER_2X2, MODES_2X2)


def cmd_run(a) -> int:
    every, modes = layout_plan(a.layout)
    modes = modes if a.modes is None else tuple(a.modes)
    order = [(b, n) for b, n in every if (not a.batches or b in a.batches) and (not a.lengths or n in a.lengths)]
    docs = {key: load_doc(*key, a.layout) for key in order}
    workdir = tempfile.mkdtemp(prefix="acl-loss-grid-")
    facts = host_facts()
    log(f"workdir {workdir}; layout {a.layout}; {len(order)} (B, length) cells; modes {list(modes)}; "
        f"seeds {a.seeds}; {facts}")
    done = 0
    while a.max_runs is None or done < a.max_runs:
        nxt = plan(docs, order, modes, a.seeds)
        if nxt is None:
            log("the grid is complete")
            return 0
        (b, n), mode, lr, seed = nxt
        doc = docs[b, n]
        log(f"B={b} samples={n}: {mode} lr {lr:g} seed {seed} ...")
        from benchmarks.runner import RunFailed

        try:
            run = run_local(b, n, mode, lr, seed, workdir, workload_of(a.layout))
        except RunFailed as e:
            log(f"FAILED {e}")
            doc.setdefault("failures", []).append({"mode": mode, "lr": lr, "seed": seed, "report": str(e)[-3000:],
                                                   "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
            save_doc(doc)
            continue
        run["host"] = facts
        doc["runs"].append(run)
        save_doc(doc)
        done += 1
        s = doc["summary"].get(mode, {})
        log(f"B={b} samples={n}: {mode} lr {lr:g} seed {seed}: held-out {run['final_loss']:.4f} "
            f"({run['steps']} steps, {run['train_s']:.0f} s training, {run['wall_s']:.0f} s in all, "
            f"{run['train_s'] / run['steps']:.3f} s/step); gap vs DDP so far {s.get('gap_vs_ddp_pct')}")
    return 0


def cmd_status(a) -> int:
    total = 0
    order, modes = layout_plan(a.layout)
    for b, n in order:
        path = json_path(b, n, a.layout)
        if not os.path.exists(path):
            print(f"B={b:>3} samples={n}: not started")
            continue
        with open(path) as f:
            doc = json.load(f)
        runs = doc["runs"]
        total += sum(r["wall_s"] for r in runs)
        print(f"B={b:>3} samples={n}: {len(runs)} runs, {len(doc.get('failures', []))} failures, "
              f"{sum(r['wall_s'] for r in runs) / 3600:.2f} h")
        for m, s in doc["summary"].items():
            print(f"    {m:<24} best lr {s['best_lr']}  sweep {s['sweep_seed0']}  gap vs DDP % {s['gap_vs_ddp_pct']}")
        nxt = next_runs(doc, modes)
        print(f"    next: {nxt[:3]}{' ...' if len(nxt) > 3 else ''}" if nxt else "    complete")
    print(f"run time so far {total / 3600:.2f} h")
    return 0


def workload_with(base: dict, sets: list[str]) -> dict:
    """``base`` with each ``--set field=value`` applied (the value in the field's own type)."""
    workload = dict(base)
    for item in sets:
        k, _, v = item.partition("=")
        if k not in workload:
            raise SystemExit(f"--set {item}: no workload field {k!r} (fields: {', '.join(workload)})")
        workload[k] = type(workload[k])(v)
    return workload


def cmd_one(a) -> int:
    workdir = tempfile.mkdtemp(prefix="acl-loss-grid-one-")
    workload = workload_with(workload_of(a.layout), a.set)
    run = run_local(a.global_batch, a.samples, a.mode, a.lr, a.seed, workdir, workload)
    run["workload"] = workload
    run["command"] = " ".join(shlex.quote(x) for x in ["python", "benchmarks/loss_grid.py", *sys.argv[1:]])
    if a.append_json:
        doc = {"runs": []}
        if os.path.exists(a.append_json):
            with open(a.append_json) as f:
                doc = json.load(f)
        doc["runs"].append(run)
        with open(a.append_json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    print(json.dumps({k: v for k, v in run.items() if k != "evals"}, indent=1))
    print(json.dumps(run["evals"]))
    print(f"s/step {run['train_s'] / run['steps']:.4f}  samples/s {run['samples'] / run['train_s']:.1f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the grid's missing points, most useful first (resumable)")
    r.add_argument("--batches", type=int, nargs="*", default=None, help="only these B (default: all)")
    r.add_argument("--lengths", type=int, nargs="*", default=None, help="only these run lengths in samples")
    r.add_argument("--modes", nargs="*", default=None, choices=MODES + MODES_2X2[1:],
                   help="only these modes (default: the layout's)")
    r.add_argument("--layout", default="2x1", choices=LAYOUTS, help="nodes x ranks per node (2x2: the codec "
                   "modes on the two-level exchange)")
    r.add_argument("--seeds", type=int, default=SEEDS, help="seeds per point (0..N-1; seed 0 sweeps the lr)")
    r.add_argument("--max-runs", type=int, default=None, help="stop after this many finished runs")
    st = sub.add_parser("status", help="what is done and each mode's gap to DDP so far")
    st.add_argument("--layout", default="2x1", choices=LAYOUTS)
    o = sub.add_parser("one", help="one run, printed (nothing is written under docs/)")
    o.add_argument("--global-batch", type=int, required=True)
    o.add_argument("--samples", type=int, required=True)
    o.add_argument("--mode", required=True)
    o.add_argument("--lr", type=float, required=True)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--layout", default="2x1", choices=LAYOUTS)
    o.add_argument("--append-json", default=None, metavar="PATH",
                   help="also append the run (with its workload and command) to this JSON's list of runs")
    o.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="another workload than the grid's, e.g. --set n_layer=6 --set n_embd=256 --set seq_len=128")
    a = ap.parse_args(argv)
    if a.cmd == "run" and a.modes is not None and REFERENCE not in a.modes:
        ap.error(f"every gap is against {REFERENCE}: keep it in --modes")
    return {"run": cmd_run, "status": cmd_status, "one": cmd_one}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
