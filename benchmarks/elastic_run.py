"""An elastic run under torchrun on this machine: three one-worker "nodes" (three torchrun agents
sharing a c10d rendezvous), one of them killed mid-run; the survivors restart, resume from the last
checkpoint at world 2 and finish. Beside it, uninterrupted runs at two seeds give the seed-to-seed
spread the interrupted run's held-out loss is judged against (equal samples: the global batch is
fixed, so every run trains the same number of sequences).

    python benchmarks/elastic_run.py --json docs/results/elastic_3to2.json

Each agent: torchrun --nnodes=2:3 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d
recipes/finetune.py (tiny GPT-2, Shakespeare, acco + loco4 + int8 parameters, global batch 6
micro-batches of 4 x 64 tokens). The kill: SIGKILL to the third agent's process group (the agent and
its worker, as a lost machine). What is measured: when the survivors' workers name the lost peer and
exit, when their second attempt resumes (the recipe's "resumed at step" line), the first step after
it, the work lost (the recipe's "work lost" line) and the held-out loss after the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil  # installed with accelerate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.parallel.local_group import free_port  # noqa: E402

RECIPE = REPO / "recipes" / "finetune.py"
NODES = 3


def recipe_args(args, out: Path, seed: int) -> list[str]:
    return ["--model", "tiny-gpt2", "--seq-len", "64", "--micro-batch-size", "4", "--train-layers", "4",
            "--global-micro-batches", "6", "--max-steps", str(args.steps), "--checkpoint-every",
            str(args.checkpoint_every), "--eval-batches", "12", "--timeout-s", str(args.timeout_s),
            "--seed", str(seed), "--output-dir", str(out)]


def start_agents(args, out: Path, seed: int, logs: Path) -> list[subprocess.Popen]:
    port, run_id = free_port(), f"{out.name}-{os.getpid()}"
    # the workers get a store of their own at each attempt (pytorch/pytorch#135712; the engine warns)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agents = []
    for node in range(NODES):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=2:{NODES}", "--nproc-per-node=1",
               "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id={run_id}", "--rdzv-conf=last_call_timeout=2,join_timeout=120",
               "--monitor-interval=0.5", str(RECIPE), *recipe_args(args, out, seed)]
        log = open(logs / f"{out.name}-agent{node}.log", "w")
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        if node == 0:
            time.sleep(2.0)  # the first agent hosts the rendezvous store
    return agents


def rows(out: Path) -> list[dict]:
    f = out / "metrics.jsonl"
    if not f.is_file():
        return []
    got = []
    for line in f.read_text().splitlines():
        try:
            got.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return got


def heldout(out: Path) -> float:
    after = [r for r in rows(out) if r.get("kind") == "eval" and r.get("tag") == "after"]
    return after[-1]["eval_loss"]


def wait(agents, limit_s: float) -> list[int]:
    end = time.time() + limit_s
    for a in agents:
        a.wait(timeout=max(1.0, end - time.time()))
    return [a.returncode for a in agents]


def run_plain(args, seed: int, logs: Path) -> dict:
    out = args.work / f"plain-s{seed}"
    t0 = time.time()
    codes = wait(start_agents(args, out, seed, logs), args.limit_s)
    return {"seed": seed, "exit_codes": codes, "wall_s": time.time() - t0, "heldout_loss": heldout(out),
            "steps": max(r["step"] for r in rows(out) if r.get("kind") == "train")}


def run_killed(args, seed: int, logs: Path) -> dict:
    out = args.work / f"killed-s{seed}"
    t0 = time.time()
    agents = start_agents(args, out, seed, logs)
    while True:  # kill the third node once the run is past --kill-at-step
        train = [r for r in rows(out) if r.get("kind") == "train"]
        if train and train[-1]["step"] >= args.kill_at_step:
            break
        if any(a.poll() is not None for a in agents) or time.time() - t0 > args.limit_s:
            raise SystemExit(f"the run ended or stalled before step {args.kill_at_step}: see {logs}")
        time.sleep(0.2)
    step_at_kill = train[-1]["step"]
    node = psutil.Process(agents[2].pid)
    for proc in [node, *node.children(recursive=True)]:  # the agent and its worker (its own session)
        proc.send_signal(signal.SIGKILL)
    t_kill = time.time()
    codes = wait(agents[:2], args.limit_s)
    text = "\n".join((logs / f"{out.name}-agent{n}.log").read_text() for n in range(2))
    resumed = re.findall(r"resumed at step (\d+) from \S+ at (\d+) worker", text)
    lost = re.findall(r"work lost: .*", text)
    after = [r for r in rows(out) if r.get("kind") == "train" and r["step"] > int(resumed[0][0])] if resumed else []
    first_after = min((r["wall"] for r in after), default=None)
    return {"seed": seed, "exit_codes": codes, "wall_s": time.time() - t0, "step_at_kill": step_at_kill,
            "resumed_at": [(int(s), int(w)) for s, w in resumed], "work_lost": lost,
            "kill_to_first_step_s": None if first_after is None else first_after - t_kill,
            "lost_peer_named": "lost" in text.lower(),
            "heldout_loss": heldout(out), "steps": max(r["step"] for r in rows(out) if r.get("kind") == "train")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--kill-at-step", type=int, default=90)
    p.add_argument("--timeout-s", type=float, default=20.0)
    p.add_argument("--limit-s", type=float, default=900.0)
    p.add_argument("--work", type=Path, default=Path("/tmp/acco_loco_elastic"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    for old in args.work.glob("*-s*"):
        subprocess.run(["rm", "-rf", str(old)], check=True)
    killed = run_killed(args, 0, logs)
    plain = [run_plain(args, s, logs) for s in (0, 1)]
    spread = abs(plain[0]["heldout_loss"] - plain[1]["heldout_loss"])
    gap = abs(killed["heldout_loss"] - plain[0]["heldout_loss"])
    result = {"layout": "3 torchrun agents of 1 CPU worker each on one 2-core machine, loopback, no shaping",
              "settings": {k: str(v) for k, v in vars(args).items()}, "killed": killed, "plain": plain,
              "seed_spread": spread, "killed_vs_plain_seed0": gap, "within_spread": gap <= spread}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
