"""Does ``python -m engine.plan --measure`` recommend, on the testbed, the mode the benchmark
measured fastest to torch DDP's held-out loss? (issue 25)

For each link rate: two workers, each in its own network namespace behind a tbf-shaped link (the
testbed's 2x1 layout, one core each), run the planner with ``--measure`` on the benchmark's
4.87M GPT-2 (its transformers config written to a folder), B = 16, micro-batch 8, fp32: it times
an all_to_all over the shaped link and a few micro-batches, and predicts every mode's step time
and time to AdamW's loss (step time x the measured samples to that loss, quality.samples_factor,
from the runs of the same length as the check's: ``--steps 96``).
Beside it, what the matched-batch benchmark JSONs of that rate measured: each mode's wall time
to DDP's final held-out loss over DDP's own, seed against seed (median over seeds). A seed that
never reached it counts twice: strictly (never, the benchmark's rule: the median is then "not
reached") and extrapolated (its run time x the samples it still needed, by how many of DDP's
samples its final loss was worth), since a mode that tracks AdamW's curve misses DDP's last point
in about half its seeds.

    sudo python benchmarks/plan_check.py --json docs/results/plan_check.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.netns import exit_unless_testbed  # noqa: E402
from benchmarks.plan_validate import RESULTS  # noqa: E402
from benchmarks.shaping import LinkSpec  # noqa: E402
from benchmarks.testbed import Testbed  # noqa: E402
from engine.parallel.local_group import free_port  # noqa: E402
from engine.planner.modes import Mode  # noqa: E402
from engine.planner.quality import bench_name, first_crossing, results_doc, run_factor  # noqa: E402

# the matched-batch (B = 16, 2x1) JSONs of each rate: first the runs made for this check on this
# machine (every mode the planner ranks, side by side), then the earlier ones, made on a CPU 1.67x
# slower per micro-batch (compute-only 31.7 against 52.7 samples/s for the two workers)
FILES = {"20mbit": ("bench_20mbit_b16_seeds3.json",),
         "100mbit": ("plancheck_100mbit_b16_2seeds.json", "bench_100mbit_b16_3seeds.json",
                     "bench_100mbit_b16_s0_local.json"),
         "1gbit": ("plancheck_1gbit_b16_2seeds.json", "bench_1gbit_b16_3seeds.json",
                   "bench_1gbit_b16_loss_3seeds.json")}


STEPS = 96  # the benchmark runs' length (1536 samples of 16): the planner is told it, as a user would be


def run_ratios(run: dict, ddp_run: dict) -> tuple[float, float] | None:
    """(strict, extrapolated) wall time to DDP's final loss over DDP's, one seed."""
    target = ddp_run["final_loss"]
    ddp_t = first_crossing(ddp_run["evals"], target, "time_s")
    if run.get("final_loss") is None or not ddp_t:
        return None
    t = first_crossing(run["evals"], target, "time_s")
    if t is not None:
        return t / ddp_t, t / ddp_t
    got = run_factor(run, ddp_run)  # budget / the DDP samples its final loss was worth
    if got is None:
        return math.inf, math.inf
    last = max((e for e in run["evals"] if e.get("loss") is not None), key=lambda e: e["samples"])
    ddp_own = first_crossing(ddp_run["evals"], target)
    needed = got[0] * ddp_own  # samples the mode needs, at its measured factor
    return math.inf, last["time_s"] * needed / last["samples"] / ddp_t


def measured(file: str) -> dict[str, dict]:
    """mode -> its time to DDP's loss over DDP's in one JSON (medians over the seeds DDP ran)."""
    rows = {o["mode"]: o for o in results_doc(RESULTS, file)["modes"]}
    ddp = rows["torch-ddp"]
    ddp_runs = {r["seed"]: r for r in ddp["runs"] if r["lr"] == ddp["lr"]}
    out = {}
    for name, o in rows.items():
        pairs = [run_ratios(r, ddp_runs[r["seed"]]) for r in o["runs"]
                 if r["lr"] == o["lr"] and r["seed"] in ddp_runs]
        pairs = [p for p in pairs if p is not None]
        if not pairs:
            continue
        strict = statistics.median(p[0] for p in pairs)
        out[name] = {"seeds": len(pairs), "reached": sum(math.isfinite(p[0]) for p in pairs),
                     "strict": strict if math.isfinite(strict) else None,
                     "extrapolated": statistics.median(p[1] for p in pairs)}
    return out


def write_model_config(folder: Path) -> None:
    """The benchmark's GPT-2 (lm.models.tiny_gpt2 at its defaults, 128-token samples) as a
    transformers config folder, the form --model takes."""
    from lm.models import tiny_gpt2

    tiny_gpt2(n_positions=129).config.save_pretrained(folder)


def probe(rate: str, model_dir: Path, out: Path, prefix: str, timeout_s: float) -> dict:
    port = str(free_port())
    argv = [sys.executable, "-m", "engine.plan", "--measure", "--model", str(model_dir), "--seq-len", "128",
            "--cpu-testbed", "--flat-only", "--global-batch", "16", "--micro-batch", "8",
            "--compute-dtype", "float32", "--steps", str(STEPS), "--results", str(RESULTS), "--json", str(out)]
    with Testbed(workers=2, link=LinkSpec(rate=rate), prefix=prefix) as bed:
        procs = []
        for rank in range(2):
            log = open(out.with_suffix(f".rank{rank}.log"), "w")
            procs.append(bed.popen(rank, argv, env={"MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                                                     "PYTHONPATH": str(REPO)},
                                   cpu=rank, stdout=log, stderr=log, cwd=str(REPO)))
        t0 = time.time()
        codes = [p.wait(timeout=max(1.0, timeout_s - (time.time() - t0))) for p in procs]
    if any(codes):
        raise SystemExit(f"the planner failed at {rate} (exit codes {codes}): see {out.parent}")
    return json.loads(out.read_text())


def compare(rate: str, plan: dict) -> dict:
    """The planner's soonest against the measured fastest, overall and within each file's modes."""
    predicted = {}
    for r in plan["rows"]:
        m = Mode(**r["settings"])
        if r["to_loss_vs_ddp"] is not None and not (m.is_ddp and m.ddp_dtype != "float32"):
            predicted[bench_name(m)] = r["to_loss_vs_ddp"]
    files = {}
    for f in FILES[rate]:
        if not (RESULTS / f).exists():
            continue
        meas = measured(f)
        common = [m for m in meas if m in predicted]
        strict = {m: meas[m]["strict"] for m in common if meas[m]["strict"] is not None}
        best = min(strict.values()) if strict else None
        files[f] = {"measured": meas,
                    "predicted": {m: predicted[m] for m in common},
                    "fastest_strict": min(strict, key=strict.get) if strict else None,
                    # the modes within 5% of the fastest: a tie inside the seeds' spread
                    "tied_strict": sorted((m for m in strict if strict[m] <= 1.05 * best), key=strict.get)
                    if strict else [],
                    "fastest_extrapolated": min(common, key=lambda m: meas[m]["extrapolated"]),
                    "planner_among_these": min(common, key=predicted.get)}
    return {"planner_soonest": bench_name(Mode(**next(r["settings"] for r in plan["rows"]
                                                      if r["mode"] == plan["soonest"]))),
            "planner_recommended_adamw_class": plan["recommended"], "why_soonest": plan["why_soonest"],
            "measured_rates": plan["measured"], "files": files}


def table(results: dict) -> str:
    lines = ["| link | JSON | measured fastest to DDP's loss (strict) | (extrapolated) | planner, among these modes "
             "| planner --measure overall |", "|---|---|---|---|---|---|"]
    for rate, res in results.items():
        for f, c in res["files"].items():
            m = c["measured"]

            def show(name):
                if name is None:
                    return "none but DDP"
                x = m[name]
                return (f"{name} ({x['strict'] if x['strict'] is not None else x['extrapolated']:.2f}x DDP, "
                        f"{x['reached']}/{x['seeds']} seeds)")
            planner = c["planner_among_these"]
            fastest = " = ".join(show(x) for x in c["tied_strict"]) or show(None)
            lines.append(f"| {rate} | {f} | {fastest} | {show(c['fastest_extrapolated'])} | "
                         f"{planner} ({c['predicted'][planner]:.2f}x) | {res['planner_soonest']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="20mbit,100mbit,1gbit")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    exit_unless_testbed()
    work = Path(tempfile.mkdtemp(prefix="acl-plancheck-"))
    write_model_config(work / "gpt2")
    results = {}
    for rate in args.rates.split(","):
        plan = probe(rate, work / "gpt2", work / f"plan_{rate}.json", f"pc{os.getpid() % 1000}", args.timeout_s)
        results[rate] = compare(rate, plan)
        print(rate, "planner:", results[rate]["planner_soonest"], "|", results[rate]["measured_rates"], flush=True)
    print(table(results))
    if args.json:
        out = {"layout": "2x1: one namespace and one tbf-shaped link per worker, one core each",
               "command": "sudo python benchmarks/plan_check.py " + " ".join(sys.argv[1:]), "results": results}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
