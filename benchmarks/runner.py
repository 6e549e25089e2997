"""The benchmark's orchestration: which runs (seed, lr, mode), what each worker is told (its
batch, micro-batch and lr schedule under the protocol: :func:`train_spec`), one worker process
per testbed namespace for each run (``benchmarks/worker.py``), their outputs summarized into one
record per run, and the JSON rewritten after every run.

Wall time starts after a barrier once every worker has built its model and connected (start-up
is reported separately) and excludes evaluation: parameters are copied at the eval points and
evaluated after training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time

from benchmarks.modes import MODES, matched_schedule, topology_of
from benchmarks.report import aggregate, fmt

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
# Every worker, DDP and compute-only included, runs with the malloc settings the engine applies to
# itself on CPU (engine/runtime/cpu_memory.py): they take ~11% off a forward+backward too, so leaving
# them to the engine alone would not be a like-for-like comparison.
SAME_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1), "MALLOC_MMAP_MAX_": "0"}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


class RunFailed(RuntimeError):
    pass


def base_spec(args, seed: int, micro_batch: int) -> dict:
    return {
        "model": args.model, "train_layers": args.train_layers,
        "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "seq_len": args.seq_len,
        "micro_batch": micro_batch, "seed": seed, "heldout": args.heldout,
        # the held-out set is the same sequences for every mode: eval batches of the command's
        # --micro-batch, not the mode's (a mode at half the micro-batch saw half the set)
        "eval_batches": args.eval_batches, "eval_micro_batch": args.micro_batch,
        "timeout_s": 300.0, "max_grad_norm": args.max_grad_norm, "optimizer": getattr(args, "optimizer", "adamw"),
        "ranks_per_node": ranks_per_node(args),
    }


def data_order(args, mode: str) -> str:
    """How a mode's workers read the data. Matched: "dealt", one global order of windows, step
    t reading windows [tB, (t+1)B) in every mode whatever its micro-batch or shares; a local-step
    mode's workers take their own inner steps, and the free protocol grows batches: "per-rank",
    each worker its own stream."""
    return "dealt" if args.protocol == "matched" and not MODES[mode].local_steps else "per-rank"


def speed_shared(mode: str) -> bool:
    """Whether ``--balance speed`` moves this mode's micro-batches between workers."""
    m = MODES[mode]
    return m.ddp is None and not m.local_steps and m.extra.get("balance", "speed") == "speed"


def train_spec(args, mode: str, lr: float, seed: int) -> dict:
    """What every worker of one training run is told: the workload, the mode's batch under the
    protocol (micro-batch; DDP accumulation; engine global micro-batches, or the free protocol's
    grow settings), the lr schedule (matched batch: the shared warmup + cosine over the budget's
    steps; free: constant), the budget and the eval points."""
    plan = args.batch_plans[mode]
    steps = mode_steps(args, mode)
    samples = args.samples if steps == args.steps else steps * args.global_batch
    spec = {**base_spec(args, seed, plan.micro_batch), "role": "train", "mode": mode, "lr": lr,
            "protocol": args.protocol, "samples": samples, "eval_points": eval_points(args, samples),
            "comm_chunks": args.comm_chunks, "group_size": args.group_size,
            "accumulation": plan.accumulation, "global_micro_batches": plan.global_micro_batches,
            "lr_schedule": None, "topology": topology_of(mode)}
    if args.protocol == "matched":
        spec["lr_schedule"] = dataclasses.asdict(matched_schedule(lr, steps))
        spec["balance"] = args.balance
        spec["global_batch"] = args.global_batch
        spec["data"] = data_order(args, mode)
    else:
        spec["max_micro_batches"] = args.max_micro_batches
        spec["max_round_overhead"] = args.max_round_overhead
    return spec


def micro_batches_in_use(args) -> list[int]:
    """The micro-batch sizes of the modes to run (each gets its own compute-only measurement)."""
    return sorted({p.micro_batch for p in args.batch_plans.values()}, reverse=True)


def worker_env(args, port: int | None) -> dict[str, str]:
    env = {"WORLD_SIZE": str(args.workers), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1", **SAME_MALLOC}
    if port is not None:
        env["MASTER_PORT"] = str(port)
    return env


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Wait for every worker (20 s more once one failed, so the others can notice and report),
    kill what is left at the deadline; their exit codes."""
    deadline = time.monotonic() + timeout_s
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
    return [p.returncode for p in procs]


def failure_report(name: str, codes: list[int], logs: list[str]) -> str:
    tails = []
    for r, logp in enumerate(logs):
        with open(logp, errors="replace") as f:
            tail = f.read()[-1500:]
        tails.append(f"--- rank {r} (exit {codes[r]}), {logp}:\n{tail}")
    return f"{name}: worker exit codes {codes}\n" + "\n".join(tails)


def ranks_per_node(args) -> int:
    return getattr(args, "ranks_per_node", 1) or 1


def launch(tb, args, spec: dict, name: str, workdir: str, port: int | None) -> list[dict]:
    """Start one process per rank (``ranks_per_node`` of them in each node's namespace), wait,
    return their JSON outputs (rank order). Rank 0's output gets ``node_link_tx_bytes``: what
    each node's link sent from before the processes started to after they ended (start-up,
    training and evaluation: the whole run)."""
    procs, outs, logs = [], [], []
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = worker_env(args, port)
    link0 = [tb.tx_bytes(n) for n in range(tb.workers)]
    for r in range(args.workers):
        out = os.path.join(workdir, f"{name}.rank{r}.json")
        logp = os.path.join(workdir, f"{name}.rank{r}.log")
        outs.append(out)
        logs.append(logp)
        with open(logp, "w") as lf:
            procs.append(tb.popen(r, [sys.executable, WORKER, spec_path, out],
                                  env=env, cpu=cpu_for(args, r),
                                  stdout=lf, stderr=subprocess.STDOUT))
    codes = wait_all(procs, args.run_timeout)
    if any(c != 0 for c in codes):
        raise RunFailed(failure_report(name, codes, logs))
    link1 = [tb.tx_bytes(n) for n in range(tb.workers)]
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    results[0]["node_link_tx_bytes"] = [b - a for a, b in zip(link0, link1)]
    return results


def node_link_bytes(res: list[dict], g: int) -> dict:
    """Bytes through each node's link, from the ranks' outputs (ranks numbered node by node).

    ``window``: the node's veth tx counter over the training window, as the node's local rank 0
    read it (every rank of a node reads the same counter; the window is from the barrier after
    start-up to the end of training); ``whole_run``: the runner's reading from before the
    processes started to after they ended (start-up broadcast and evaluation included), if known."""
    nodes = len(res) // g
    window = [res[n * g].get("tx_bytes") for n in range(nodes)]
    return {"window": window, "whole_run": res[0].get("node_link_tx_bytes")}


def per_step(values: list[int | None] | None, steps: int) -> list[float | None] | None:
    if values is None:
        return None
    return [None if v is None or not steps else v / steps for v in values]


def compute_only(tb, args, workdir: str, tag: str, micro_batch: int) -> dict:
    """samples/s of the same workers doing fwd+bwd of ``micro_batch`` sequences with no
    communication (world size 1 each): {"tag", "micro_batch", "samples_per_s"}."""
    spec = {**base_spec(args, 0, micro_batch), "role": "compute",
            "compute_micro_batches": args.compute_micro_batches}
    res = launch(tb, args, spec, f"compute-{tag}-mb{micro_batch}", workdir, None)
    rate = sum(micro_batch / statistics.median(r["micro_batch_s"]) for r in res)
    log(f"compute-only ({tag}, micro-batch {micro_batch}): {rate:.2f} samples/s; micro-batch s per rank: "
        + ", ".join(f"{statistics.median(r['micro_batch_s']):.3f}" for r in res))
    return {"tag": tag, "micro_batch": micro_batch, "samples_per_s": rate}


def mode_steps(args, mode: str) -> int | None:
    """Optimizer steps of ``mode``'s matched-batch run: the budget's; a local-step mode's (inner
    steps) --local-samples-factor times that, rounded up to whole outer periods (the samples of
    a period left unfinished would never reach theta_sync, which is what is evaluated)."""
    mode_ = MODES[mode]
    if args.protocol != "matched" or not mode_.local_steps:
        return args.steps
    from engine import EngineConfig

    period = mode_.extra.get("inner_steps", EngineConfig().inner_steps)
    wanted = args.steps * getattr(args, "local_samples_factor", 1)
    return -(-wanted // period) * period


def eval_points(args, samples: int | None = None) -> list[int]:
    """Global samples at which the parameters are snapshotted; matched batch: whole steps, the
    same for every mode (a mode with a larger budget ``samples``: the same points, then on at
    the same spacing up to its end)."""
    n = args.eval_points
    if args.protocol == "matched":
        b, end = args.global_batch, samples or args.samples
        points, i = set(), 0
        while not points or max(points) < end:
            points.add(min(end, b * max(1, round(args.steps * (i + 1) / n))))
            i += 1
        return sorted(points)
    return sorted({max(1, round(args.samples * (i + 1) / n)) for i in range(n)})


def summarize_run(mode: str, lr: float, seed: int, res: list[dict], spec: dict | None = None) -> dict:
    r0 = res[0]
    hist = r0["history"]
    world = len(res)
    evals = []
    for i, row in enumerate(r0["evals"]):
        loss = res[i % world]["evals"][i].get("loss")
        evals.append({"samples": row["samples"], "time_s": row["time_s"], "step": row["step"], "loss": loss})
    samples = sum(h["samples"] for h in hist)
    train_s = max(r["train_s"] for r in res)
    # one rank per link: its link's tx_bytes against what it accounted; with several ranks per
    # node the link counts the node's ranks together and none of their intra-node traffic, so
    # the per-rank ratio means nothing (the node-link fields below hold the counts)
    ratios = [r["tx_bytes"] / r["accounted_bytes"] if r.get("tx_bytes") and r["accounted_bytes"]
              and (spec or {}).get("ranks_per_node", 1) == 1 else None for r in res]
    steps = len(hist)
    spec = spec or {}
    g = spec.get("ranks_per_node", 1) or 1
    links = node_link_bytes(res, g)
    per_class = {k: sum(h[k] for h in hist) / steps if hist and all(k in h for h in hist) else None
                 for k in ("wire_bytes_intra", "wire_bytes_inter")}
    return {
        "mode": mode, "lr": lr, "seed": seed, "steps": steps, "samples": samples, "train_s": train_s,
        "nodes": len(res) // g, "ranks_per_node": g, "topology": spec.get("topology"),
        # bytes through each node's one link per optimizer step (the node's veth tx counter):
        # over the training window, and over the whole run (start-up and evaluation included)
        "node_link_bytes_per_step": per_step(links["window"], steps),
        "node_link_bytes_per_step_whole_run": per_step(links["whole_run"], steps),
        # what the engine accounts per link class (rank 0, per step), where it reports them
        "wire_bytes_intra_per_step_engine": per_class["wire_bytes_intra"],
        "wire_bytes_inter_per_step_engine": per_class["wire_bytes_inter"],
        **{k: spec.get(k) for k in ("protocol", "global_batch", "micro_batch", "accumulation",
                                    "global_micro_batches", "lr_schedule")},
        "data": spec.get("data", "per-rank"), "optimizer": spec.get("optimizer", "adamw"),
        "samples_per_step_median": statistics.median(h["samples"] for h in hist) if hist else None,
        "samples_per_step_mean": samples / steps if steps else None,
        "startup_s": max(r["startup_s"] for r in res),
        "step_time_median_s": statistics.median(h["time_s"] for h in hist) if hist else None,
        "step_time_mean_s": train_s / steps if steps else None,
        "samples_per_s": samples / train_s if train_s else None,
        "global_micro_batches_median": statistics.median(h["global_micro_batches"] for h in hist) if hist else None,
        "global_micro_batches_mean": statistics.fmean(h["global_micro_batches"] for h in hist) if hist else None,
        # the bytes a mode accounted for over its steps (a local-step mode sends only every H
        # inner steps: its median step sends nothing)
        "wire_bytes_per_step_engine": sum(h["wire_bytes"] for h in hist) / steps if hist else None,
        "wire_bytes_per_step_tx": r0["tx_bytes"] / steps if r0.get("tx_bytes") is not None and steps else None,
        "accounted_bytes_per_rank": [r["accounted_bytes"] for r in res],
        "tx_bytes_per_rank": [r.get("tx_bytes") for r in res],
        "tx_over_engine_per_rank": ratios,
        "thread_cpu_s_per_rank": [r.get("thread_cpu_s") for r in res],
        "min_micro_batches_median": statistics.median(h.get("min_micro_batches", 0) for h in hist) if hist else None,
        "comm_cpu_s_per_round": statistics.median(r0["comm_cpu_s"][1:]) if len(r0.get("comm_cpu_s") or []) > 1 else None,
        "micro_batches_per_rank": [sum(h["micro_batches"] for h in r["history"]) for r in res],
        "strategy_facts": r0.get("strategy_facts") or {},
        "wire_bytes_per_step_after_freeze": after_freeze_bytes(hist, (r0.get("strategy_facts") or {}).get("frozen_step")),
        "evals": evals,
        "final_loss": evals[-1]["loss"] if evals else None,
        "history": [{k: h.get(k) for k in ("step", "loss", "lr", "samples", "global_micro_batches", "wire_bytes",
                                           "wire_bytes_intra", "wire_bytes_inter", "time_s")} for h in hist],
        "timeline": [t for r in res for t in shift_timeline(r, r0)],
        **phase_summary(res),
    }


def after_freeze_bytes(hist: list[dict], frozen_step: int | None) -> float | None:
    """1-bit Adam: the median bytes of a step after the freeze (the freeze step itself carries
    the one-time gathers)."""
    after = [h["wire_bytes"] for h in hist if frozen_step is not None and h["step"] > frozen_step]
    return statistics.median(after) if after else None


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



def train_run(tb, args, workdir: str, mode: str, lr: float, seed: int, port: int) -> dict:
    """One training run of ``mode`` on every worker; its summary (RunFailed if a worker failed)."""
    name = f"{mode}-lr{lr:g}-s{seed}".replace("+", "_")
    spec = train_spec(args, mode, lr, seed)
    t = time.monotonic()
    res = launch(tb, args, spec, name, workdir, port)
    run = summarize_run(mode, lr, seed, res, spec)
    log(f"{name}: {run['steps']} steps, {run['samples']} samples in {run['train_s']:.1f} s "
        f"({run['samples_per_s']:.2f}/s, start-up {run['startup_s']:.1f} s), held-out "
        f"{fmt(run['final_loss'], '.3f')}, tx/mode {run['tx_over_engine_per_rank']}, "
        f"run {time.monotonic() - t:.0f} s")
    return run


def run_all(args, workdir: str, runs: list[dict], compute_rates: list[dict]) -> list[str]:
    """Every run of the benchmark in one testbed (built here, torn down on the way out), seed by
    seed, each seed after a compute-only measurement at every micro-batch size in use. Appends to
    ``runs`` and ``compute_rates`` as they finish and rewrites the JSON after every run; returns
    the failed runs' reports."""
    from benchmarks.testbed import LinkSpec, Testbed

    failures: list[str] = []
    port = 29500
    with Testbed(workers=args.workers // ranks_per_node(args), ranks_per_node=ranks_per_node(args),
                 link=LinkSpec(args.rate, args.delay_ms), prefix=args.prefix) as tb:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for mb in micro_batches_in_use(args):
                compute_rates.append(compute_only(tb, args, workdir, f"s{seed}", mb))
            for lr, mode in runs_for_seed(args, seed, runs):
                port += 1
                try:
                    run = train_run(tb, args, workdir, mode, lr, seed, port)
                except RunFailed as e:
                    failures.append(str(e))
                    log(f"FAILED {e}")
                    continue
                runs.append(run)
                write_outputs(args, runs, compute_rates, final=False)
        if not args.no_compute_at_end:
            for mb in micro_batches_in_use(args):
                compute_rates.append(compute_only(tb, args, workdir, "end", mb))
    return failures


def heldout_set(path: str) -> tuple:
    """(held-out text, seq_len, sequences) a benchmark JSON scored its runs on: --eval-batches
    batches of its --micro-batch (older JSONs without ``eval_micro_batch`` scored each mode on
    its own micro-batch: their reference's, the command's --micro-batch, is what is compared)."""
    with open(path) as f:
        cfg = json.load(f).get("config", {})
    per_batch = cfg.get("eval_micro_batch") or cfg.get("micro_batch")
    return cfg.get("heldout"), cfg.get("seq_len"), cfg.get("eval_batches", 0) * (per_batch or 0)


def config_json(args) -> dict:
    """The parsed arguments as JSON (each mode's batch plan as a dict)."""
    out = {k: v for k, v in vars(args).items() if k != "batch_plans"}
    out["batch_plans"] = {m: dataclasses.asdict(p) for m, p in getattr(args, "batch_plans", {}).items()}
    # every mode's held-out batches are this size (JSONs without the key scored each mode on its own)
    out["eval_micro_batch"] = args.micro_batch
    return out


def write_outputs(args, runs, compute_rates, final: bool) -> list[dict]:
    rows = aggregate(args, runs, compute_rates)
    if args.json:
        legacy = [c["samples_per_s"] for c in compute_rates if isinstance(c, dict)
                  and c["micro_batch"] == args.micro_batch]  # the format's older field: DDP's micro-batch
        doc = {"command": " ".join(shlex.quote(a) for a in sys.argv), "complete": final,
               "config": config_json(args), "compute_only": compute_rates,
               "compute_only_samples_per_s": legacy, "load_average": os.getloadavg(), "modes": rows}
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, args.json)
    return rows


def load_runs(path: str) -> tuple[list[dict], list[dict]]:
    """The per-run summaries and compute-only rates of an earlier --json (no timelines); the
    rates of a JSON from before per-micro-batch measurements count at its --micro-batch."""
    with open(path) as f:
        doc = json.load(f)
    runs = [r for o in doc["modes"] for r in o["runs"]]
    for r in runs:
        r.setdefault("timeline", [])
        r.setdefault("history", [])
    if "compute_only" in doc:
        return runs, list(doc["compute_only"])
    mb = doc.get("config", {}).get("micro_batch")
    return runs, [{"tag": "merged", "micro_batch": mb, "samples_per_s": x} for x in doc["compute_only_samples_per_s"]]

