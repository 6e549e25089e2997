"""The quick start as a user runs it, over a real shaped link: recipes/finetune.py with its
defaults on 2 workers, each in its own network namespace behind a tbf-shaped link (the testbed's
2x1 layout, one core each), against the same run with the collective chunking set by hand (the
setting the issue found the default leaving a third of the link idle) and with fp32 compute
instead of the default's choice (bf16 where the CPU has it). Reads each run's
metrics.jsonl: median s/step over steps 4.., samples/s, wire MB per step, held-out perplexity.

    sudo python benchmarks/quickstart_link.py --rate 100mbit --steps 20 --json docs/results/quickstart_100mbit.json

``--against-zero1 RATE[,RATE...]`` instead runs, at each rate, the recipe's defaults (no flags:
strategy auto, which probes the link) and plain zero1 (``--strategy zero1 --codec none
--param-codec auto``: the compute dtype) side by side, and
reports the ratios of their step and per-sample times, auto's logged choice and the machine's
load average before each run (``--extra`` adds the same flags to both):

    sudo python benchmarks/quickstart_link.py --against-zero1 10gbit,100mbit --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.netns import exit_unless_testbed  # noqa: E402
from benchmarks.shaping import LinkSpec  # noqa: E402
from benchmarks.testbed import Testbed  # noqa: E402
from engine.parallel.local_group import free_port  # noqa: E402


def run_recipe(rate: str, steps: int, extra: list[str], out: Path, prefix: str, timeout_s: float) -> dict:
    port, load = str(free_port()), os.getloadavg()
    with Testbed(workers=2, link=LinkSpec(rate=rate), prefix=prefix) as bed:
        procs = []
        for rank in range(2):
            argv = [sys.executable, str(REPO / "recipes" / "finetune.py"), "--max-steps", str(steps),
                    "--output-dir", str(out), *extra]
            log = open(out.parent / f"{out.name}.rank{rank}.log", "w")
            procs.append(bed.popen(rank, argv, env={"MASTER_PORT": port, "PYTHONUNBUFFERED": "1",
                                                     "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
                                   cpu=rank, stdout=log, stderr=log))
        t0 = time.time()
        codes = [p.wait(timeout=max(1.0, timeout_s - (time.time() - t0))) for p in procs]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rank0 = (out.parent / f"{out.name}.rank0.log").read_text()
    chosen = [x for x in rank0.splitlines() if "no --strategy given" in x or "(--strategy)" in x]
    train = [r for r in rows if r["kind"] == "train"]
    later = [r for r in train if r["step"] >= 4]
    evals = {r["tag"]: r["eval_ppl"] for r in rows if r["kind"] == "eval"}
    return {"args": extra, "exit_codes": codes, "steps": len(train),
            "s_per_step_median": statistics.median(r["time_s"] for r in later),
            "samples_per_s": sum(r["samples"] for r in later) / sum(r["time_s"] for r in later),
            "samples_per_step": statistics.median(r["samples"] for r in later),
            "s_per_sample": sum(r["time_s"] for r in later) / sum(r["samples"] for r in later),
            "wire_mb_per_step_per_worker": statistics.median(statistics.mean(r["wire_bytes"]) for r in later) / 1e6,
            "ppl_before": evals.get("before"), "ppl_after": evals.get("after"),
            "strategy_line": chosen[0] if chosen else None, "loadavg_before": load,
            "loadavg_after": os.getloadavg()}


def against_zero1(rates: list[str], steps: int, extra: list[str], work: Path, timeout_s: float,
                  named: list[str]) -> dict:
    """At each rate: the recipe's defaults and zero1 without a gradient codec, back to back (then
    each strategy of ``named`` with the recipe's codec defaults)."""
    out = {}
    for rate in rates:
        pair = {}
        # plain zero1: under a named strategy the recipe's codec defaults (loco4 + int8) apply unless set
        runs = [("defaults", []), ("zero1", ["--strategy", "zero1", "--codec", "none", "--param-codec", "auto"])]
        for name, flags in runs + [(f"named_{s}", ["--strategy", s]) for s in named]:
            pair[name] = run_recipe(rate, steps, [*flags, *extra], work / f"{rate}_{name}",
                                    f"qs{os.getpid() % 1000}", timeout_s)
            print(rate, name, json.dumps(pair[name]), flush=True)
        d, z = pair["defaults"], pair["zero1"]
        out[rate] = {**pair, **{f"{k}_over_zero1_s_per_step": v["s_per_step_median"] / z["s_per_step_median"]
                                for k, v in pair.items() if k != "zero1"},
                     "defaults_over_zero1_s_per_sample": d["s_per_sample"] / z["s_per_sample"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tuned-chunks", type=int, default=8, help="the hand-set --comm-chunks to compare with")
    p.add_argument("--timeout-s", type=float, default=1500.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--against-zero1", help="rates, comma-separated: the defaults against zero1 at each")
    p.add_argument("--named", default="", help="--against-zero1: also these strategies with the recipe's "
                   "codec defaults (comma-separated, e.g. acco: the default before it followed the link)")
    p.add_argument("--extra", default="", help="flags added to both runs of --against-zero1 (one string)")
    args = p.parse_args()
    exit_unless_testbed()
    work = Path(tempfile.mkdtemp(prefix="acl-quickstart-"))
    if args.against_zero1:
        extra = args.extra.split()
        result = {"layout": "2x1: two torchrun nodes of one rank, each in its own namespace behind a tbf-shaped "
                            "link, one core each", "steps": args.steps, "extra_flags": extra,
                  "cpus": os.cpu_count(),
                  "loadavg_at_start": os.getloadavg(),
                  "rates": against_zero1(args.against_zero1.split(","), args.steps, extra, work, args.timeout_s,
                                         [x for x in args.named.split(",") if x])}
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return
    runs = {}
    for name, extra in (("defaults", []), ("tuned", ["--comm-chunks", str(args.tuned_chunks)]),
                        ("defaults_fp32", ["--compute-dtype", "float32"])):
        runs[name] = run_recipe(args.rate, args.steps, extra, work / name, f"qs{os.getpid() % 1000}", args.timeout_s)
        print(name, json.dumps(runs[name]), flush=True)
    result = {"layout": f"2x1: one namespace and one tbf-shaped {args.rate} link per worker, one core each",
              "rate": args.rate, "steps": args.steps, "runs": runs,
              "defaults_over_tuned_s_per_step": runs["defaults"]["s_per_step_median"] / runs["tuned"]["s_per_step_median"]}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
