"""Side-by-side benchmark over real shaped links: torch DDP peers against this engine's modes.

Run as root (it builds a network-namespace testbed, see ``benchmarks/testbed.py``)::

    python recipes/benchmark.py --workers 2 --rate 100mbit --seeds 1 --samples 1536 \\
        --json bench.json --plot bench_loss.png --timeline bench_timeline.png
    python recipes/benchmark.py --hetero --rate 100mbit        # 3 workers, one at full speed

What it does (docs/DESIGN.md section 4):

* builds a testbed of ``--workers`` namespaces, each behind a ``tbf`` link of ``--rate`` both
  ways (``--delay-ms`` needs the netem qdisc and is refused clearly where the kernel lacks it),
  and tears it down on exit, on an error and on Ctrl-C (the Testbed context manager);
* runs every mode of ``--modes`` as one process per namespace (``recipes/bench_worker.py``),
  one thread each, pinned to one core (``--hetero``: 3 workers, two share core 0, one has
  core 1), on the same model (GPT-2 shape, ~4.9M params, byte vocabulary, seq 128), the same
  data order (every worker reads micro-batch j of its share of the shuffled Shakespeare
  windows, Hamlet held out), the same AdamW hyper-parameters (betas 0.9/0.999, eps 1e-8, no
  weight decay, constant lr) and the same sample budget;
* modes: torch's own DistributedDataParallel + torch.optim.AdamW with ``no_sync``
  accumulation of 1, 4 or 12 micro-batches (``torch-ddp-acc*``), DDP with the PowerSGD comm
  hook (rank 1 / 4, error feedback on; ``torch-ddp+powersgd*``), and this engine's zero1, dpu,
  acco, acco + LoCo 4-bit gradients + int8 param deltas (``acco+loco4``) and with int4 param
  deltas (``acco+loco4+int4params``), all with adaptive accumulation capped at
  ``--max-micro-batches`` per round and ``--comm-chunks`` async pieces per collective;
* measures per mode: median step time, samples/s, global micro-batches per step, wire bytes per
  step as the mode accounts them (engine history; for DDP 2(N-1)/N x the bucket bytes, for
  PowerSGD the hook's all-reduces) and as the worker's interface counted them (tx_bytes over
  the same window; headers and ACKs make it a few % more), held-out loss at eval points
  against samples and wall time, throughput efficiency (samples/s over the compute-only
  samples/s of the same workers doing the same fwd+bwd with no communication), and wall time
  to a target held-out loss: what ``torch-ddp-acc1`` reaches at the end of its run (per seed,
  linear interpolation between eval points).

Wall time starts after a barrier once every worker has built its model and connected (start-up
is reported separately) and excludes evaluation: parameters are copied at the eval points and
evaluated after training. Shared machines are noisy: compare the ratios in one run, not
absolute times across runs. The load average at start and end is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from recipes.bench_worker import ALL_MODES, DDP_MODES, ENGINE_MODES  # noqa: E402

WORKER = os.path.join(REPO, "recipes", "bench_worker.py")
HETERO_MODES = ("torch-ddp-acc1", "torch-ddp-acc4", "torch-ddp-acc12", "torch-ddp+powersgd1",
                "torch-ddp+powersgd4", "zero1", "acco", "acco+loco4", "acco+loco4+int4params")
REFERENCE = "torch-ddp-acc1"
# Every worker, DDP and compute-only included, runs with the malloc settings the engine applies to
# itself on CPU (engine/cpu_memory.py): they take ~11% off a forward+backward too, so leaving
# them to the engine alone would not be a like-for-like comparison.
SAME_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1), "MALLOC_MMAP_MAX_": "0"}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- args


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rate", default="100mbit", help="each worker's link, both ways (tc units)")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay per link direction (needs the netem qdisc)")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--samples", type=int, default=None,
                        help="global training samples per run (default 1536)")
    budget.add_argument("--steps", type=int, default=None,
                        help="budget as torch-ddp-acc1 steps: samples = steps x workers x micro-batch")
    ap.add_argument("--modes", default=None, help=f"comma list from: {', '.join(ALL_MODES)} (default all; "
                    "with --hetero: " + ", ".join(HETERO_MODES) + ")")
    ap.add_argument("--seeds", type=int, default=3, help="runs per mode with seeds 0..N-1 (model init and data order)")
    ap.add_argument("--first-seed", type=int, default=0, help="run seeds first..first+N-1 instead")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="start from the runs of an earlier --json (repeatable): add seeds or modes to a table")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-sweep", action="store_true",
                    help="run each mode at lr x 0.5, 1, 2 and keep its best (median final held-out loss)")
    ap.add_argument("--sweep-seeds", type=int, default=None,
                    help="with --lr-sweep: sweep on the first K seeds only, run the other seeds at each "
                    "mode's best lr (default: every seed at every lr)")
    ap.add_argument("--lr-from", default=None, metavar="JSON",
                    help="each mode's lr from an earlier benchmark JSON (its swept best); modes not in it use --lr")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="global gradient-norm clipping for every mode (0: off)")
    ap.add_argument("--max-round-overhead", type=float, default=0.15,
                    help="engine modes: comm-side CPU per round at most this fraction of its compute "
                    "(sets the minimum micro-batches per round; 0: off)")
    ap.add_argument("--hetero", action="store_true",
                    help="3 workers: two pinned to core 0, one alone on core 1")
    ap.add_argument("--target-loss", type=float, default=None,
                    help=f"target held-out loss (default: what {REFERENCE} reaches at the end, per seed)")
    ap.add_argument("--json", default=None, help="write one object per mode here (rewritten after every run)")
    ap.add_argument("--plot", default=None, help="PNG: held-out loss against wall time per mode")
    ap.add_argument("--timeline", default=None, help="PNG: compute and comm phases per worker for a few steps")
    # the workload (the same for every mode)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--max-micro-batches", type=int, default=4,
                    help="engine modes: adaptive accumulation cap per round and worker")
    ap.add_argument("--comm-chunks", type=int, default=8, help="engine modes: async pieces per collective")
    ap.add_argument("--group-size", type=int, default=128, help="engine codecs: values per quantization group")
    ap.add_argument("--eval-points", type=int, default=6, help="held-out evaluations per run (evenly in samples)")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out micro-batches per evaluation")
    ap.add_argument("--heldout", default="hamlet")
    ap.add_argument("--compute-micro-batches", type=int, default=6,
                    help="timed fwd+bwd per worker for the compute-only ceiling")
    ap.add_argument("--no-compute-at-end", action="store_true",
                    help="skip the second compute-only measurement after the last run (it tracks load drift)")
    ap.add_argument("--run-timeout", type=float, default=1800.0, help="seconds before a run is killed")
    ap.add_argument("--workdir", default=None, help="specs, outputs and worker logs (default: a temp dir)")
    ap.add_argument("--keep-workdir", action="store_true")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="run nothing: print the table and verdict of an earlier --json (and --plot it)")
    ap.add_argument("--prefix", default="bench", help="testbed namespace prefix")
    a = ap.parse_args(argv)
    if a.hetero:
        if a.workers not in (2, 3):
            ap.error("--hetero runs 3 workers; leave --workers out")
        a.workers = 3
    if a.workers < 2:
        ap.error("--workers must be at least 2")
    a.modes = [m.strip() for m in (a.modes or ",".join(HETERO_MODES if a.hetero else ALL_MODES)).split(",")
               if m.strip()]
    unknown = [m for m in a.modes if m not in ALL_MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}: choose from {', '.join(ALL_MODES)}")
    if a.first_seed < 0:
        ap.error("--first-seed must be >= 0")
    if a.seeds < 1:
        ap.error("--seeds must be >= 1")
    if a.samples is None:
        a.samples = a.steps * a.workers * a.micro_batch if a.steps else 1536
    if a.samples < a.workers * a.micro_batch:
        ap.error(f"--samples must be at least one micro-batch per worker ({a.workers * a.micro_batch})")
    a.lrs = [a.lr * f for f in (0.5, 1.0, 2.0)] if a.lr_sweep else [a.lr]
    if a.lr_sweep and a.lr_from:
        ap.error("--lr-sweep and --lr-from exclude each other")
    if a.sweep_seeds is not None and not 1 <= a.sweep_seeds <= a.seeds:
        ap.error(f"--sweep-seeds must lie in [1, --seeds={a.seeds}]")
    a.mode_lr = {}
    if a.lr_from:
        try:
            with open(a.lr_from) as f:
                a.mode_lr = {o["mode"]: o["lr"] for o in json.load(f)["modes"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--lr-from {a.lr_from}: not a benchmark JSON ({e})")
    return a


def runs_for_seed(args, seed: int, done: list[dict]) -> list[tuple[float, str]]:
    """(lr, mode) pairs for one seed: every lr while sweeping; after --sweep-seeds, each mode's best."""
    if args.mode_lr:
        return [(args.mode_lr.get(m, args.lr), m) for m in args.modes]
    if not args.lr_sweep or args.sweep_seeds is None or seed < args.sweep_seeds:
        return [(lr, m) for lr in args.lrs for m in args.modes]
    out = []
    for m in args.modes:
        by_lr: dict[float, list[float]] = {}
        for r in done:  # the sweep seeds only, as aggregate() scores them
            if r["mode"] == m and r["final_loss"] is not None and r["seed"] < args.sweep_seeds:
                by_lr.setdefault(r["lr"], []).append(r["final_loss"])
        best = min(by_lr, key=lambda lr: statistics.median(by_lr[lr])) if by_lr else args.lr
        out.append((best, m))
    return out


def cpu_for(args, rank: int) -> str:
    ncpu = os.cpu_count() or 1
    if args.hetero:
        if ncpu < 2:
            raise SystemExit("--hetero needs 2 cores")
        return "0" if rank < 2 else "1"
    return str(rank % ncpu)


# ----------------------------------------------------------------------------------- runs


class RunFailed(RuntimeError):
    pass


def base_spec(args, seed: int) -> dict:
    return {
        "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "seed": seed, "heldout": args.heldout,
        "eval_batches": args.eval_batches, "timeout_s": 300.0, "max_grad_norm": args.max_grad_norm,
        "max_round_overhead": args.max_round_overhead,
    }


def launch(tb, args, spec: dict, name: str, workdir: str, port: int | None) -> list[dict]:
    """Start one process per worker namespace, wait, return their JSON outputs (rank order)."""
    procs, outs, logs = [], [], []
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {"WORLD_SIZE": str(args.workers), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1", **SAME_MALLOC}
    if port is not None:
        env["MASTER_PORT"] = str(port)
    for r in range(args.workers):
        out = os.path.join(workdir, f"{name}.rank{r}.json")
        logp = os.path.join(workdir, f"{name}.rank{r}.log")
        outs.append(out)
        logs.append(logp)
        with open(logp, "w") as lf:
            procs.append(tb.popen(r, [sys.executable, WORKER, spec_path, out],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": "0"}, cpu=cpu_for(args, r),
                                  stdout=lf, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + args.run_timeout
    failed = None
    while any(p.poll() is None for p in procs):
        bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad and failed is None:
            failed = bad
            deadline = min(deadline, time.monotonic() + 20)  # let the others notice and report
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    codes = [p.returncode for p in procs]
    if any(c != 0 for c in codes):
        tails = []
        for r, logp in enumerate(logs):
            with open(logp, errors="replace") as f:
                tail = f.read()[-1500:]
            tails.append(f"--- rank {r} (exit {codes[r]}), {logp}:\n{tail}")
        raise RunFailed(f"{name}: worker exit codes {codes}\n" + "\n".join(tails))
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def compute_only(tb, args, workdir: str, tag: str) -> float:
    """samples/s of the same workers doing fwd+bwd with no communication (world size 1 each)."""
    spec = {**base_spec(args, 0), "role": "compute", "compute_micro_batches": args.compute_micro_batches}
    res = launch(tb, args, spec, f"compute-{tag}", workdir, None)
    rate = sum(args.micro_batch / statistics.median(r["micro_batch_s"]) for r in res)
    log(f"compute-only ({tag}): {rate:.2f} samples/s; micro-batch s per rank: "
        + ", ".join(f"{statistics.median(r['micro_batch_s']):.3f}" for r in res))
    return rate


def eval_points(args) -> list[int]:
    n = args.eval_points
    return sorted({max(1, round(args.samples * (i + 1) / n)) for i in range(n)})


def summarize_run(mode: str, lr: float, seed: int, res: list[dict]) -> dict:
    r0 = res[0]
    hist = r0["history"]
    world = len(res)
    evals = []
    for i, row in enumerate(r0["evals"]):
        loss = res[i % world]["evals"][i].get("loss")
        evals.append({"samples": row["samples"], "time_s": row["time_s"], "step": row["step"], "loss": loss})
    samples = sum(h["samples"] for h in hist)
    train_s = max(r["train_s"] for r in res)
    ratios = [r["tx_bytes"] / r["accounted_bytes"] if r.get("tx_bytes") and r["accounted_bytes"] else None
              for r in res]
    steps = len(hist)
    return {
        "mode": mode, "lr": lr, "seed": seed, "steps": steps, "samples": samples, "train_s": train_s,
        "startup_s": max(r["startup_s"] for r in res),
        "step_time_median_s": statistics.median(h["time_s"] for h in hist) if hist else None,
        "samples_per_s": samples / train_s if train_s else None,
        "global_micro_batches_median": statistics.median(h["global_micro_batches"] for h in hist) if hist else None,
        "global_micro_batches_mean": statistics.fmean(h["global_micro_batches"] for h in hist) if hist else None,
        "wire_bytes_per_step_engine": statistics.median(h["wire_bytes"] for h in hist) if hist else None,
        "wire_bytes_per_step_tx": r0["tx_bytes"] / steps if r0.get("tx_bytes") is not None and steps else None,
        "accounted_bytes_per_rank": [r["accounted_bytes"] for r in res],
        "tx_bytes_per_rank": [r.get("tx_bytes") for r in res],
        "tx_over_engine_per_rank": ratios,
        "thread_cpu_s_per_rank": [r.get("thread_cpu_s") for r in res],
        "min_micro_batches_median": statistics.median(h.get("min_micro_batches", 0) for h in hist) if hist else None,
        "comm_cpu_s_per_round": statistics.median(r0["comm_cpu_s"][1:]) if len(r0.get("comm_cpu_s") or []) > 1 else None,
        "micro_batches_per_rank": [sum(h["micro_batches"] for h in r["history"]) for r in res],
        "evals": evals,
        "final_loss": evals[-1]["loss"] if evals else None,
        "history": [{k: h[k] for k in ("step", "loss", "samples", "global_micro_batches", "wire_bytes", "time_s")}
                    for h in hist],
        "timeline": [t for r in res for t in shift_timeline(r, r0)],
        **phase_summary(res),
    }


def phase_summary(res: list[dict]) -> dict:
    """Where the time goes: median duration per phase, and how busy each worker's compute was."""
    durations: dict[str, list[float]] = {}
    busy = []
    for r in res:
        compute = 0.0
        for ph, _, a, b, _ in r["timeline"]:
            durations.setdefault(ph, []).append(b - a)
            if ph.startswith("compute"):
                compute += b - a
        busy.append(compute / r["train_s"] if r["train_s"] else None)
    return {"phase_median_s": {ph: statistics.median(v) for ph, v in durations.items()},
            "phase_total_s": {ph: sum(v) / len(res) for ph, v in durations.items()},
            "compute_busy_per_rank": busy}


def shift_timeline(r: dict, r0: dict) -> list:
    d = r["t0_abs"] - r0["t0_abs"]  # put every rank on rank 0's clock
    return [[ph, rank, a + d, b + d, idx] for ph, rank, a, b, idx in r["timeline"]]


# ----------------------------------------------------------------------------------- analysis


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


def aggregate(args, runs: list[dict], compute_rates: list[float]) -> list[dict]:
    compute_rate = statistics.median(compute_rates) if compute_rates else None
    by_mode: dict[str, dict[float, list[dict]]] = {}
    for r in runs:
        by_mode.setdefault(r["mode"], {}).setdefault(r["lr"], []).append(r)

    def score(rs):
        if args.lr_sweep and args.sweep_seeds is not None:  # only the seeds every lr ran on
            rs = [r for r in rs if r["seed"] < args.sweep_seeds]
        losses = [r["final_loss"] for r in rs if r["final_loss"] is not None]
        return statistics.median(losses) if losses else float("inf")

    best = {m: min(lrs.items(), key=lambda kv: score(kv[1])) for m, lrs in by_mode.items()}
    for m, lr in args.mode_lr.items():  # --lr-from: the lr chosen by the earlier sweep
        if m in by_mode and lr in by_mode[m]:
            best[m] = (lr, by_mode[m][lr])
    targets: dict[int, float] = {}
    if args.target_loss is not None:
        targets = {r["seed"]: args.target_loss for r in runs}
    elif REFERENCE in best:
        targets = {r["seed"]: r["final_loss"] for r in best[REFERENCE][1] if r["final_loss"] is not None}

    out = []
    for mode in [m for m in ALL_MODES if m in best]:  # merged runs may add modes
        lr, rs = best[mode]
        med = lambda key: statistics.median(r[key] for r in rs if r[key] is not None) \
            if any(r[key] is not None for r in rs) else None  # noqa: E731
        ttt = [time_to_target(r["evals"], targets.get(r["seed"])) for r in rs]
        reached = [t for t in ttt if t is not None]
        ratios = [x for r in rs for x in r["tx_over_engine_per_rank"] if x is not None]
        sps = med("samples_per_s")
        obj = {
            "mode": mode, "kind": "torch-ddp" if mode in DDP_MODES else "engine",
            "workers": args.workers, "rate": args.rate, "hetero": args.hetero,
            "lr": lr, "lrs_tried": sorted(by_mode[mode]),
            "lr_scores": {str(k): score(v) for k, v in sorted(by_mode[mode].items())},
            "seeds": sorted(r["seed"] for r in rs),
            "samples_budget": args.samples,
            "samples": med("samples"),
            "steps": med("steps"),
            "train_s": med("train_s"),
            "startup_s": med("startup_s"),
            "step_time_median_s": med("step_time_median_s"),
            "samples_per_s": sps,
            "global_micro_batches_per_step": med("global_micro_batches_median"),
            "min_micro_batches_per_round": med("min_micro_batches_median") if mode in ENGINE_MODES else None,
            "comm_cpu_s_per_round": med("comm_cpu_s_per_round") if mode in ENGINE_MODES else None,
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
            "time_to_target_s": statistics.median(reached) if reached else None,
            "time_to_target_min_s": min(reached) if reached else None,
            "time_to_target_max_s": max(reached) if reached else None,
            "time_to_target_per_seed": ttt,
            "reached_target": f"{len(reached)}/{len(rs)}",
            "phase_median_s": rs[0].get("phase_median_s"),
            "compute_busy": statistics.median(statistics.fmean(x for x in r["compute_busy_per_rank"] if x is not None)
                                              for r in rs) if all(r.get("compute_busy_per_rank") for r in rs) else None,
            "evals": [r["evals"] for r in rs],
            "runs": [{k: v for k, v in r.items() if k not in ("timeline", "history")} for r in runs
                     if r["mode"] == mode],
        }
        out.append(obj)
    add_derived(out, args.workers, args.rate, args.micro_batch)
    return out


def rate_bits_per_s(rate: str) -> float:
    """tc rate units (bit, kbit, mbit, gbit; decimal, as tc reads them) to bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    r = rate.strip().lower()
    for unit, factor in units.items():
        if r.endswith(unit):
            return float(r[:-len(unit)]) * factor
    return float(r)


def add_derived(out: list[dict], workers: int, rate: str, micro_batch: int) -> None:
    """Ratios against the reference and docs/DESIGN.md section 4's overlap efficiency: the physical
    limit of a (median) step, max(its compute at the compute-only pace, its wire bytes over the
    link), over the measured median step time."""
    link = rate_bits_per_s(rate) / 8
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


# ----------------------------------------------------------------------------------- plots


def plot_loss(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 5))
    for i, o in enumerate(rows):
        color = f"C{i % 10}"
        for k, ev in enumerate(o["evals"]):
            pts = [e for e in ev if e["loss"] is not None]
            label = f"{o['mode']} (lr {o['lr']:g})" if k == 0 else None
            ls = "--" if o["kind"] == "torch-ddp" else "-"
            ax_t.plot([e["time_s"] for e in pts], [e["loss"] for e in pts], ls, marker="o", ms=3,
                      color=color, label=label)
            ax_s.plot([e["samples"] for e in pts], [e["loss"] for e in pts], ls, marker="o", ms=3, color=color)
    target = next((o["target_loss"] for o in rows if o["target_loss"] is not None), None)
    for ax in (ax_t, ax_s):
        if target is not None:
            ax.axhline(target, color="k", lw=0.8, ls=":")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
    ax_t.set_xlabel("wall time (s)")
    ax_s.set_xlabel("global samples")
    ax_t.legend(fontsize=7)
    ax_t.set_title("held-out loss against wall time")
    ax_s.set_title("held-out loss against samples")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PHASE_COLORS = {"compute": "#4C72B0", "compute+allreduce": "#8172B2", "reduce_scatter": "#DD8452",
                "optimizer": "#55A868", "all_gather": "#C44E52"}


def plot_timeline(runs: list[dict], modes: list[str], path: str, n_steps: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    picked = []
    for m in modes:  # first run of each mode (lowest seed, first lr run)
        rs = [r for r in runs if r["mode"] == m and r.get("timeline")]  # merged runs carry none
        if rs:
            picked.append(min(rs, key=lambda r: r["seed"]))
    if not picked:
        return
    fig, axes = plt.subplots(len(picked), 1, figsize=(13, 1.3 + 1.0 * len(picked) * 1.6), squeeze=False)
    for ax, r in zip(axes[:, 0], picked):
        ends, acc = [], 0.0
        for h in r["history"]:
            acc += h["time_s"]
            ends.append(acc)
        start = ends[0] if len(ends) > n_steps + 1 else 0.0  # skip the first step (warm-up)
        stop_i = min(len(ends) - 1, (1 if start else 0) + n_steps)
        stop = ends[stop_i] if ends else max(t[3] for t in r["timeline"])
        workers = sorted({t[1] for t in r["timeline"]})
        for ph, rank, a, b, _ in r["timeline"]:
            if b < start or a > stop:
                continue
            comm = ph in ("reduce_scatter", "optimizer", "all_gather") and r["mode"] in ENGINE_MODES
            y = rank * 2 + (0 if comm else 1)
            ax.broken_barh([(a, b - a)], (y - 0.4, 0.8), facecolor=PHASE_COLORS.get(ph, "grey"),
                           edgecolor="white", linewidth=0.4)
        ax.set_xlim(start, stop)
        ax.set_yticks([w * 2 + k for w in workers for k in (0, 1)])
        ax.set_yticklabels([f"w{w} {'comm' if k == 0 else 'compute'}" for w in workers for k in (0, 1)], fontsize=7)
        note = " (DDP: the all-reduce runs inside the synchronised backward)" if r["mode"] in DDP_MODES else ""
        ax.set_title(f"{r['mode']} (seed {r['seed']}, lr {r['lr']:g}): steps "
                     f"{(2 if start else 1)}-{stop_i + 1}{note}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("wall time since start (s)")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in PHASE_COLORS.items()], loc="upper right",
               fontsize=7, ncol=5)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------- main


def write_outputs(args, runs, compute_rates, final: bool) -> list[dict]:
    rows = aggregate(args, runs, compute_rates)
    if args.json:
        doc = {"command": " ".join(shlex.quote(a) for a in sys.argv), "complete": final,
               "config": {k: v for k, v in vars(args).items()}, "compute_only_samples_per_s": compute_rates,
               "load_average": os.getloadavg(), "modes": rows}
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, args.json)
    return rows


def load_runs(path: str) -> tuple[list[dict], list[float]]:
    """The per-run summaries and compute-only rates of an earlier --json (no timelines)."""
    with open(path) as f:
        doc = json.load(f)
    runs = [r for o in doc["modes"] for r in o["runs"]]
    for r in runs:
        r.setdefault("timeline", [])
        r.setdefault("history", [])
    return runs, list(doc["compute_only_samples_per_s"])


def render(args) -> int:
    try:
        with open(args.render) as f:
            doc = json.load(f)
        rows, cfg = doc["modes"], doc["config"]
        add_derived(rows, cfg["workers"], cfg["rate"], cfg["micro_batch"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: --render {args.render}: not a benchmark JSON ({e})", file=sys.stderr)
        return 2
    print(f"command: `{doc['command']}`{'' if doc.get('complete') else ' (INCOMPLETE: the run was cut short)'}  ")
    print(f"compute-only: {', '.join(f'{x:.2f}' for x in doc['compute_only_samples_per_s'])} samples/s; "
          f"target held-out loss {fmt(next((o['target_loss'] for o in rows if o['target_loss']), None), '.3f')}\n")
    print(table(rows))
    print()
    print(verdict(rows))
    if args.plot and rows:
        plot_loss(rows, args.plot)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args)
    from benchmarks.testbed import LinkSpec, Testbed, TestbedError, requires_root_reason

    reason = requires_root_reason(delay=args.delay_ms > 0)
    if reason:
        if args.delay_ms > 0 and os.geteuid() == 0:
            print(f"error: --delay-ms {args.delay_ms:g} needs the netem qdisc, and {reason}; "
                  "run without --delay-ms (rate-only links) or on a kernel with CONFIG_NET_SCH_NETEM",
                  file=sys.stderr)
        else:
            print(f"error: {reason}", file=sys.stderr)
        return 2

    workdir = args.workdir or tempfile.mkdtemp(prefix="acl-bench-")
    os.makedirs(workdir, exist_ok=True)
    load0 = os.getloadavg()
    log(f"workdir {workdir}; load average {load0[0]:.1f} on {os.cpu_count()} cores; modes {args.modes}; "
        f"{args.samples} samples; lrs {args.lrs}; seeds {args.seeds}")
    runs: list[dict] = []
    compute_rates: list[float] = []
    for path in args.merge:
        try:
            runs_in, rates_in = load_runs(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: --merge {path}: not a benchmark JSON ({e})", file=sys.stderr)
            return 2
        runs += runs_in
        compute_rates += rates_in
        log(f"merged {len(runs_in)} runs from {path}")
    failures: list[str] = []
    port = 29500
    t_start = time.monotonic()
    try:
        with Testbed(workers=args.workers, link=LinkSpec(args.rate, args.delay_ms), prefix=args.prefix) as tb:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                compute_rates.append(compute_only(tb, args, workdir, f"s{seed}"))
                for lr, mode in runs_for_seed(args, seed, runs):
                    name = f"{mode}-lr{lr:g}-s{seed}".replace("+", "_")
                    spec = {**base_spec(args, seed), "role": "train", "mode": mode, "lr": lr,
                            "samples": args.samples, "eval_points": eval_points(args),
                            "max_micro_batches": args.max_micro_batches, "comm_chunks": args.comm_chunks,
                            "group_size": args.group_size}
                    port += 1
                    t = time.monotonic()
                    try:
                        res = launch(tb, args, spec, name, workdir, port)
                    except RunFailed as e:
                        failures.append(str(e))
                        log(f"FAILED {e}")
                        continue
                    run = summarize_run(mode, lr, seed, res)
                    runs.append(run)
                    log(f"{name}: {run['steps']} steps, {run['samples']} samples in {run['train_s']:.1f} s "
                        f"({run['samples_per_s']:.2f}/s, start-up {run['startup_s']:.1f} s), held-out "
                        f"{fmt(run['final_loss'], '.3f')}, tx/mode {run['tx_over_engine_per_rank']}, "
                        f"run {time.monotonic() - t:.0f} s")
                    write_outputs(args, runs, compute_rates, final=False)
            if not args.no_compute_at_end:
                compute_rates.append(compute_only(tb, args, workdir, "end"))
    except TestbedError as e:
        print(f"error: testbed: {e}", file=sys.stderr)
        return 2
    finally:
        if runs:
            write_outputs(args, runs, compute_rates, final=False)

    rows = write_outputs(args, runs, compute_rates, final=True)
    load1 = os.getloadavg()
    print(f"## acco-loco benchmark: {args.workers} workers{' (hetero: 2 on core 0, 1 on core 1)' if args.hetero else ''}, "
          f"{args.rate} links{f', {args.delay_ms:g} ms delay' if args.delay_ms else ''}, {args.samples} samples/run, "
          f"seeds {args.seeds}, lr {'sweep ' if args.lr_sweep else ''}{', '.join(f'{x:g}' for x in args.lrs)}\n")
    print(f"command: `{' '.join(shlex.quote(a) for a in [sys.executable] + sys.argv)}`  ")
    print(f"model: GPT-2 {args.n_layer}x{args.n_embd}, {args.n_head} heads, byte vocab, seq {args.seq_len}, "
          f"micro-batch {args.micro_batch}; engine modes adaptive, cap {args.max_micro_batches} micro-batches/round, "
          f"{args.comm_chunks} comm chunks  ")
    print(f"compute-only: {', '.join(f'{x:.2f}' for x in compute_rates)} samples/s (median used); "
          f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end on {os.cpu_count()} cores; "
          f"total {time.monotonic() - t_start:.0f} s  ")
    tgt = next((o["target_loss"] for o in rows if o["target_loss"] is not None), None)
    print(f"target held-out loss: {fmt(tgt, '.3f')} ({'given' if args.target_loss is not None else REFERENCE + ' at the end'})\n")
    print(table(rows))
    print()
    print(verdict(rows))
    if args.plot and rows:
        plot_loss(rows, args.plot)
    if args.timeline and runs:
        plot_timeline(runs, args.modes, args.timeline)
    bad_ratio = [o["mode"] for o in rows if o["tx_over_engine_max_dev"] is not None and o["tx_over_engine_max_dev"] > 0.10]
    if bad_ratio:
        print(f"\nwarning: interface tx_bytes and accounted wire bytes differ by more than 10% for {bad_ratio}",
              file=sys.stderr)
    if failures:
        print(f"\n{len(failures)} run(s) failed; logs in {workdir}", file=sys.stderr)
        return 1
    if not args.keep_workdir and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
