"""Where ACCO's gradient-norm spikes without clipping come from (issue 43; docs/acco_delay.md,
"ACCO without clipping: where the spikes come from").

Runs the benchmark's matched-batch protocol in-process: 2 workers (``engine.parallel.local_group
.spawn``, gloo over 127.0.0.1), the benchmark's model, data, held-out set and EngineConfig
(``benchmarks/worker.py`` ``engine_config`` of the spec ``benchmarks/runner.py`` ``train_spec``
writes for ``recipes/benchmark.py --global-batch B --samples N --lr LR --max-grad-norm 0``), so a
run is the benchmark's run of that engine mode with its per-round figures recorded. Nothing under
engine/ or acco_loco/ is changed: the strategy's ``run_round`` is wrapped on the instance (as
``engine/runtime/memory_accounting.py`` does), and the wrapper reads, on the comm thread, before
the round

* the round's global mean gradient: every worker's local gradient sum, all-reduced on the
  default (user's) group, over the global micro-batch count; its norm and its norm per kind of
  tensor (wte, wpe, ln, qkv, attn_proj, fc, mlp_proj) and per block;

and after it

* the gathered parameters (the estimate or the commit), their distance from the last committed
  ``theta_t`` per kind, in units of ``lr * sqrt(n)`` (1.0 = an RMS step of lr per coordinate, what
  Adam takes when its moments agree), the largest coordinate step in units of lr;
* after a commit: Adam's second moment on this worker's shard (bias-corrected, ``sqrt(v_hat)``
  summed per kind; the parent adds the two shards).

For ``acco`` a step is two rounds: ``est`` (the half accumulated on the estimate thetatilde_t,
stepped alone from theta_t into thetatilde_{t+1}) and ``fresh`` (the half accumulated on theta_t);
the commit steps theta_t with both. ``est_err`` = |theta_{t+1} - thetatilde_{t+1}| / |theta_{t+1} -
theta_t|: how far from theta_{t+1} the next step's stale half is accumulated, in steps.

    python benchmarks/acco_spikes.py --mode acco --lr 1e-3 --json /tmp/acco.json
    python benchmarks/acco_spikes.py --mode zero1 --lr 1e-3 --stop-after 40 --beta1 0.95
    python benchmarks/acco_spikes.py --mode acco --set n_layer=4 --set n_embd=128 --set seq_len=64
    python benchmarks/acco_spikes.py --thresholds   # the linearized stability limits, no run

Defaults: the 4.87M GPT-2 (6 x 256, 8 heads, byte vocabulary, seq 128, micro-batch 8: ACCO's 4
at B = 16), B = 16, 3072 samples (192 steps: 10 warmup steps, then cosine to 10%), seed 0,
AdamW (0.9, 0.999), eps 1e-8, no weight decay, no clipping, every run scored on the benchmark's
64 held-out sequences. ``--stop-after S`` ends the run after S steps on the same 192-step
schedule (the held-out loss is then at S steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# the benchmark's defaults (recipes/benchmark.py): the 4.87M GPT-2 of docs/acco_delay.md
WORKLOAD = {"model": "tiny-gpt2", "n_layer": 6, "n_embd": 256, "n_head": 8, "seq_len": 128, "micro_batch": 8,
            "eval_batches": 8, "eval_points": 8, "heldout": "hamlet", "max_grad_norm": 0.0, "comm_chunks": 8,
            "workers": 2}
KINDS = ("wte", "wpe", "ln", "qkv", "attn_proj", "fc", "mlp_proj")


def kind_of(name: str) -> str:
    for pat, k in (("wte", "wte"), ("wpe", "wpe"), ("ln_", "ln"), ("c_attn", "qkv"), ("attn.c_proj", "attn_proj"),
                   ("c_fc", "fc"), ("mlp.c_proj", "mlp_proj")):
        if pat in name:
            return k
    return "other"


def block_of(name: str) -> str:
    m = re.search(r"\.h\.(\d+)\.", name)
    return f"h{m.group(1)}" if m else ("emb" if ("wte" in name or "wpe" in name) else "ln_f")


def r4(x: float) -> float | None:
    return float(f"{x:.4g}") if math.isfinite(x) else None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


# ------------------------------------------------------------------ one worker (spawned)
def _worker(rank: int, world: int, spec: dict, overrides: dict, stop_steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from acco_loco.acco import RoundKind
    from benchmarks.worker import (
        SampleBudget,
        Snapshots,
        build_data,
        build_model,
        engine_config,
    )
    from engine import Engine, EngineConfig
    from lm.data import hf_lm_loss

    tok, stream, held = build_data(spec, rank, world)
    model = build_model(spec, len(tok))
    d = engine_config(spec).to_dict()
    for section, key, value in overrides:
        d[section][key] = value
    cfg = EngineConfig.from_dict(d)
    engine = Engine(model, cfg, loss_fn=hf_lm_loss)
    flat, strategy = engine.flat, engine.strategy
    beta2 = cfg.betas[1]
    # index tensors of each kind / block over the flat buffer (padding belongs to none)
    groups = {}
    for name, (a, b) in zip(flat.names, flat.offsets):
        for g in (kind_of(name), block_of(name)):
            groups.setdefault(g, []).append((a, b))
    idx = {g: torch.cat([torch.arange(a, b) for a, b in rs]) for g, rs in groups.items()}
    n_all = flat.numel
    lo, hi = rank * flat.shard_size, (rank + 1) * flat.shard_size
    shard_idx = {g: (i[(i >= lo) & (i < hi)] - lo) for g, i in idx.items() if g in KINDS}

    def norms(v: torch.Tensor) -> dict:
        return {g: float(v[i].norm()) for g, i in idx.items()}

    committed = flat.data.detach().clone()  # theta_0: every replica's parameters
    last_estimate = None  # thetatilde_{t+1}, this step's estimate
    rounds: list[dict] = []
    run_round = strategy.run_round

    def wrapped(ctx_, req):
        nonlocal committed, last_estimate
        g = ctx_.flat.grads[req.grad_index].detach().clone()
        small = torch.tensor([float(req.count), float(req.loss_sum)], dtype=torch.float64)
        dist.all_reduce(g)
        dist.all_reduce(small)
        count = small[0].item()
        row = {"round": req.index, "kind": req.kind.value, "step": req.step_index + 1}
        if count:
            g /= count
            row["half_norm"] = float(g.norm())
            row["half_loss"] = small[1].item() / count
            row["half_groups"] = norms(g)
        del g
        res = run_round(ctx_, req)
        row.update(lr=res.lr, grad_norm=res.grad_norm, loss=res.loss, skipped=res.skipped)
        new = res.gathered  # where the round gathered (its reduced gradient buffer, or ctx.gather_buf)
        delta = new - committed
        unit = res.lr * math.sqrt(n_all)
        row["step_rms_lr"] = float(delta.norm()) / unit
        row["step_max_lr"] = float(delta.abs().max()) / res.lr
        row["step_groups_rms_lr"] = {g: float(delta[i].norm()) / (res.lr * math.sqrt(i.numel()))
                                     for g, i in idx.items()}
        if req.kind is RoundKind.ESTIMATE:
            last_estimate = new.detach().clone()
        else:
            step_norm = float(delta.norm())
            if last_estimate is not None and step_norm > 0:
                row["est_err"] = float((new - last_estimate).norm()) / step_norm
            committed = new.detach().clone()
            st = ctx_.shard_state
            if st.exp_avg_sq is not None and st.step:
                sv = (st.exp_avg_sq / (1 - beta2 ** st.step)).sqrt()
                row["sqrt_vhat_sum"] = {k: float(sv[i].sum()) for k, i in shard_idx.items()}
                row["sqrt_vhat_n"] = {k: int(i.numel()) for k, i in shard_idx.items()}
        rounds.append(row)
        return res

    strategy.run_round = wrapped
    dist.barrier()
    t0 = time.perf_counter()
    snaps = Snapshots(spec["eval_points"], t0)
    budget = SampleBudget(engine, model, snaps, min(spec["samples"], stop_steps * spec["global_batch"]))
    try:
        engine.fit(budget.batches(stream, dealt=spec.get("data") == "dealt"))
        t_end = time.perf_counter()
        last_kind = engine.plan.kind(engine.round_index - 1)
        if last_kind is RoundKind.COMMIT and len(engine.history) > budget.seen:
            budget.catch_up(force=True)
        dist.barrier()
    finally:
        engine.close()
    evals = snaps.evaluate(model, held, rank, world)
    return {"rounds": rounds, "history": engine.history, "evals": evals, "train_s": t_end - t0,
            "config": cfg.to_dict()}


# ------------------------------------------------------------------ the linearized prediction
def step_matrix(mode: str, x: float, beta1: float):
    """One optimizer step on a quadratic of curvature h along one direction, Adam's moments taken
    as frozen (v fixed, so the step is EMA momentum preconditioned by 1/sqrt(v), x = lr h / sqrt(v)),
    as a linear map of the state. sync: [theta, u] with u = lr m / sqrt(v); acco: [theta,
    thetatilde, u], the estimate from theta_t with the stale half g(thetatilde_t), the commit from
    theta_t with the mean of g(thetatilde_t) and g(theta_t) (acco_loco/acco.py)."""
    import numpy as np

    b, c = beta1, (1 - beta1) * x
    if mode == "sync":
        return np.array([[1 - c, -b], [c, b]])
    return np.array([[1 - c / 2, -c / 2, -b], [1, -c, -b], [c / 2, c / 2, b]])


def threshold(mode: str, beta1: float, hi: float = 1e4) -> float:
    """The largest x at which the step's spectral radius is <= 1 (bisection)."""
    import numpy as np

    def stable(x):
        return max(abs(np.linalg.eigvals(step_matrix(mode, x, beta1)))) <= 1 + 1e-12

    lo = 1e-6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stable(mid) else (lo, mid)
    return lo


def print_thresholds(betas=(0.0, 0.9, 0.95, 0.98)) -> None:
    print("largest stable lr * h / sqrt(v) along one direction (momentum EMA, frozen v):")
    for b in betas:
        print(f"  beta1 {b:<5} sync {threshold('sync', b):8.3f} (2(1+b)/(1-b) = {2 * (1 + b) / (1 - b):8.3f})"
              f"   acco {threshold('acco', b):8.3f} (2/(1-b) = {2 / (1 - b):8.3f})")


# ------------------------------------------------------------------ the parent
def build_spec(a, workload: dict) -> dict:
    from benchmarks import runner
    from benchmarks.loss_grid import benchmark_args

    args = benchmark_args(a.global_batch, a.samples, a.mode, a.lr, workload)
    spec = runner.train_spec(args, a.mode, a.lr, a.seed)
    spec["max_grad_norm"] = a.max_grad_norm
    return spec


def per_step(rank_rounds: list[list[dict]], mode: str, group_steps: int) -> list[dict]:
    """One row per committed step: the commit's figures, for ACCO the estimate round's as ``est``,
    Adam's sqrt(v_hat) per kind over both shards; the figures per kind and block of tensors for
    the first ``group_steps`` steps only."""
    out, est = [], None
    for i, row in enumerate(rank_rounds[0]):
        if row["kind"] == "estimate":
            est = row
            continue
        s = {"step": row["step"], "lr": r4(row["lr"]), "loss": r4(row["loss"]), "grad_norm": r4(row["grad_norm"]),
             "skipped": row["skipped"], "step_rms_lr": r4(row["step_rms_lr"]),
             "step_max_lr": r4(row["step_max_lr"])}
        if mode == "acco" and est is not None:
            s["est"] = {"half_norm": r4(est.get("half_norm", float("nan"))),
                        "half_loss": r4(est.get("half_loss", float("nan"))),
                        "step_rms_lr": r4(est["step_rms_lr"]), "step_max_lr": r4(est["step_max_lr"])}
            s["fresh"] = {"half_norm": r4(row.get("half_norm", float("nan"))),
                          "half_loss": r4(row.get("half_loss", float("nan")))}
            if "est_err" in row:
                s["est_err"] = r4(row["est_err"])
        groups = row["step"] <= group_steps
        if mode == "acco" and est is not None and groups:
            s["est_half_groups"] = {g: r4(v) for g, v in est.get("half_groups", {}).items()}
            s["fresh_half_groups"] = {g: r4(v) for g, v in row.get("half_groups", {}).items()}
        elif groups:
            s["grad_groups"] = {g: r4(v) for g, v in row.get("half_groups", {}).items()}
        if groups:
            s["step_groups_rms_lr"] = {g: r4(v) for g, v in row["step_groups_rms_lr"].items()}
        if "sqrt_vhat_sum" in row:
            tot = {k: sum(rr[i]["sqrt_vhat_sum"].get(k, 0.0) for rr in rank_rounds) for k in KINDS}
            n = {k: sum(rr[i]["sqrt_vhat_n"].get(k, 0) for rr in rank_rounds) for k in KINDS}
            s["sqrt_vhat_mean"] = {k: r4(tot[k] / n[k]) for k in KINDS if n[k]}
        est = None
        out.append(s)
    return out


def compact_json(out: dict) -> str:
    """The run as JSON, one line per step (small files for docs/results)."""
    head = json.dumps({k: v for k, v in out.items() if k != "steps"}, indent=1)
    steps = ",\n  ".join(json.dumps(s, separators=(",", ":")) for s in out["steps"])
    return head[:-2] + ',\n "steps": [\n  ' + steps + "\n ]\n}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="acco", help="an engine mode of benchmarks/modes.py (zero1: DDP's equal)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--samples", type=int, default=3072, help="the budget the schedule is laid over")
    ap.add_argument("--stop-after", type=int, default=None, metavar="STEPS", help="end after this many steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-grad-norm", type=float, default=0.0)
    ap.add_argument("--beta1", type=float, default=None)
    ap.add_argument("--beta2", type=float, default=None)
    ap.add_argument("--warmup-steps", type=int, default=None, help="replace the protocol's warmup (5%% of the steps)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help=f"another workload than the 4.87M model's (fields: {', '.join(WORKLOAD)})")
    ap.add_argument("--json", default=None, help="write the run here")
    ap.add_argument("--print-steps", type=int, default=40, help="print the first N steps")
    ap.add_argument("--group-steps", type=int, default=60,
                    help="keep the figures per kind and block of tensors for the first N steps")
    ap.add_argument("--thresholds", action="store_true",
                    help="print the linearized stability thresholds of sync and ACCO steps and exit")
    a = ap.parse_args(argv)
    if a.thresholds:
        print_thresholds()
        return 0
    from benchmarks.loss_grid import workload_with

    workload = workload_with(WORKLOAD, a.set)
    spec = build_spec(a, workload)
    overrides = []
    if a.beta1 is not None or a.beta2 is not None:
        overrides.append(("optim", "betas", [0.9 if a.beta1 is None else a.beta1,
                                             0.999 if a.beta2 is None else a.beta2]))
    if a.warmup_steps is not None:
        overrides.append(("schedule", "warmup_steps", a.warmup_steps))
    steps = a.stop_after or 10**9
    from benchmarks.runner import worker_env
    from engine.parallel.local_group import spawn

    os.environ.update({k: v for k, v in worker_env(argparse.Namespace(workers=2), None).items()
                       if k != "WORLD_SIZE"})
    t = time.monotonic()
    res = spawn(_worker, workload["workers"], spec, overrides, steps, timeout=7200)
    wall = time.monotonic() - t
    rows = per_step([r["rounds"] for r in res], "acco" if spec["mode"].startswith("acco") else spec["mode"],
                    a.group_steps)
    evals = [{k: e[k] for k in ("samples", "step", "loss")} for e in
             (max((r["evals"][i] for r in res), key=lambda e: "loss" in e) for i in range(len(res[0]["evals"])))]
    cfg = res[0]["config"]
    out = {"about": "per-step figures of one engine run, clipped where max_grad_norm is set "
                    "(benchmarks/acco_spikes.py docstring)",
           "command": " ".join(shlex.quote(x) for x in ["python", "benchmarks/acco_spikes.py", *sys.argv[1:]]),
           "layout": f"{workload['workers']} workers on one machine (spawned processes, gloo over 127.0.0.1)",
           "mode": a.mode, "lr": a.lr, "seed": a.seed, "global_batch": a.global_batch,
           "samples_budget": a.samples, "steps_run": len(rows), "workload": workload,
           "micro_batch": spec["micro_batch"], "global_micro_batches": spec["global_micro_batches"],
           "betas": cfg["optim"]["betas"], "eps": cfg["optim"]["eps"], "max_grad_norm": cfg["optim"]["max_grad_norm"],
           "schedule": cfg["schedule"], "evals": evals,
           "final_loss": evals[-1].get("loss") if evals else None,
           "max_grad_norm_seen": max((s["grad_norm"] for s in rows if s["grad_norm"] is not None), default=None),
           "train_s": round(res[0]["train_s"], 1), "wall_s": round(wall, 1), "steps": rows}
    for s in rows[:a.print_steps]:
        line = (f"step {s['step']:>3} lr {s['lr']:.2e} loss {fmt(s['loss'], '.3f')} |G| {fmt(s['grad_norm'], '8.3f')} "
                f"step/lr {s['step_rms_lr']:.2f} max {s['step_max_lr']:.1f}")
        if "est" in s:
            line += (f" | est |g~| {fmt(s['est']['half_norm'], '8.3f')} fresh |g| {fmt(s['fresh']['half_norm'], '8.3f')}"
                     f" est-step/lr {s['est']['step_rms_lr']:.2f} est_err {fmt(s.get('est_err'), '.3f')}")
        if "sqrt_vhat_mean" in s:
            v = s["sqrt_vhat_mean"]
            line += f" | sqrt(v) attn_proj {v.get('attn_proj', 0):.2e} qkv {v.get('qkv', 0):.2e}"
        print(line, flush=True)
    print(f"held-out: {[(e['samples'], round(e.get('loss', float('nan')), 4)) for e in evals]}")
    print(f"final held-out {out['final_loss']}; largest |G| {out['max_grad_norm_seen']}; train {out['train_s']} s, "
          f"wall {out['wall_s']} s")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            f.write(compact_json(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
