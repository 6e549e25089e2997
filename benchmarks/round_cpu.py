"""What one round costs the comm side: CPU seconds, phase wall times and bytes, per mode.

    python benchmarks/round_cpu.py [--rounds 24] [--modes acco+loco4+int4params,acco,zero1]
                                   [--profile] [--json OUT.json] [--compare BEFORE.json]

Spawns a real 2-process gloo group on this machine (engine/parallel/local_group.py), builds the
benchmark's GPT-2 (benchmarks/worker.py build_model/build_data: 6 layers x 256, byte vocab, seq
128, 4.87M parameters), and trains each mode with fixed accumulation (one micro-batch per worker
and round), clipping 1.0 and ``record_timeline=True``. After a few warm-up steps it prints, per
mode and round (medians over the measured rounds, rank 0; rank 1 alike):

* ``comm CPU``: ``engine.comm_cpu_s``, the CPU seconds of every thread but the training loop
  (the engine's comm thread and gloo's threads), i.e. what the comm side takes from the compute
  side's cores on CPU; and the comm thread's own share (/proc per-thread counters);
* ``passes``: that CPU in units of one fp32 read+write pass over the flat buffer on this machine
  (a ``copy_`` of ``padded`` fp32 values, timed here): at loopback there is no link to wait for,
  so the CPU is the limit, and this says how many passes over the buffer a round costs;
* the wall time of each phase (``RoundResult.phases``: reduce_scatter, optimizer, all_gather)
  and of the whole round, and how much of the round the phases overlap (sum of phases / span);
* ``bytes``: what this worker sends per round (``comm.bytes_sent``), and the wire time those
  bytes take at ``--link-rate`` (the physical limit of a shaped link: bytes / rate).

``--profile`` runs cProfile on the comm thread of rank 0 with a thread-CPU clock
(``time.thread_time``), so its figures are CPU seconds of that thread per function (waits in
gloo cost nothing there), and prints the heaviest functions and the round's main stages.
``--compare`` prints the ratios of this run's figures to those of an earlier ``--json``.

Measured on the 2-core development machine (CPU, gloo over loopback, torch 2.13, one intra-op
thread per worker, comm_chunks 8 as in the benchmark), with

    python benchmarks/round_cpu.py --rounds 24        (BEFORE; AFTER with --rounds 48)

and ``--profile`` for where the comm thread's CPU goes. The machine is shared and its figures
drift by 15-20% from run to run, so AFTER was measured A/B: the tree of commit 6a4478e (the
engine before this work) and this one, run back to back twice, 48 rounds each.

BEFORE (commit 14efa18's engine, first measurement, 24 rounds), per round, medians:

    mode                          acco+loco4+int4params      acco     zero1
    comm-side CPU (ms)                            65.9       39.7      35.5
      comm thread / gloo+other threads       59.6 / 5.4  22.1 / 10.0  20.0 / 10.4
    reduce_scatter / optimizer / all_gather wall (ms)
                                      72.6 / 19.1 / 39.9  75.8 / 24.5 / 27.4  18.0 / 14.0 / 13.5
    round span (ms), phases summed / span     141.6, 1.00  134.1, 1.00  50.2, 1.00
    bytes sent per round (MB)                    2.570     19.352    19.352
    wire time at 100 Mbit/s (ms)                 205.6     1548.1    1548.1

    where the comm thread's CPU went (acco+loco4+int4params, --profile, ms per round; the
    profiler adds ~15%): encode 30.1 (error feedback: compensate 5.0, update 15.5; quantize +
    pack the rest), all_to_all 1.7, owner decode of the received rows 15.7, small all-reduce and
    norm 1.1, fp32 AdamW proposal 8.8, delta all-gather + install 18.6 (the all_gather itself
    1.3). About 40 full-buffer passes of separate torch ops, each allocating its result.

AFTER, A/B (before | after, two pairs of runs, 48 rounds each, ms per round, medians):

    mode                          acco+loco4+int4params      acco             zero1
    comm-side CPU         pair 1      91.2 | 26.6  3.42x   43.6 | 38.8  1.13x   47.9 | 42.8  1.12x
                          pair 2      76.0 | 21.6  3.52x   44.9 | 34.6  1.30x   43.3 | 35.6  1.22x
    comm thread CPU       pair 1      81.9 | 18.5  4.42x   25.6 | 20.2  1.27x   26.7 | 21.2  1.25x
                          pair 2      70.4 | 16.2  4.33x   26.0 | 17.9  1.45x   24.6 | 17.9  1.37x
    gloo + other threads  pair 2       5.4 |  3.8           10.8 |  9.2          11.9 | 11.0
    phase walls rs / opt / ag, pair 1
                      before   107.5 / 27.4 / 51.3   178.0 / 28.5 / 27.4   24.3 / 15.4 / 19.8
                      after     28.8 / 23.1 / 25.1   117.0 / 25.1 / 35.4   26.5 / 16.5 / 24.8
    round span, pair 1 (ms)    186.5 | 63.8          238.5 | 165.5         62.5 | 58.3
    phases summed / span        1.00 | 1.12-1.32      1.00 | 1.15-1.25      1.00 | 1.19-1.23
    bytes sent per round       2.570 MB (unchanged)  19.352 MB (unchanged)  19.352 MB

(The reduce-scatter's wall time waits on the peer, whose comm thread shares a core with its
training loop: it swings by 3x between runs; the CPU figures do not.) Against the limit: at
100 Mbit/s the 2.57 MB of acco+loco4+int4params take 205.6 ms of wire per round, and the comm
side's CPU is now 0.11-0.13 of that (0.32-0.40 before). At loopback the CPU is the limit: the
round costs ~16-20 fp32 passes over the 4.84M-value buffer (a copy pass is 1.0-1.4 ms here),
against 50-65 before. What is left on the comm thread (--profile, ms per round): the fused
encode 3.6 (one read of the gradient and of the int8 error state, one write of the error state
and the payload; compute-bound on two divisions per value, which bit-identity keeps), AdamW 3.5
+ torch.sqrt 1.4 (moments, square root, parameters: three passes over the shard, memory-bound;
the square root stays torch's, whose bits C's sqrtf does not reproduce), the parameter delta
1.0 + its decode into every replica 1.1, the owner's decode 0.8, the collectives' calls ~1.5,
the norm 0.3, Python ~2. With ``--comm-chunks 1`` (no pipelining) the comm side takes 18.5 ms:
each piece costs ~0.5 ms of CPU (its collective calls and gloo's wake-ups), the price of the
overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.worker import user_barrier  # noqa: E402

MODES = {
    "acco+loco4+int4params": dict(strategy="acco", codec="loco4", param_codec="int4"),
    "acco+loco4+int8params": dict(strategy="acco", codec="loco4", param_codec="int8"),  # the recipe's named default
    "zero1+int8params": dict(strategy="zero1", codec="none", param_codec="int8"),  # its zero1 --codec none
    "acco": dict(strategy="acco", codec="none", param_codec="float32"),
    "zero1": dict(strategy="zero1", codec="none", param_codec="float32"),
}
PHASES = ("reduce_scatter", "optimizer", "all_gather")
# the round's stages as the profile names them: (label, file suffix, function name)
STAGES = (
    ("run_round (all the comm thread does)", "strategies/sharded.py", "run_round"),
    ("gradient reduce (encode + all-to-all + decode)", "engine/parallel/collectives.py", "reduce"),
    ("  torch path: compensate + quantize + pack + update", "engine/parallel/collectives.py", "encode"),
    ("    error feedback: compensate", "acco_loco/feedback.py", "compensate"),
    ("    error feedback: update", "acco_loco/feedback.py", "update"),
    ("    pack_bits", "acco_loco/bitpack.py", "pack_bits"),
    ("  fused kernel: encode", "acco_loco/kernels.py", "encode"),
    ("  all_to_all (before: all_to_all_rows)", "engine/parallel/comm.py", "all_to_all_rows"),
    ("  all_to_all pieces started", "engine/parallel/comm.py", "all_to_all_start"),
    ("  torch path: decode (owner)", "acco_loco/codecs.py", "decode"),
    ("    unpack_bits", "acco_loco/bitpack.py", "unpack_bits"),
    ("  fused kernel: decode_sum (owner)", "acco_loco/kernels.py", "decode_sum"),
    ("small all-reduce + norm (agree)", "strategies/sharded.py", "agree"),
    ("optimizer, before: propose (fp32 AdamW)", "strategies/sharded.py", "propose"),
    ("optimizer + gather pieces started (step_and_gather)", "strategies/sharded.py", "step_and_gather"),
    ("  optimizer pieces (propose_slice)", "acco_loco/optim.py", "propose_slice"),
    ("    fused kernel: adamw (with torch.sqrt)", "acco_loco/kernels.py", "adamw"),
    ("  fused kernel: delta_encode", "acco_loco/kernels.py", "delta_encode"),
    ("parameter all-gather + install, before", "strategies/sharded.py", "gather_and_install"),
    ("gather finished + install (finish_and_install)", "strategies/sharded.py", "finish_and_install"),
    ("  fused kernel: decode_add", "acco_loco/kernels.py", "decode_add"),
    ("  all_gather (before)", "engine/parallel/comm.py", "all_gather"),
    ("nonfinite checks", "engine/runtime/host.py", "nonfinite_rows"),
)


def _spec(args) -> dict:
    return {"n_layer": 6, "n_embd": 256, "n_head": 8, "seq_len": 128, "micro_batch": args.micro_batch,
            "seed": 0, "heldout": "hamlet", "eval_batches": 1}


def pass_seconds(numel: int, repeat: int = 30) -> float:
    """Seconds of one fp32 read+write pass over ``numel`` values (a copy), best of ``repeat``."""
    import torch

    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return min(times)


def _thread_cpu() -> dict[str, float]:
    from benchmarks.worker import thread_cpu_seconds

    return thread_cpu_seconds()


def measure(rank: int, world: int, args_d: dict, mode_kwargs: dict, profile: bool) -> dict:
    """One rank's figures for one mode: warm up, then the measured rounds (spawned per rank)."""
    import pstats

    from engine.strategies import strategy_class

    args = argparse.Namespace(**args_d)
    per_step = strategy_class(mode_kwargs["strategy"]).plan.rounds_per_step
    warm_steps, steps = max(1, args.warmup // per_step), max(1, args.rounds // per_step)
    engine, it = _build_engine(args, rank, world, mode_kwargs, warm_steps + steps)
    prof = _profile_comm_thread(engine) if profile and rank == 0 else None
    engine.fit(it, steps=warm_steps)
    if prof is not None:
        prof.disable()
        prof = _profile_comm_thread(engine)  # count the measured rounds only
    user_barrier()  # the default group (the user's): each engine group belongs to one engine thread
    first_round, first_cpu = engine.round_index, len(engine.comm_cpu_s)
    bytes0, cpu0, t0 = engine.comm.bytes_sent, _thread_cpu(), time.perf_counter()
    engine.fit(it, steps=steps)
    wall = time.perf_counter() - t0
    cpu1, bytes1 = _thread_cpu(), engine.comm.bytes_sent
    rounds = engine.round_index - first_round
    engine.close()

    threads = {k: (cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) / rounds for k in cpu1}
    out = {
        "rounds": rounds, "wall_per_round_s": wall / rounds,
        "comm_cpu_s": engine.comm_cpu_s[first_cpu:],
        "comm_thread_cpu_s": threads.get("acco-loco-comm", 0.0),
        "other_thread_cpu_s": sum(v for k, v in threads.items() if k not in ("acco-loco-comm", "python")
                                  and not k.startswith("pt_")),
        **_timeline_summary(engine.timeline, first_round),
        "bytes_per_round": (bytes1 - bytes0) / rounds, "padded": engine.flat.padded,
        "numel": engine.flat.numel,
    }
    if prof is not None:
        out["profile"] = _profile_summary(pstats.Stats(prof), rounds)
    return out


def _build_engine(args, rank: int, world: int, mode_kwargs: dict, max_steps: int):
    """The benchmark's model and data under one mode, and this rank's micro-batch iterator."""
    from benchmarks.worker import build_data, build_model
    from engine import Engine, EngineConfig
    from lm.data import hf_lm_loss

    tok, stream, _ = build_data(_spec(args), rank, world)
    model = build_model(_spec(args), len(tok))
    cfg = EngineConfig(**mode_kwargs, accumulation="fixed", micro_batches=1, max_steps=max_steps,
                       optimizer="adamw", lr=5e-4, max_grad_norm=1.0, compute_dtype="float32", seed=0,
                       comm_chunks=args.comm_chunks, group_size=128, record_timeline=True)
    return Engine(model, cfg, loss_fn=hf_lm_loss), stream.iter_from(0)


def _profile_comm_thread(engine):
    """A cProfile (thread CPU clock) around every round the comm thread runs."""
    import cProfile

    prof = cProfile.Profile(timer=time.thread_time)
    real = getattr(engine.strategy.run_round, "__wrapped__", engine.strategy.run_round)

    def run_round(ctx, req):
        prof.enable()  # on the comm thread: cProfile follows the thread that enables it
        try:
            return real(ctx, req)
        finally:
            prof.disable()

    run_round.__wrapped__ = real
    engine.strategy.run_round = run_round
    return prof


def _timeline_summary(timeline: list, first_round: int) -> dict:
    """Median phase walls, round span, phases summed and compute per round, from round
    ``first_round`` on."""
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    spans: dict[int, list[float]] = {}
    compute: dict[int, float] = {}
    for phase, _, a, b, index in timeline:
        if index < first_round:
            continue
        if phase == "compute":
            compute[index] = compute.get(index, 0.0) + b - a
            continue
        phases.setdefault(phase, []).append(b - a)
        lo, hi = spans.get(index, [a, b])
        spans[index] = [min(lo, a), max(hi, b)]
    phase_sum = [sum(v) for v in zip(*(phases[p] for p in PHASES))]
    return {"phase_s": {p: statistics.median(v) for p, v in phases.items() if v},
            "round_s": statistics.median(hi - lo for lo, hi in spans.values()),
            "phase_sum_s": statistics.median(phase_sum),
            "compute_s": statistics.median(compute.values()) if compute else 0.0}


def _profile_summary(stats, rounds: int) -> dict:
    """Per round: the stages' cumulative CPU and the heaviest functions by own CPU."""
    stages = []
    for label, suffix, name in STAGES:
        cum = 0.0
        for (file, _, func), (_, _, _, ct, _) in stats.stats.items():
            if func == name and file.replace("\\", "/").endswith(suffix):
                cum += ct
        stages.append((label, cum / rounds))
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:40]
    heavy = [(f"{os.path.basename(file)}:{line}({func})", tt / rounds, nc / rounds)
             for (file, line, func), (_, nc, tt, _, _) in top]
    return {"stages": stages, "top": heavy}


def run_mode(args, name: str) -> dict:
    """Rank 0's profile (with --profile) beside the last rank's figures (never profiled)."""
    from benchmarks.runner import SAME_MALLOC
    from engine.parallel.local_group import spawn

    ranks = spawn(measure, args.workers, vars(args), MODES[name], args.profile, timeout=1800,
                  env=dict(SAME_MALLOC))
    out = ranks[-1]
    if "profile" in ranks[0]:
        out["profile"] = ranks[0]["profile"]
    return out


def ms(x: float) -> str:
    return f"{1000 * x:7.1f}"


def print_table(results: dict[str, dict], link_rate: float) -> None:
    names = list(results)
    r0 = results[names[0]]
    print(f"\n{r0['numel'] / 1e6:.2f}M parameters, {r0['padded']} padded; one fp32 copy pass over the "
          f"buffer = {ms(r0['pass_s']).strip()} ms; link rate for the wire limit {link_rate / 1e6:g} Mbit/s")
    w = 24
    print("per round (median, last rank)".ljust(34) + "".join(n.rjust(w) for n in names))
    rows = [
        ("comm-side CPU (ms)", lambda r: ms(statistics.median(r["comm_cpu_s"]))),
        ("  = fp32 buffer passes", lambda r: f"{statistics.median(r['comm_cpu_s']) / r['pass_s']:.1f}"),
        ("  comm thread CPU (ms)", lambda r: ms(r["comm_thread_cpu_s"])),
        ("  gloo/other threads CPU (ms)", lambda r: ms(r["other_thread_cpu_s"])),
        *[(f"{p} wall (ms)", (lambda p: lambda r: ms(r["phase_s"].get(p, 0.0)))(p)) for p in PHASES],
        ("round span wall (ms)", lambda r: ms(r["round_s"])),
        ("phases summed / span", lambda r: f"{r['phase_sum_s'] / r['round_s']:.2f}"),
        ("compute per round (ms)", lambda r: ms(r["compute_s"])),
        ("wall per round, loop (ms)", lambda r: ms(r["wall_per_round_s"])),
        ("bytes sent", lambda r: f"{r['bytes_per_round'] / 1e6:.3f} MB"),
        ("wire time at link rate (ms)", lambda r: ms(8 * r["bytes_per_round"] / link_rate)),
        ("comm CPU / wire time", lambda r: f"{statistics.median(r['comm_cpu_s']) / (8 * r['bytes_per_round'] / link_rate):.2f}"),
    ]
    for label, fn in rows:
        print(label.ljust(34) + "".join(fn(results[n]).strip().rjust(w) for n in names))


def print_compare(results: dict[str, dict], before: dict[str, dict]) -> None:
    print("\nratio before / after (higher = now cheaper or shorter)")
    keys = [("comm-side CPU", lambda r: statistics.median(r["comm_cpu_s"])),
            ("comm thread CPU", lambda r: r["comm_thread_cpu_s"]),
            *[(p, (lambda p: lambda r: r["phase_s"].get(p, 0.0))(p)) for p in PHASES],
            ("round span", lambda r: r["round_s"]), ("bytes", lambda r: r["bytes_per_round"])]
    names = [n for n in results if n in before]
    print("".ljust(34) + "".join(n.rjust(24) for n in names))
    for label, fn in keys:
        cells = []
        for n in names:
            a, b = fn(before[n]), fn(results[n])
            cells.append(f"{a / b:.2f}x" if b > 0 else "-")
        print(label.ljust(34) + "".join(c.rjust(24) for c in cells))


def print_profile(name: str, prof: dict) -> None:
    print(f"\ncomm thread CPU per round, {name} (cProfile, thread CPU clock, rank 0)")
    for label, s in prof["stages"]:
        if s > 0:
            print(f"  {label.ljust(56)}{ms(s)} ms")
    print("  heaviest functions (own CPU per round, calls per round):")
    for fn, tt, nc in prof["top"][:16]:
        print(f"    {fn[:70].ljust(72)}{ms(tt)} ms {nc:7.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=24, help="measured rounds per mode")
    ap.add_argument("--warmup", type=int, default=4, help="rounds before measuring")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--comm-chunks", type=int, default=8)
    ap.add_argument("--link-rate", type=float, default=100e6, help="bits/s for the wire limit")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare", default=None, help="an earlier --json: print before/after ratios")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    import torch

    torch.set_num_threads(1)
    results = {}
    for name in names:
        t = time.monotonic()
        results[name] = run_mode(args, name)
        print(f"[round_cpu] {name}: {results[name]['rounds']} rounds in {time.monotonic() - t:.0f} s",
              file=sys.stderr, flush=True)
    pass_s = pass_seconds(results[names[0]]["padded"])  # here, with the workers gone: an idle core
    for r in results.values():
        r["pass_s"] = pass_s
    print_table(results, args.link_rate)
    if args.compare:
        with open(args.compare) as f:
            print_compare(results, json.load(f))
    for name, r in results.items():
        if "profile" in r:
            print_profile(name, r["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
