"""The full SmolLM2-135M (every block trained) fine-tuned by recipes/finetune.py at 2 nodes x 2
ranks on the testbed (one network namespace per node, its one veth shaped to --rate both ways),
with --model-sharding node against the same run unsharded (the two-level exchange): the same
strategy, codecs, data, samples and schedule. Reads each run's metrics.jsonl (train and held-out
loss at equal samples, the engine's bytes across nodes per rank), memory.json (what each rank
holds after training: engine/runtime/memory_accounting.py's categories, resident and peak memory) and
each node's veth counters over the training window (polled), beside the planner's formula
(engine/planner/memory.py) for the same shape and layout.

    sudo python benchmarks/shard_link.py --rate 1gbit --steps 12 --json docs/results/shard_smollm2-135m_2x2_1gbit.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.netns import exit_unless_testbed  # noqa: E402
from benchmarks.shaping import LinkSpec  # noqa: E402
from benchmarks.testbed import Testbed  # noqa: E402
from engine.parallel.local_group import free_port  # noqa: E402

NODES, RANKS_PER_NODE = 2, 2
SMOLLM2_LAYERS = 30


class LinkPoller:
    """(time, tx bytes of each node's veth) every ``every_s`` seconds, in a thread."""

    def __init__(self, bed: Testbed, every_s: float = 0.5):
        self.bed, self.every_s, self.samples = bed, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), [self.bed.tx_bytes(n) for n in range(NODES)]))
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> list[float]:
        """Each node's tx bytes at time ``t``, interpolated between the two samples around it."""
        before = max((s for s in self.samples if s[0] <= t), key=lambda s: s[0])
        after = min((s for s in self.samples if s[0] >= t), key=lambda s: s[0])
        if after[0] == before[0]:
            return [float(x) for x in before[1]]
        w = (t - before[0]) / (after[0] - before[0])
        return [a + w * (b - a) for a, b in zip(before[1], after[1])]


def run_recipe(rate: str, steps: int, extra: list[str], out: Path, prefix: str, timeout_s: float) -> dict:
    port = str(free_port())
    with Testbed(workers=NODES, ranks_per_node=RANKS_PER_NODE, link=LinkSpec(rate=rate), prefix=prefix) as bed:
        procs = []
        with LinkPoller(bed) as poll:
            for rank in range(NODES * RANKS_PER_NODE):
                argv = [sys.executable, str(REPO / "recipes" / "finetune.py"), "--max-steps", str(steps),
                        "--output-dir", str(out), *extra]
                log = open(out.parent / f"{out.name}.rank{rank}.log", "w")
                procs.append(bed.popen(rank, argv, env={"MASTER_PORT": port, "PYTHONUNBUFFERED": "1",
                                                         "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
                                       stdout=log, stderr=log))
            t0 = time.time()
            codes = [p.wait(timeout=max(1.0, timeout_s - (time.time() - t0))) for p in procs]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    # the training window: from step 2's commit (step 1 carries the start-up) to the last one's
    first, last = train[1], train[-1]
    a, b = poll.at(first["wall"]), poll.at(last["wall"])
    n = last["step"] - first["step"]
    memory = json.loads((out / "memory.json").read_text())
    return {"args": extra, "exit_codes": codes, "steps": len(train),
            "train_loss": [r["loss"] for r in train], "samples_total": [r["samples_total"] for r in train],
            "eval": [{k: r[k] for k in ("tag", "step", "samples_total", "eval_loss")} for r in rows if r["kind"] == "eval"],
            "node_link_bytes_per_step": [(y - x) / n for x, y in zip(a, b)],
            "node_link_bytes_whole_run": [s - f for s, f in zip(poll.samples[-1][1], poll.samples[0][1])],
            "engine_inter_bytes_per_step_per_rank": [sum(r["wire_bytes_inter"][k] for r in train[2:]) / n
                                                     for k in range(NODES * RANKS_PER_NODE)],
            "s_per_step_under_load": (last["elapsed_s"] - first["elapsed_s"]) / n,
            "memory_per_rank": memory["ranks"]}


def planner_rows(args, work: Path, global_batch: int) -> dict:
    """engine/planner/memory.py's state per rank (and the node link's bytes per step) for this
    shape and layout: ``python -m engine.plan`` on the converted SmolLM2 folder, the trained
    fraction counted on the model as the recipe freezes it."""
    import subprocess

    import torch

    from lm.models import freeze_all_but_top, load_causal_lm

    model, _ = load_causal_lm(None, torch.float32, cache_dir=Path.home() / ".cache" / "acco_loco" / "models")
    trained = freeze_all_but_top(model, args.train_layers)
    total = sum(p.numel() for p in model.parameters())
    folder = work / "config"
    model.config.save_pretrained(folder)  # the planner reads the shape from it
    cmd = [sys.executable, "-m", "engine.plan", "--model", str(folder), "--trainable-fraction", f"{trained / total:.6f}",
           "--seq-len", str(args.seq_len), "--nodes", str(NODES), "--gpus-per-node", str(RANKS_PER_NODE),
           "--inter-gbit", str(LinkSpec(rate=args.rate).rate_bps / 1e9), "--global-batch",
           str(global_batch), "--micro-batch", str(args.micro_batch_size),
           "--compute-dtype", "float32", "--activation-checkpointing", "off", "--json", str(work / "plan.json")]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads((work / "plan.json").read_text())["rows"]
    keep = {"unsharded": "acco+loco4+int4params [2-level]", "sharded": "acco+loco4+int4params [2-level, node-sharded]"}
    by_mode = {r["mode"]: r for r in rows}
    return {"command": " ".join(["python", *cmd[1:-2]]), "params": total, "trained": trained,
            **{name: {k: by_mode[mode][k] for k in ("mode", "memory_bytes", "memory", "node_link_bytes")}
               for name, mode in keep.items()}}


def render(result: dict) -> str:
    """The markdown table of docs/nodes.md from a result JSON (``--render``)."""
    runs, formula = result["runs"], result.get("formula", {})
    mb = 1e6
    lines = ["| | unsharded (two-level) | node-sharded |", "|---|---|---|"]

    def row(label: str, fn) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(runs[n], n) for n in ("unsharded", "sharded")) + " |")

    def last_eval(r):
        return r["eval"][-1]

    row("held-out loss before / after (samples)", lambda r, n: f"{r['eval'][0]['eval_loss']:.4f} / "
        f"{last_eval(r)['eval_loss']:.4f} ({last_eval(r)['samples_total']})")
    base = last_eval(runs["unsharded"])["eval_loss"]
    row("held-out loss vs unsharded", lambda r, n: f"{100 * (last_eval(r)['eval_loss'] / base - 1):+.3f}%")
    row("train loss, last step", lambda r, n: f"{r['train_loss'][-1]:.4f}")
    row("node 0 / node 1 link, MB/step (veth, training window)",
        lambda r, n: " / ".join(f"{b / mb:.2f}" for b in r["node_link_bytes_per_step"]))
    row("engine's bytes across nodes, MB/step per rank",
        lambda r, n: f"{max(r['engine_inter_bytes_per_step_per_rank']) / mb:.2f}")
    row("held per rank, MB (memory_accounting; max over ranks)",
        lambda r, n: f"{max(sum(m['held_bytes'].values()) for m in r['memory_per_rank']) / mb:.0f}")
    if formula:
        row("formula per rank, MB (engine/planner/memory.py)", lambda r, n: f"{formula[n]['memory_bytes'] / mb:.0f}")
    row("resident after training / peak, MB per rank (max)",
        lambda r, n: f"{max(m['rss_bytes'] for m in r['memory_per_rank']) / mb:.0f} / "
                     f"{max(m['peak_rss_bytes'] for m in r['memory_per_rank']) / mb:.0f}")
    row("s/step (under load, not a performance figure)", lambda r, n: f"{r['s_per_step_under_load']:.1f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=1500.0)
    p.add_argument("--model", default="default", help="the recipe's --model (tiny-gpt2: a quick check of this script)")
    p.add_argument("--train-layers", type=int, default=SMOLLM2_LAYERS, help="30 = every SmolLM2-135M block")
    p.add_argument("--only", choices=("unsharded", "sharded"), default=None, help="run one of the two")
    p.add_argument("--json", type=Path)
    p.add_argument("--render", type=Path, metavar="JSON", help="print the docs table of a result JSON and stop")
    args = p.parse_args()
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return
    exit_unless_testbed()
    work = Path(tempfile.mkdtemp(prefix="acl-shard-link-"))
    common = ["--model", args.model, "--train-layers", str(args.train_layers), "--strategy", "acco", "--codec", "loco4",
              "--param-codec", "int4", "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size),
              "--eval-batches", "8", "--checkpoint-every", "0", "--timeout-s", "300"]
    variants = {"unsharded": common, "sharded": common + ["--model-sharding", "node"]}
    runs = {}
    if args.json and args.json.is_file():
        runs = json.loads(args.json.read_text()).get("runs", {})
    for name, extra in variants.items():
        if args.only and name != args.only:
            continue
        runs[name] = run_recipe(args.rate, args.steps, extra, work / name, f"sl{os.getpid() % 1000}", args.timeout_s)
        print(name, json.dumps(runs[name]), flush=True)
    result = {"model": f"{args.model} (default: SmolLM2-135M-Instruct), top {args.train_layers} blocks trained",
              "layout": f"{NODES} nodes x {RANKS_PER_NODE} ranks: one namespace and one tbf-shaped {args.rate} veth "
                        "per node, the node's ranks on its loopback; 2 CPU cores shared by all four ranks",
              "rate": args.rate, "steps": args.steps, "runs": runs}
    if args.model == "default":
        result["formula"] = planner_rows(args, work, next(iter(runs.values()))["samples_total"][0])
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if len(runs) == 2:
        print(render(result))


if __name__ == "__main__":
    main()
