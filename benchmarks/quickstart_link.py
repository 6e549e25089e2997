"""The quick start as a user runs it, over a real shaped link: recipes/finetune.py with its
defaults on 2 workers, each in its own network namespace behind a tbf-shaped link (the testbed's
2x1 layout, one core each), against the same run with the collective chunking set by hand (the
setting the issue found the default leaving a third of the link idle) and with fp32 compute
instead of the default's choice (bf16 where the CPU has it). Reads each run's
metrics.jsonl: median s/step over steps 4.., samples/s, wire MB per step, held-out perplexity.

    sudo python benchmarks/quickstart_link.py --rate 100mbit --steps 20 --json docs/results/quickstart_100mbit.json
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

from benchmarks.shaping import LinkSpec  # noqa: E402
from benchmarks.netns import exit_unless_testbed  # noqa: E402
from benchmarks.testbed import Testbed  # noqa: E402
from engine.local_group import free_port  # noqa: E402


def run_recipe(rate: str, steps: int, extra: list[str], out: Path, prefix: str, timeout_s: float) -> dict:
    port = str(free_port())
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
    train = [r for r in rows if r["kind"] == "train"]
    later = [r for r in train if r["step"] >= 4]
    evals = {r["tag"]: r["eval_ppl"] for r in rows if r["kind"] == "eval"}
    return {"args": extra, "exit_codes": codes, "steps": len(train),
            "s_per_step_median": statistics.median(r["time_s"] for r in later),
            "samples_per_s": sum(r["samples"] for r in later) / sum(r["time_s"] for r in later),
            "samples_per_step": statistics.median(r["samples"] for r in later),
            "wire_mb_per_step_per_worker": statistics.median(statistics.mean(r["wire_bytes"]) for r in later) / 1e6,
            "ppl_before": evals.get("before"), "ppl_after": evals.get("after")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tuned-chunks", type=int, default=8, help="the hand-set --comm-chunks to compare with")
    p.add_argument("--timeout-s", type=float, default=1500.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    exit_unless_testbed()
    work = Path(tempfile.mkdtemp(prefix="acl-quickstart-"))
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
