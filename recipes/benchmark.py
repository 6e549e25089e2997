"""Side-by-side benchmark over real shaped links: torch DDP peers against this engine's modes.

Run as root (it builds a network-namespace testbed, see ``benchmarks/testbed.py``)::

    python recipes/benchmark.py --workers 2 --rate 100mbit --seeds 1 --samples 1536 \\
        --json bench.json --plot bench_loss.png --timeline bench_timeline.png
    python recipes/benchmark.py --hetero --rate 100mbit        # 3 workers, one at full speed

What it does (docs/DESIGN.md section 4):

* builds a testbed of ``--workers`` namespaces, each behind a ``tbf`` link of ``--rate`` both
  ways (``--delay-ms`` needs the netem qdisc and is refused clearly where the kernel lacks it),
  and tears it down on exit, on an error and on Ctrl-C (the Testbed context manager);
* runs every mode of ``--modes`` as one process per namespace (``benchmarks/worker.py``),
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

This file is the command line; the work is in ``benchmarks/``: ``modes.py`` (the mode table),
``runner.py`` (testbed, workers, per-run records, the JSON), ``worker.py`` (one worker process),
``report.py`` (statistics, the table and verdict) and ``plots.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import plots, report, runner  # noqa: E402  (plots imports matplotlib when it draws)
from benchmarks.modes import BENCHMARK_MODES, HETERO_MODES, REFERENCE  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--modes", default=None, help=f"comma list from: {', '.join(BENCHMARK_MODES)} (default all; "
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
    add_workload_args(ap)
    return ap


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload (the same for every mode), the measurement and where things go."""
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


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.hetero:
        if a.workers not in (2, 3):
            ap.error("--hetero runs 3 workers; leave --workers out")
        a.workers = 3
    if a.workers < 2:
        ap.error("--workers must be at least 2")
    a.modes = [m.strip() for m in (a.modes or ",".join(HETERO_MODES if a.hetero else BENCHMARK_MODES)).split(",")
               if m.strip()]
    unknown = [m for m in a.modes if m not in BENCHMARK_MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}: choose from {', '.join(BENCHMARK_MODES)}")
    if a.first_seed < 0:
        ap.error("--first-seed must be >= 0")
    if a.seeds < 1:
        ap.error("--seeds must be >= 1")
    if a.samples is None:
        a.samples = a.steps * a.workers * a.micro_batch if a.steps else 1536
    if a.samples < a.workers * a.micro_batch:
        ap.error(f"--samples must be at least one micro-batch per worker ({a.workers * a.micro_batch})")
    check_lr_args(ap, a)
    return a


def check_lr_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--lr-sweep, --sweep-seeds and --lr-from; sets a.lrs (the lrs to try) and a.mode_lr (--lr-from's)."""
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


def render(args) -> int:
    """--render: the table and verdict of an earlier --json (and its --plot)."""
    try:
        with open(args.render) as f:
            doc = json.load(f)
        rows, cfg = doc["modes"], doc["config"]
        report.add_derived(rows, cfg["workers"], cfg["rate"], cfg["micro_batch"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: --render {args.render}: not a benchmark JSON ({e})", file=sys.stderr)
        return 2
    print(report.render_header(doc, rows))
    print(report.tables(rows))
    if args.plot and rows:
        plots.plot_loss(rows, args.plot)
    return 0


def testbed_problem(args) -> str | None:
    """Why no testbed can be built here (not root, no iproute2, no netem for --delay-ms), or None."""
    from benchmarks.testbed import requires_root_reason

    reason = requires_root_reason(delay=args.delay_ms > 0)
    if reason and args.delay_ms > 0 and os.geteuid() == 0:
        return (f"--delay-ms {args.delay_ms:g} needs the netem qdisc, and {reason}; "
                "run without --delay-ms (rate-only links) or on a kernel with CONFIG_NET_SCH_NETEM")
    return reason


def merged_runs(args) -> tuple[list[dict], list[float]] | None:
    """The runs and compute-only rates of every --merge JSON (None, after saying why, if one is not)."""
    runs: list[dict] = []
    compute_rates: list[float] = []
    for path in args.merge:
        try:
            runs_in, rates_in = runner.load_runs(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: --merge {path}: not a benchmark JSON ({e})", file=sys.stderr)
            return None
        runs += runs_in
        compute_rates += rates_in
        runner.log(f"merged {len(runs_in)} runs from {path}")
    return runs, compute_rates


def finish(args, rows: list[dict], runs: list[dict], failures: list[str], workdir: str) -> int:
    """The plots, the warnings and the exit status once the table is printed."""
    if args.plot and rows:
        plots.plot_loss(rows, args.plot)
    if args.timeline and runs:
        plots.plot_timeline(runs, args.modes, args.timeline)
    bad_ratio = [o["mode"] for o in rows
                 if o["tx_over_engine_max_dev"] is not None and o["tx_over_engine_max_dev"] > 0.10]
    if bad_ratio:
        print(f"\nwarning: interface tx_bytes and accounted wire bytes differ by more than 10% for {bad_ratio}",
              file=sys.stderr)
    if failures:
        print(f"\n{len(failures)} run(s) failed; logs in {workdir}", file=sys.stderr)
        return 1
    if not args.keep_workdir and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args)
    problem = testbed_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="acl-bench-")
    os.makedirs(workdir, exist_ok=True)
    load0 = os.getloadavg()
    runner.log(f"workdir {workdir}; load average {load0[0]:.1f} on {os.cpu_count()} cores; modes {args.modes}; "
               f"{args.samples} samples; lrs {args.lrs}; seeds {args.seeds}")
    merged = merged_runs(args)
    if merged is None:
        return 2
    runs, compute_rates = merged
    t_start = time.monotonic()
    from benchmarks.testbed import TestbedError

    try:
        failures = runner.run_all(args, workdir, runs, compute_rates)
    except TestbedError as e:
        print(f"error: testbed: {e}", file=sys.stderr)
        return 2
    finally:
        if runs:
            runner.write_outputs(args, runs, compute_rates, final=False)
    rows = runner.write_outputs(args, runs, compute_rates, final=True)
    print(report.run_header(args, rows, compute_rates, load0, os.getloadavg(), time.monotonic() - t_start))
    print(report.tables(rows))
    return finish(args, rows, runs, failures, workdir)


if __name__ == "__main__":
    sys.exit(main())
